"""Issue 12 (C20, C21): causal sliding windows, query i sees key j iff i - W < j <= i.

The schedule is checked exhaustively without processes (its blocks cover exactly the band,
masked blocks are square); the distributed paths against the float64 oracle with that
explicit mask (and the same document when packed) for ring, Ulysses and the grid; the
halo by counting what each rank sends.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import AttnCase, check_attention_cases, gradcheck_case, random_documents
from oracle import make_inputs
from ring_sp.kernels.reference import ReferenceKernel
from ring_sp.kernels.torch_cpu import TorchCPUKernel
from ring_sp.layouts import layout_positions
from ring_sp.plan import Cluster, ModelShape, PlanError, Workload, layer_bytes, plan
from ring_sp.schedule import BlockTask, exchange_plan, window_step_tasks
from ring_sp.schedule.blocks import bottom_right_window

PLAIN = ("contiguous", "zigzag", "striped")


def _windows(n_local: int, sp: int) -> list[int]:
    """1, inside a zigzag chunk, one shard, more than a shard, the whole sequence and beyond."""
    return sorted({1, max(2, n_local // 2 - 1), n_local, n_local + 3, n_local * sp, n_local * sp + 5})


# ---- the schedule (pure) -------------------------------------------------------------------

def _block_mask(task: BlockTask) -> torch.Tensor:
    """The block's band ``lo < c - a <= hi`` written out (BlockTask's docstring)."""
    nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
    a, c = torch.arange(nq).unsqueeze(1), torch.arange(nk).unsqueeze(0)
    mask = torch.ones(nq, nk, dtype=torch.bool)
    if task.causal:
        mask &= c - a <= task.diagonal
    if task.window is not None:
        mask &= c - a > task.diagonal - task.window
    return mask


@pytest.mark.parametrize("layout", PLAIN + ("document_zigzag",))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("native", [False, True])
def test_window_blocks_cover_exactly_the_band(layout: str, world_size: int, native: bool) -> None:
    """Every (rank, source): the blocks are disjoint, count their pairs right, and their union
    is the true mask from the global positions (and documents); without a native window
    argument no band block is issued."""
    for n_local, packed in itertools.product((6, 8), (False, True)):
        if layout == "document_zigzag" and not packed:
            continue
        seq = n_local * world_size
        cu = random_documents(seq, seed=seq, multiple=2 * world_size if layout == "document_zigzag" else 1) if packed else None
        positions = layout_positions(layout, world_size, seq, cu)
        doc = None if cu is None else torch.searchsorted(torch.tensor(cu), torch.arange(seq), right=True)
        for window, rank, source in itertools.product(_windows(n_local, world_size), range(world_size), range(world_size)):
            qp, kp = positions[rank].unsqueeze(1), positions[source].unsqueeze(0)
            truth = (kp <= qp) & (kp > qp - window)
            if doc is not None:
                truth &= doc[kp] == doc[qp]
            covered = torch.zeros(n_local, n_local, dtype=torch.bool)
            for task in window_step_tasks(layout, rank, source, world_size, n_local, window, cu, native):
                block = _block_mask(task)
                assert block.sum() == task.visible_pairs() > 0, task
                if native:  # one exact flash-attention window each, every row and key used
                    bottom_right_window(block.shape[0], block.shape[1], task.causal, task.window, task.diagonal)
                    assert block.any(1).all() and block.any(0).all(), task
                else:  # squares only; bands cut into causal and edge squares
                    assert task.diagonal == 0 and not (task.causal and task.window is not None), task
                    assert block.shape[0] == block.shape[1] or not (task.causal or task.window), task
                assert not (covered[task.q, task.kv] & block).any(), f"overlapping blocks: {task}"
                covered[task.q, task.kv] |= block
            assert torch.equal(covered, truth), (layout, world_size, n_local, packed, window, rank, source)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_halo_partners(world_size: int) -> None:
    """C21 (pure): contiguous with W <= shard exchanges with r - 1 / r + 1 only, zigzag with
    W <= chunk with at most two partners (steps 1 and R - 1), every other step nothing."""
    n = 16
    for window in (1, 2, n // 2, n):
        for rank in range(world_size):
            plan_ = exchange_plan("contiguous", True, rank, world_size, n, window=window)
            halo = window > 1
            assert [t for t in range(1, world_size) if plan_.receives[t]] == ([1] if halo and rank > 0 else [])
            assert [t for t in range(1, world_size) if plan_.sends[t]] == ([1] if halo and rank < world_size - 1 else [])
            if window <= n // 2:
                zig = exchange_plan("zigzag", True, rank, world_size, n, window=window)
                steps = {t for t in range(1, world_size) if zig.receives[t] or zig.sends[t]}
                assert steps <= {1, world_size - 1}, (window, rank, steps)
    full = exchange_plan("zigzag", True, 0, world_size, n)
    assert all(full.receives) and all(full.sends)  # no window: the full ring, as before


def test_window_keeps_contiguous_balanced_and_the_planner_prefers_it() -> None:
    """With W <= N/P every rank of contiguous does the same causal-window work (rank 0 a
    triangle less), so the planner picks contiguous: one partner instead of two."""
    work = ring_sp.schedule.causal_work_per_rank("contiguous", 4, 64, window=16)
    assert max(work) / (sum(work) / 4) < 1.05
    cluster = Cluster(world_size=8, gpus_per_node=8, flops=494.5e12, intra_bw=450e9, inter_bw=50e9)
    model = ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, layers=32)
    result = plan(cluster, model, Workload(seq_len=131072, sliding_window=4096), ulysses=1)
    assert result.recommended.layout == "contiguous"
    zigzag = next(c for c in result.candidates if c.layout == "zigzag")
    # per rank per layer: the last W - 1 = 4095 packed bf16 [k; v] tokens of 8 heads x 128 to one partner,
    # (the full ring: 7 shards of 16384), two such halos for zigzag, and their fp32 partials home
    assert result.recommended.bytes_fwd == {"ring_kv": 4095 * 2 * 8 * 128 * 2}
    assert zigzag.bytes_fwd == {"ring_kv": 2 * 4095 * 2 * 8 * 128 * 2}
    assert result.recommended.bytes_bwd["ring_dkv"] == 4095 * 2 * 8 * 128 * 4
    for work, message in ((Workload(seq_len=4096, causal=False, sliding_window=64), "needs causal"),
                          (Workload(seq_len=4096, sliding_window=0), "sliding-window=0 must be a positive integer")):
        with pytest.raises(PlanError, match=message):
            plan(cluster, model, work)


# ---- kernels -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_cpu_edge_block_matches_the_explicit_mask(dtype: torch.dtype) -> None:
    """The edge block (key c >= query a) on the fused CPU op, run as its causal mask on the
    reversed sequences, against the reference kernel's explicit mask, forward and backward."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 7, 4, 8, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 7, 2, 8, generator=g, dtype=dtype) for _ in range(2))
    ref, fused = ReferenceKernel(), TorchCPUKernel()
    out, lse = ref.forward(q, k, v, causal=False, scale=0.3, window=1)
    got_out, got_lse = fused.forward(q, k, v, causal=False, scale=0.3, window=1)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got_out, out, atol=tol, rtol=tol)
    torch.testing.assert_close(got_lse, lse, atol=tol, rtol=tol)
    expected = ref.backward(dout, q, k, v, out, lse, causal=False, scale=0.3, window=1)
    for got, want in zip(fused.backward(dout, q, k, v, out, lse, causal=False, scale=0.3, window=1), expected):
        torch.testing.assert_close(got, want, atol=10 * tol, rtol=10 * tol)
    with pytest.raises(ValueError, match="only the edge block"):
        fused.forward(q, k, v, causal=True, scale=0.3, window=3)


def test_flash_attn_window_arguments() -> None:
    """flash-attn's (left, right) for our blocks (its API; no GPU needed to check the mapping):
    square bands, the edge block, and bands of other shapes aligned bottom-right."""
    from ring_sp.kernels.flash_attn import _window_values

    assert _window_values(6, 6, True, 5)["window_size"] == (4, 0)  # band: a - 5 < c <= a
    assert _window_values(6, 6, False, 1)["window_size"] == (0, -1)  # edge: c >= a
    assert _window_values(6, 6, True, None) == {"causal": True, "is_causal": True}
    assert _window_values(3, 5, True, 2, 2)["window_size"] == (1, 0)  # 0 < c - a <= 2 on 3 x 5: bottom-right diagonal 2
    assert _window_values(4, 4, True, 9)["causal"]  # a window past the block is plain causal


@pytest.mark.parametrize("release", ["fa2.1", "fa2.3", "fa2.6", "fa3-2025", "fa3-newest"])
def test_flash_attn_passes_the_window_where_its_release_has_one(release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against fakes with each release's exact parameters (tests/test_kernels_cuda.py): >= 2.3
    gets window_size (left, right) in forward and backward; 2.1 has none, so the kernel says
    it cannot take bands (the schedule then cuts them) and refuses one rather than dropping it."""
    from test_kernels_cuda import RELEASES, _fake, _fill_grads

    from ring_sp.kernels import flash_attn as fa_backend
    from ring_sp.kernels.flash_attn import FlashAttnKernel

    fwd_params, bwd_params, layout = RELEASES[release]
    q, k = torch.randn(2, 5, 4, 16, dtype=torch.bfloat16), torch.randn(2, 5, 2, 16, dtype=torch.bfloat16)
    out_, lse_ = torch.randn_like(q), torch.randn(2, 4, 5)
    calls: list[dict] = []
    result = (lambda a: (out_, q, k, k, out_, lse_, None, None)) if layout == 8 else (lambda a: (out_, lse_, None, None))
    fake = type("FA", (), {})()
    fake._flash_attn_forward = _fake(fwd_params, calls, result)
    fake._flash_attn_backward = _fake(bwd_params, calls, _fill_grads)
    monkeypatch.setattr(fa_backend, "_interface", lambda: fake)
    kernel = FlashAttnKernel()
    if release == "fa2.1":
        assert not kernel.supports_window
        with pytest.raises(ValueError, match="only the edge block"):
            kernel.forward(q, k, k, causal=True, scale=0.125, window=3)
        return
    assert kernel.supports_window
    kernel.forward(q, k, k, causal=True, scale=0.125, window=3)
    kernel.backward(out_, q, k, k, out_, lse_, causal=False, scale=0.125, window=1)
    for call, expected in zip(calls, ((2, 0), (0, -1))):
        window = call.get("window_size", (call.get("window_size_left"), call.get("window_size_right")))
        assert tuple(window) == expected, (release, call)


# ---- against the oracle, on ranks ----------------------------------------------------------

def _ring_cases(world_size: int) -> list[AttnCase]:
    """Every layout x window (crossing every shard boundary) x dtype rotation, plus packed
    documents and the reference backend (the band blocks whole)."""
    dtypes = itertools.cycle(("fp64", "fp32", "bf16"))
    cases = []
    for layout, window in itertools.product(PLAIN, _windows(8, world_size)):
        cases.append(AttnCase("ring", layout, True, 1, 8, 4, 2, 8, next(dtypes), seed=len(cases), ring=world_size,
                              window=window))
    for layout in PLAIN + ("document_zigzag",):
        for window in (1, 3, 8):
            cases.append(AttnCase("ring", layout, True, 2, 8, 4, 1, 8, next(dtypes), seed=len(cases), ring=world_size,
                                  window=window, packed=True))
            cases.append(AttnCase("ring", layout, True, 1, 8, 4, 2, 8, "fp64", seed=len(cases), ring=world_size,
                                  window=window, packed=layout == "document_zigzag", backend="reference"))
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_window_ring_matches_the_oracle(pools, world_size: int) -> None:
    pools.get(world_size).run(check_attention_cases, _ring_cases(world_size), timeout=600)


@pytest.mark.parametrize("u,r", [(4, 1), (2, 2)])
def test_window_ulysses_and_grid_match_the_oracle(pools, u: int, r: int) -> None:
    mode = "ulysses" if r == 1 else "hybrid"
    layouts = PLAIN if r == 1 else ("zigzag", "contiguous")
    dtypes = itertools.cycle(("fp64", "fp32", "bf16"))
    cases = [AttnCase(mode, layout, True, 1, 8, 8, h_kv, 8, next(dtypes), seed=i, ulysses=u, ring=r, window=window,
                      packed=packed)
             for i, (layout, window, h_kv, packed) in enumerate(itertools.product(
                 layouts, (1, 5, 8, 13, 64), (2, 8), (False, True)))]
    pools.get(4).run(check_attention_cases, cases, timeout=600)


@pytest.mark.parametrize("mode,layout,u,r,world_size", [
    ("ring", "contiguous", 1, 2, 2), ("ring", "zigzag", 1, 3, 3), ("ring", "striped", 1, 2, 2),
    # the grid's gradcheck (14 s) is a sweep case: test_hybrid.py's grid gradcheck and the ring's here stay
    pytest.param("hybrid", "zigzag", 2, 2, 4, marks=pytest.mark.slow), ("ulysses", "zigzag", 1, 1, 2),
])
def test_window_float64_gradcheck(pools, mode: str, layout: str, u: int, r: int, world_size: int) -> None:
    """Gradcheck of the whole distributed function; window 3 crosses every shard (2 x SP tokens)."""
    assert all(pools.get(world_size).run(gradcheck_case, mode, layout, True, u, r, 3, timeout=300))


def window_covering_everything_is_plain_causal(layout: str) -> bool:
    inputs = make_inputs(5, 1, 32, 4, 2, 8, torch.float32)
    rank, size = dist.get_rank(), dist.get_world_size()
    results = []
    for window in (None, 32, 10**6):
        q, k, v = (ring_sp.shard_sequence(inputs[n], rank=rank, world_size=size, layout=layout).requires_grad_()
                   for n in ("q", "k", "v"))
        out = ring_sp.ring_attention(q, k, v, causal=True, layout=layout, sliding_window=window)
        out.backward(ring_sp.shard_sequence(inputs["dout"], rank=rank, world_size=size, layout=layout))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    return all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


def test_window_of_the_whole_sequence_is_bitwise_plain_causal(pools) -> None:
    for layout in PLAIN:
        assert all(pools.get(4).run(window_covering_everything_is_plain_causal, layout))


# ---- the halo, counted ---------------------------------------------------------------------

def count_window_traffic(layout: str, window: int, n: int, dtype: str) -> dict:
    from test_comm import _count_torch_collectives

    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(2, n, heads, 16, dtype=dt, requires_grad=True) for heads in (8, 2, 2))
    ring_sp.ring_attention(q, k, v, causal=True, layout=layout, sliding_window=window)  # agreement
    with _count_torch_collectives() as fwd_calls, ring_sp.count_communication() as fwd:
        out = ring_sp.ring_attention(q, k, v, causal=True, layout=layout, sliding_window=window)
    with _count_torch_collectives() as bwd_calls, ring_sp.count_communication() as bwd:
        out.backward(torch.randn_like(out))
    return {"rank": dist.get_rank(), "fwd": fwd.bytes_sent, "bwd": bwd.bytes_sent,
            "fwd_calls": fwd_calls.get("batch_isend_irecv", 0), "bwd_calls": bwd_calls.get("batch_isend_irecv", 0)}


@pytest.mark.parametrize("layout,window,limit", [("contiguous", 16, 1), ("contiguous", 5, 1), ("zigzag", 8, 2),
                                                 ("zigzag", 3, 2), ("contiguous", 1, 0), ("striped", 16, 3)])
def test_halo_bytes_per_rank(pools, layout: str, window: int, limit: int) -> None:
    """C21: forward KV bytes per rank <= ``limit`` packed shards (the full ring sends 3; the
    halo is the W - 1 rows a partner reads, the whole shard once that is 90% of it), the
    planner's per-rank model equals the count, and steps with nothing to compute on either
    side post no exchange at all."""
    n, world_size, dtype = 16, 4, "bfloat16"
    shard = 2 * 2 * n * 2 * 16 * 2  # packed [k; v]: 2 x batch 2 x n x 2 KV heads x 16 x bf16
    for res in pools.get(world_size).run(count_window_traffic, layout, window, n, dtype):
        rank = res["rank"]
        fwd, bwd = layer_bytes(ulysses=1, ring=world_size, batch=2, local_len=n, heads=8, kv_heads=2, head_dim=16,
                               dtype="bf16", layout=layout, sliding_window=window, ring_rank=rank)
        assert res["fwd"] == fwd and res["bwd"] == bwd, (rank, res, fwd, bwd)
        read = min(n, window - 1)
        halo = shard if layout == "striped" or read * 10 >= n * 9 else shard // n * read  # striped: every rank holds some
        assert res["fwd"].get("ring_kv", 0) <= limit * halo
        plan_ = exchange_plan(layout, True, rank, world_size, n, window=window)
        exchanging = sum(plan_.sends[t] or plan_.receives[t] for t in range(1, world_size))
        assert res["fwd_calls"] == exchanging
        assert res["bwd_calls"] == 2 * exchanging  # the KV again, and the dK/dV partials the other way


# ---- arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize("window,causal,error,match", [
    (0, True, ValueError, "sliding_window=0 must be >= 1"),
    (-3, True, ValueError, "sliding_window=-3"),
    (True, True, TypeError, "sliding_window must be an int"),
    (2.5, True, TypeError, "sliding_window must be an int"),
    (4, False, ValueError, "needs causal=True"),
])
def test_bad_windows_are_refused_before_any_collective(single_rank, window, causal, error, match) -> None:
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(error, match=match):
        ring_sp.ring_attention(q, q, q, causal=causal, sliding_window=window)
    with pytest.raises(error, match=match):
        ring_sp.SequenceParallelAttention(ring_sp.init_sequence_parallel(1, 1), causal=causal, sliding_window=window)


def disagreeing_windows() -> str:
    q = torch.randn(1, 8, 2, 4)
    try:
        ring_sp.ring_attention(q, q, q, causal=True, sliding_window=4 + dist.get_rank(), validate=True)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_disagree_on_the_window_fail_together(pools) -> None:
    for message in pools.get(2).run(disagreeing_windows):
        assert "disagree" in message and "sliding_window=5" in message and "sliding_window=4" in message


def module_window(window_default: int | None, window_call: int | None) -> bool:
    topo = ring_sp.init_sequence_parallel(1, dist.get_world_size())
    inputs = make_inputs(2, 1, 16, 2, 2, 4, torch.float64)
    q, k, v = (topo.shard_sequence(inputs[n], layout="zigzag") for n in ("q", "k", "v"))
    module = ring_sp.SequenceParallelAttention(topo, causal=True, sliding_window=window_default)
    out = module(q, k, v, sliding_window=window_call)
    expected = ring_sp.ring_attention(q, k, v, causal=True, sliding_window=window_call or window_default,
                                      group=topo.ring_group)
    return torch.equal(out, expected) and "sliding_window" in repr(module) if window_default else torch.equal(out, expected)


def test_module_window_default_and_per_call(pools) -> None:
    pool = pools.get(2)
    assert all(pool.run(module_window, 3, None)) and all(pool.run(module_window, None, 5))
    assert all(pool.run(module_window, 3, 6))
