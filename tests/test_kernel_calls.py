"""Issue 38 item 3: windows and packed documents compute only what the mask needs.

1. The pairs test: per schedule, the score pairs the kernel calls compute against the pairs
   the mask needs (ring_sp.schedule.rank_pair_count), windows and packed documents at P = 4
   and 8, ring and grid, for the flash op (bands whole, varlen calls) and the CPU op (cut
   blocks): at most 1.10x, with the kernel calls per step bounded.
2. The grouping (ring_sp.schedule.step_calls) and the band arithmetic
   (bottom_right_window) against masks written out.
3. tests/torch_flash_double.py (torch's flash ops on CPU) against the definition: dense and
   varlen, windows (with the right >= seqlen_k rule), segments without keys or queries.
4. TorchCUDAKernel's band and varlen paths through the double against the float64 oracle,
   forward and backward, bf16 and fp32 compute, batch 2 and head-major views.
5. The ring, Ulysses and the grid with backend="torch" routed to the CUDA kernel through the
   double, on gloo ranks, against the oracle (tests/dist_cases.py).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dist_cases import AttnCase, check_attention_cases, random_documents, random_spans
from oracle import GRAD_TOL, LSE_ATOL, OUT_TOL, assert_close, assert_lse_close, oracle_results
from ring_sp.kernels.base import Segments
from ring_sp.kernels.torch_cuda import TorchCUDAKernel
from ring_sp.ring.calls import CallPlan
from ring_sp.schedule import BlockTask, KernelCaps, bottom_right_window, rank_pair_count, step_calls
from ring_sp.schedule.pairs import call_pairs
from ring_sp.spans import as_spans
from test_flash_attn_double import _mask as flash_mask
from torch_flash_double import FlashDouble, installed, run_installed

FLASH = KernelCaps(bands=True, varlen=True)
CUT = KernelCaps()


def _band(nq: int, nk: int, lo: int | None, hi: int | None) -> torch.Tensor:
    """[nq, nk] True where lo < c - a <= hi (BlockTask's band in block coordinates)."""
    a, c = torch.arange(nq).unsqueeze(1), torch.arange(nk).unsqueeze(0)
    return (c - a > (-math.inf if lo is None else lo)) & (c - a <= (math.inf if hi is None else hi))


def _window_mask(nq: int, nk: int, left: int, right: int) -> torch.Tensor:
    """What flash-attention draws for ``(left, right)`` on ``nq x nk``: its documented bottom-right
    window, after its rule that a side reaching ``seqlen_k`` is unbounded."""
    return flash_mask(nq, nk, causal=False, left=-1 if left >= nk else left, right=-1 if right >= nk else right)


def _oracle(inputs: list[torch.Tensor], mask: torch.Tensor, scale: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The float64 oracle of ``mask`` ``[sq, sk]`` on ``[b, s, h, d]`` inputs, and the dout to feed:
    rows that see no key get lse -inf and out 0, and a zero dout (their gradients are 0 then)."""
    q, k, v, dout = inputs
    seen = mask.any(-1)
    full = mask | ~seen.unsqueeze(-1)
    seen = seen.to(dout.device)
    dout = dout.masked_fill(~seen.view(1, -1, 1, 1), 0)
    want = oracle_results(dict(q=q, k=k, v=v, dout=dout), causal=False, scale=scale, mask=full)
    want["lse"] = want["lse"].masked_fill(~seen.view(1, 1, -1), -math.inf)
    want["out"] = want["out"].masked_fill(~seen.view(1, -1, 1, 1), 0)
    return want, dout


# ---- 1. the pairs test ---------------------------------------------------------------------

def _pair_cases() -> list[tuple[str, int, int, int | None, bool]]:
    """(layout, U, R, window, packed): windows and packed documents at P = U x R = 4 and 8."""
    cases = []
    for p, (window, packed) in itertools.product((4, 8), ((12, False), (None, True), (12, True))):
        for layout in ("contiguous", "zigzag", "striped", "document_zigzag"):
            if layout == "document_zigzag" and not packed:
                continue
            cases.append((layout, 1, p, window, packed))  # the ring
            if layout != "striped":  # striped cannot feed a U x R grid
                cases.append((layout, 2, p // 2, window, packed))
    return cases


@pytest.mark.parametrize("caps", [FLASH, pytest.param(CUT, marks=pytest.mark.slow)], ids=["flash", "cut"])
def test_calls_compute_only_what_the_mask_needs(caps: KernelCaps) -> None:
    """Every rank's calls compute at most 1.10x the pairs its mask needs (here: exactly them),
    and with bands and varlen calls a step is one or two calls (windows and packed documents
    alike), where the cut schedule needs one per block."""
    torch.set_num_threads(1)
    most = {}
    for layout, u, r, window, packed in _pair_cases():
        n = 48 * u  # the ring shard: 48 tokens per SP rank
        cu = random_documents(n * r, seed=n * r + u, multiple=2 * u * r if layout == "document_zigzag" else 1) \
            if packed else None
        for rank in range(r):
            count = rank_pair_count(layout, True, rank, r, n, cu, window, ulysses_size=u, caps=caps)
            assert count.needed <= count.computed <= 1.10 * count.needed, (layout, u, r, window, packed, rank, count)
            key = (layout, window is not None, packed)
            most[key] = max(most.get(key, 0), max(count.calls))
    if caps is FLASH:
        assert all(calls <= 2 for (layout, windowed, packed), calls in most.items() if not windowed), most
        assert all(calls <= 3 for (_, windowed, packed), calls in most.items() if windowed and not packed), most
    else:
        assert max(most.values()) > 3  # the cut schedule: a call per block (the control)


def test_span_calls_compute_only_what_the_mask_needs() -> None:
    """Issue 41's work target through the same count: with bidirectional spans (cut by shards, one
    token long, touching) the calls compute at most 1.15x the pairs the mask needs (here: exactly
    them), causal and windowed, ring and grid, at P = 4 and 8; the count itself sees the spans
    (a control: the same schedule without them needs fewer pairs)."""
    torch.set_num_threads(1)
    for (layout, u, r, window, packed), caps in zip(_pair_cases()[::3], itertools.cycle((FLASH, CUT))):
        n = 48 * u
        cu = random_documents(n * r, seed=n * r + u, multiple=2 * u * r if layout == "document_zigzag" else 1) \
            if packed else None
        spans = as_spans(random_spans(cu or (0, n * r), seed=n + r))
        for rank in range(r):
            count = rank_pair_count(layout, True, rank, r, n, cu, window, ulysses_size=u, caps=caps, spans=spans)
            assert count.needed <= count.computed <= 1.15 * count.needed, (layout, u, r, window, packed, rank, count)
        plain = rank_pair_count(layout, True, 0, r, n, cu, window, ulysses_size=u, caps=caps)
        assert plain.needed < rank_pair_count(layout, True, 0, r, n, cu, window, ulysses_size=u, caps=caps,
                                              spans=spans).needed


def test_explicit_masks_count_whole_rectangles() -> None:
    """A kernel that masks with a dense tensor computes a masked block's whole rectangle."""
    band = BlockTask(slice(0, 8), slice(0, 8), True, 3)
    (call,) = step_calls((band,), KernelCaps(bands=True, explicit_masks=True))
    assert call_pairs(call, KernelCaps(bands=True, explicit_masks=True)) == 64
    assert call_pairs(call, FLASH) == band.visible_pairs() == 1 + 2 + 6 * 3  # rows see 1, 2, then 3 keys
    assert call_pairs(call, FLASH, tile=(4, 4)) == 3 * 16  # three 4x4 tiles hold a pair of the band


# ---- 2. grouping and band arithmetic -------------------------------------------------------

def test_bottom_right_window_states_exactly_the_band() -> None:
    """Every trimmed band of small shapes: flash-attention's mask with the window (its own
    right >= seqlen_k -> unbounded rule included) is exactly the band, or it is refused."""
    for nq, nk, lo, hi in itertools.product(range(1, 6), range(1, 6), [None, *range(-7, 5)], [None, *range(-5, 7)]):
        if lo is not None and hi is not None and hi <= lo:
            continue
        mask = _band(nq, nk, lo, hi)
        causal, diagonal = hi is not None, hi if hi is not None else (lo + 1 if lo is not None else 0)
        window = None if lo is None else diagonal - lo
        try:
            left, right = bottom_right_window(nq, nk, causal, window, diagonal)
        except ValueError:
            trimmed = mask.any(1).all() and mask.any(0).all()
            assert not trimmed or nk <= hi - (nk - nq) < nq - 1, (nq, nk, lo, hi)  # only flash's rule refuses
            continue
        assert torch.equal(_window_mask(nq, nk, left, right), mask), (nq, nk, lo, hi, left, right)


def _chain_blocks(g: torch.Generator) -> tuple[BlockTask, ...]:
    """Random blocks of one step: disjoint rows, some sharing keys, plain, causal and bands."""
    blocks, row = [], 0
    for _ in range(6):
        row += int(torch.randint(0, 3, (1,), generator=g))
        nq = int(torch.randint(1, 6, (1,), generator=g))
        nk = int(torch.randint(1, 6, (1,), generator=g))
        key = int(torch.randint(0, 12, (1,), generator=g))
        kind = int(torch.randint(0, 3, (1,), generator=g))
        q, kv = slice(row, row + nq), slice(key, key + nk)
        blocks.append(BlockTask(q, kv, False) if kind == 0 or nq != nk else BlockTask(q, kv, True, 2 if kind == 2 else None))
        row += nq
    return tuple(blocks)


def test_step_calls_group_chains_exactly() -> None:
    """Each block in exactly one call; a varlen call's segments are consecutive slices of its
    rows and keys, its real segments its blocks in order, whose bands its one window draws
    exactly; fillers empty on one side; without varlen, or for windows a kernel without bands
    cannot state, one call each. A 1-row causal block joins the causal squares' call."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        blocks = _chain_blocks(g)
        calls = step_calls(blocks, FLASH)
        assert sorted(id(t) for c in calls for t in c.blocks) == sorted(id(t) for t in blocks)
        assert len(calls) <= len(blocks)
        for call in calls:
            if not call.segments:
                assert len(call.blocks) == 1 and (call.q, call.kv) == (call.blocks[0].q, call.blocks[0].kv)
                continue
            cu_q, cu_k = call.offsets()
            assert cu_q[-1] == call.q.stop - call.q.start and cu_k[-1] == call.kv.stop - call.kv.start
            real = [(call.q.start + a, call.q.start + b, call.kv.start + c, call.kv.start + d)
                    for a, b, c, d, (nq, nk) in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], call.segments) if nq and nk]
            assert real == [(t.q.start, t.q.stop, t.kv.start, t.kv.stop) for t in call.blocks]
            max_k = call.max_lengths()[1]  # the varlen op drops a side reaching the longest segment's keys
            left, right = (-1 if side >= max_k else side for side in call.window)
            for task in call.blocks:  # the call's one window draws each block's band exactly
                rows, keys = task.q.stop - task.q.start, task.kv.stop - task.kv.start
                assert torch.equal(flash_mask(rows, keys, causal=False, left=left, right=right),
                                   _band(rows, keys, *task.band())), (task, call.window)
        assert step_calls(blocks, KernelCaps(bands=True)) == tuple(step_calls((t,), FLASH)[0] for t in blocks)
    edge = (BlockTask(slice(0, 4), slice(0, 4), False, 1), BlockTask(slice(4, 8), slice(4, 8), False, 1))
    assert len(step_calls(edge, KernelCaps(varlen=True))) == 2  # no window arguments: flipped, one by one
    assert len(step_calls(edge, FLASH)) == 1
    documents = tuple(BlockTask(slice(a, b), slice(a, b), True) for a, b in ((0, 3), (3, 4), (4, 9), (9, 10)))
    (call,) = step_calls(documents, KernelCaps(varlen=True))
    assert call.window == (-1, 0) and call.segments == ((3, 3), (1, 1), (5, 5), (1, 1))


# ---- 3. the double against the definition --------------------------------------------------

def _inputs(shape_q: tuple[int, ...], shape_k: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in (shape_q, shape_k, shape_k, shape_q)]


def _checked(want: dict[str, torch.Tensor], out: torch.Tensor, lse: torch.Tensor, grads, dtype: torch.dtype,
             empty_lse: float) -> None:
    """Rows that see no key: out 0 and lse ``empty_lse`` (the op's +inf, the kernel's -inf)."""
    seen = torch.isfinite(want["lse"])
    assert (lse[~seen] == empty_lse).all() and not out.transpose(1, 2)[~seen].any()
    assert_close("out", out, want["out"], OUT_TOL[dtype])
    assert_lse_close("lse", lse.masked_fill(~seen, -math.inf), want["lse"], LSE_ATOL[dtype])
    for got, name in zip(grads, ("dq", "dk", "dv")):
        assert got.dtype == dtype
        assert_close(name, got, want[name], GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_double_dense_matches_the_definition(dtype: torch.dtype) -> None:
    """Dense calls: causal, windows, and the right >= seqlen_k rule (a negative control: the
    window 7 on a 9 x 4 block shows keys a right bound of 7 would hide)."""
    double = FlashDouble(float32=True)
    for sq, sk, causal, left, right, drawn in ((6, 6, True, None, None, (-1, 0)), (5, 9, True, None, None, (-1, 0)),
                                               (9, 4, False, 2, 1, (2, 1)), (6, 6, False, 0, None, (0, -1)),
                                               (9, 4, False, None, 7, (-1, -1))):
        inputs = _inputs((2, sq, 4, 16), (2, sk, 2, 16), dtype, seed=sq * sk)
        want, dout = _oracle(inputs, flash_mask(sq, sk, causal=False, left=drawn[0], right=drawn[1]), 0.3)
        q, k, v, _ = inputs
        out, lse = double.forward(q, k, v, None, None, sq, sk, 0.0, causal, False, scale=0.3, window_size_left=left,
                                  window_size_right=right)[:2]
        grads = double.backward(dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, None, None, scale=0.3,
                                window_size_left=left, window_size_right=right)
        _checked(want, out, lse, grads, dtype, math.inf)
    assert not torch.equal(flash_mask(9, 4, causal=False, right=7), flash_mask(9, 4, causal=False))  # the rule matters


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_double_varlen_matches_the_definition(dtype: torch.dtype) -> None:
    """Segments (keys without queries, queries without keys, ragged), one window for all, each
    aligned to its own bottom-right corner, windows normalised by the longest segment."""
    segments = [(3, 5), (0, 2), (4, 0), (5, 5), (2, 6)]
    double = FlashDouble(float32=True)
    for causal, left, right in ((True, None, None), (False, None, None), (False, 1, 0), (False, 0, 2)):
        total_q, total_k = sum(s[0] for s in segments), sum(s[1] for s in segments)
        q, k, v, dout = _inputs((1, total_q, 4, 16), (1, total_k, 2, 16), dtype, seed=7)
        mask = torch.zeros(total_q, total_k, dtype=torch.bool)
        cu_q, cu_k = [0], [0]
        for nq, nk in segments:  # each segment bottom-right; sides normalised by the longest segment (6 keys)
            l, r = -1 if left is None else left, 0 if causal else (-1 if right is None else right)
            if nq and nk:
                mask[cu_q[-1]:cu_q[-1] + nq, cu_k[-1]:cu_k[-1] + nk] = flash_mask(nq, nk, causal=False, left=l, right=r)
            cu_q.append(cu_q[-1] + nq)
            cu_k.append(cu_k[-1] + nk)
        want, dout = _oracle([q, k, v, dout], mask, 0.3)
        offsets = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
        out, lse = double.forward(q[0], k[0], v[0], *offsets, 5, 6, 0.0, causal, False, scale=0.3,
                                  window_size_left=left, window_size_right=right)[:2]
        assert lse.shape == (4, total_q)
        grads = double.backward(dout[0], q[0], k[0], v[0], out, lse, *offsets, 5, 6, 0.0, causal, None, None,
                                scale=0.3, window_size_left=left, window_size_right=right)
        _checked(want, out[None], lse[None], [g[None] for g in grads], dtype, math.inf)
    one = [torch.tensor([0, 1, 1, 2], dtype=torch.int32), torch.tensor([0, 2, 3, 5], dtype=torch.int32)]
    q, k, v, _ = _inputs((2, 4, 16), (5, 2, 16), torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="invalid for input"):  # max_q 1, GQA, no window: one query per segment
        double.forward(q, k, v, *one, 1, 2, 0.0, False, False)


# ---- 4. TorchCUDAKernel's band and varlen paths through the double -------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_kernel_bands_through_the_double(dtype: torch.dtype) -> None:
    """Bands of any shape as ONE flash call: against the oracle with the band as its mask."""
    with installed(float32=True):
        kernel = TorchCUDAKernel(flash=True)
        assert kernel.supports_window and kernel.supports_varlen
        for nq, nk, causal, window, diagonal in ((5, 9, True, 3, 5), (4, 9, True, None, 6), (6, 6, False, 1, 0),
                                                 (9, 4, False, 2, -6), (8, 8, True, 3, 0), (3, 8, True, 9, 6)):
            inputs = _inputs((2, nq, 4, 16), (2, nk, 2, 16), dtype, seed=nq + nk)
            lo, hi = (None if window is None else diagonal - window), (diagonal if causal else None)
            want, dout = _oracle(inputs, _band(nq, nk, lo, hi), 0.25)
            q, k, v, _ = inputs
            out, lse = kernel.forward(q, k, v, causal=causal, scale=0.25, window=window, diagonal=diagonal)
            grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25, window=window,
                                    diagonal=diagonal)
            _checked(want, out, lse, grads, dtype, -math.inf)
        q = torch.zeros(2, 9, 4, 16, dtype=dtype)
        with pytest.raises(ValueError, match="first rows without a key"):  # rows 0-2 would get lse +inf
            kernel.forward(q, q[:, :4], q[:, :4], causal=True, scale=0.25, diagonal=-3)


def _segmented(blocks: tuple[BlockTask, ...], b: int, n: int, dtype: torch.dtype, head_major: bool, seed: int,
               head_dim: int = 16):
    """Inputs over ``n`` rows and keys ([b, s, h, d], or views of [b, h, s, d] storage) and the
    float64 oracle of the blocks (each row in at most one block, fed its own statistics)."""
    g = torch.Generator().manual_seed(seed)

    def make(h: int) -> torch.Tensor:
        x = torch.randn(b, h, n, head_dim, generator=g, dtype=torch.float64).to(dtype)
        return x.transpose(1, 2) if head_major else x.transpose(1, 2).contiguous()

    q, k, v, dout = make(4), make(2), make(2), make(4)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in blocks:
        mask[t.q, t.kv] = _band(t.q.stop - t.q.start, t.kv.stop - t.kv.start, *t.band())
    want, dout = _oracle([q, k, v, dout], mask, 0.25)
    return (q, k, v, dout), want


@pytest.mark.parametrize("b,head_major,dtype", [(1, False, torch.bfloat16), (2, True, torch.bfloat16),
                                                (2, False, torch.float32), (1, True, torch.float32)])
def test_cuda_kernel_segments_through_the_double(b: int, head_major: bool, dtype: torch.dtype) -> None:
    """A step's blocks as varlen calls over views (filler segments between them): each call's
    rows and keys against the oracle; rows no block covers come back out 0 and lse -inf."""
    blocks = (BlockTask(slice(0, 4), slice(2, 6), True, None, 1), BlockTask(slice(5, 8), slice(7, 10), True, None, 1),
              BlockTask(slice(9, 12), slice(11, 16), True, None, 3))  # 4x4, 3x3, 3x5: all (left, right) = (-1, 1)
    (q, k, v, dout), want = _segmented(blocks, b, 16, dtype, head_major, seed=b)
    with installed(float32=True):
        kernel = TorchCUDAKernel(flash=True)
        plan = CallPlan((blocks,), FLASH)
        (launches,) = plan.launches(torch.device("cpu"))
        assert len(launches) == 1 and launches[0].segments is not None and launches[0].call.fills_rows
        call, segments = launches[0]
        rows, keys = call.q, call.kv
        out, lse = kernel.forward_segments(q[:, rows], k[:, keys], v[:, keys], segments, scale=0.25)
        grads = kernel.backward_segments(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out, lse, segments,
                                         scale=0.25)
    part = {name: want[name][:, rows] for name in ("out", "dq")} | {"lse": want["lse"][:, :, rows]}
    part |= {name: want[name][:, keys] for name in ("dk", "dv")}
    _checked(part, out, lse, grads, dtype, -math.inf)


def test_segments_refused_where_the_kernel_has_none() -> None:
    with installed():
        cu = torch.tensor([0, 2], dtype=torch.int32)
        x = torch.zeros(1, 2, 2, 8, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="takes no segments"):
            TorchCUDAKernel(flash=False).forward_segments(x, x, x, Segments(cu, cu, 2, 2, (-1, 0), False), scale=1.0)


# ---- 5. ring, Ulysses and the grid through the double --------------------------------------

def _dist_cases() -> list[AttnCase]:
    """4 ranks: windows on each layout (bands whole), packed documents (varlen calls; causal and
    not), both together, Ulysses (one rank's one varlen call) and the 2 x 2 grid."""
    dtypes = itertools.cycle(("fp32", "bf16"))
    cases: list[AttnCase] = []

    def add(mode: str, layout: str, causal: bool = True, **extra) -> None:
        u, r = {"ring": (1, 4), "ulysses": (4, 1), "hybrid": (2, 2)}[mode]
        cases.append(AttnCase(mode, layout, causal, 1, 12, 4, 2, 16, next(dtypes), seed=len(cases), ulysses=u, ring=r,
                              backend="torch", **extra))

    for layout, window in (("contiguous", 7), ("striped", 9)):  # zigzag's two halo partners: the grid's case
        add("ring", layout, window=window)
    add("ring", "document_zigzag", packed=True)
    add("ring", "document_zigzag", False, packed=True)
    add("ring", "contiguous", packed=True, window=6)
    add("ulysses", "document_zigzag", packed=True)
    add("hybrid", "zigzag", packed=True, window=5)
    return cases


def test_distributed_through_the_double(pools) -> None:
    pools.get(4).run(run_installed, True, check_attention_cases, _dist_cases(), timeout=600)
