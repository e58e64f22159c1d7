"""Issue 23 part A: the flash_attn backend computes, on CPU, through flash-attn's CPU double.

Three layers, each against the float64 autograd oracle of oracle.py (explicit masks):

1. the double itself (tests/flash_attn_double.py) per release: causal alignment for seq_q != seq_k
   (top-left in 2.0, bottom-right from 2.1), windows, softcap, ALiBi, lse = +inf on rows that
   see nothing, the dense read of softmax_lse, the in-place dq/dk/dv, the return tuples and
   flash-attn's refusals. A double that is wrong here would make the layers below meaningless.
2. ring_sp's FlashAttnKernel (the signature shim) on each release: blocks, the two-key-block
   global-statistics backward with a strided global lse, window bands and edge blocks.
3. ring, Ulysses and the grid with ``backend="flash_attn"`` on gloo ranks, each rank installing
   the double in its own process: layouts, causal, GQA, packed documents, windows, sinks; bf16
   and fp16 (flash-attn takes no fp32, and ring_sp refuses it before the double is reached).
   A fixed sample runs by default; the sweep over every release is ``-m slow``.
"""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch

from block_checks import check_two_key_blocks
from dist_cases import AttnCase, check_attention_cases
from flash_attn_double import RELEASES, installed, parameters, run_installed
from oracle import GRAD_TOL, LSE_ATOL, OUT_TOL, assert_close, assert_lse_close, oracle_results
from ring_sp.kernels import get_kernel

CPU = torch.device("cpu")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
WINDOWED = [r for r in RELEASES if r not in ("2.0", "2.1")]


def _inputs(b: int, sq: int, sk: int, h: int, h_kv: int, d: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = dict(q=(b, sq, h, d), k=(b, sk, h_kv, d), v=(b, sk, h_kv, d), dout=(b, sq, h, d))
    return {n: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for n, s in shapes.items()}


def _mask(sq: int, sk: int, *, causal: bool, left: int = -1, right: int = -1, top_left: bool = False) -> torch.Tensor:
    """flash-attn's documented visibility, written out: query i sits at key position i (2.0) or
    i + sk - sq (>= 2.1, "aligned to the bottom right corner"); it sees keys in
    [pos - left, pos + right], causal meaning right = 0, -1 meaning unbounded."""
    pos = torch.arange(sq).unsqueeze(1) + (0 if top_left else sk - sq)
    j = torch.arange(sk).unsqueeze(0)
    right = 0 if causal else right
    return (j <= pos + right if right >= 0 else True) & (j >= pos - left if left >= 0 else True) & torch.ones(sq, sk, dtype=torch.bool)


def _window_args(release: str, left: int, right: int) -> dict:
    return dict(window_size_left=left, window_size_right=right) if release == "2.7" else dict(window_size=(left, right))


def _call(fn, **values):
    """Call an entry point with the values its release names; the rest at flash-attn's neutral values."""
    neutral = dict(dropout_p=0.0, softcap=0.0, alibi_slopes=None, deterministic=False, return_softmax=False)
    return fn(**{name: values.get(name, neutral.get(name)) for name in parameters(fn) if name != "rng_state"})


def _check_against(want: dict[str, torch.Tensor], out, lse, grads, dtype: torch.dtype) -> None:
    seen = torch.isfinite(want["lse"])
    assert torch.isposinf(lse[~seen]).all(), "a row that sees no key has lse = +inf in flash-attn"
    assert not out.transpose(1, 2)[~seen].any(), "and out = 0"
    assert_close("out", out, want["out"], OUT_TOL[dtype])
    assert_lse_close("lse", lse.masked_fill(~seen, -math.inf), want["lse"], LSE_ATOL[dtype])
    for got, name in zip(grads, ("dq", "dk", "dv")):
        assert got.dtype == dtype
        assert_close(name, got, want[name], GRAD_TOL[dtype])


# ---- 1. the double against the definition ----------------------------------------------------

SHAPES = [  # (sq, sk, causal, left, right): square, more keys, more queries (rows that see nothing)
    (9, 9, True, -1, -1), (9, 9, False, -1, -1), (5, 12, True, -1, -1), (12, 5, True, -1, -1), (1, 7, True, -1, -1),
]
WINDOWS = [(9, 9, True, 3, -1), (9, 9, False, 0, -1), (6, 11, False, 2, 1), (11, 6, False, -1, 2), (7, 7, True, 50, -1)]


@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF)
@pytest.mark.parametrize("release", RELEASES)
def test_double_matches_the_definition(release: str, dtype: torch.dtype) -> None:
    fa = _interface(release)
    for index, (sq, sk, causal, left, right) in enumerate(SHAPES + (WINDOWS if release in WINDOWED else [])):
        inputs = _inputs(2, sq, sk, 4, 2, 16, dtype, seed=index)
        q, k, v, dout = inputs.values()
        mask = _mask(sq, sk, causal=causal, left=left, right=right, top_left=release == "2.0")
        want = oracle_results(inputs, causal=False, scale=0.3, mask=mask)
        window = _window_args(release, left, right) if release in WINDOWED else {}
        res = _call(fa._flash_attn_forward, q=q, k=k, v=v, softmax_scale=0.3, causal=causal, **window)
        out, lse = (res[0], res[5]) if len(res) == 8 else res[:2]
        assert lse.dtype == torch.float32 and lse.shape == (2, 4, sq) and lse.is_contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        back = _call(fa._flash_attn_backward, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
                     softmax_scale=0.3, causal=causal, is_causal=causal, **window)
        if release == "2.7":
            assert back.shape == (2, 4, 128)  # softmax_d [b, h, seqlen_q rounded to 128]
        else:
            assert back[0] is dq and back[1] is dk and back[2] is dv  # written in place, returned
        _check_against(want, out, lse, (dq, dk, dv), dtype)


def test_causal_alignment_differs_between_2_0_and_2_1() -> None:
    """Negative control of the alignment: on a non-square block the two releases disagree (and
    each matches its own mask above); on the square blocks ring_sp issues they agree exactly."""
    for sq, sk, same in ((4, 7, False), (6, 6, True)):
        q, k, v, _ = _inputs(1, sq, sk, 2, 2, 8, torch.bfloat16, seed=3).values()
        outs = [_call(_interface(r)._flash_attn_forward, q=q, k=k, v=v, softmax_scale=0.5, causal=True)[0]
                for r in ("2.0", "2.1")]
        assert torch.equal(*outs) == same


def _definition(inputs: dict[str, torch.Tensor], scale: float, causal: bool, softcap: float,
                slopes: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """float64 autograd of softcap * tanh(scale q.k / softcap) + ALiBi bias (flash-attn's README
    and alibi.h: + slope * j under a causal mask, else - slope * |i + sk - sq - j|)."""
    q, k, v = (inputs[n].detach().double().requires_grad_() for n in ("q", "k", "v"))
    h, sq, sk = q.shape[2], q.shape[1], k.shape[1]
    ke, ve = (t.repeat_interleave(h // t.shape[2], 2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        i, j = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
        bias = j.double().expand(sq, sk) if causal else -(i + sk - sq - j).abs().double()
        s = s + slopes.double().reshape(-1, h, 1, 1) * bias
    s = s.masked_fill(~_mask(sq, sk, causal=causal), -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse.unsqueeze(-1)), ve)
    out.backward(inputs["dout"].double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("release", ["2.4.0", "2.6", "2.7"])
@pytest.mark.parametrize("causal", [False, True])
def test_double_softcap_and_alibi(release: str, causal: bool) -> None:
    fa = _interface(release)
    inputs = _inputs(2, 6, 8, 4, 2, 16, torch.bfloat16, seed=5)
    q, k, v, dout = inputs.values()
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.05]])
    softcap = 0.0 if release == "2.4.0" else 2.0
    want = _definition(inputs, 0.4, causal, softcap, slopes)
    res = _call(fa._flash_attn_forward, q=q, k=k, v=v, softmax_scale=0.4, causal=causal, softcap=softcap,
                alibi_slopes=slopes, **_window_args(release, -1, -1))
    out, lse = (res[0], res[5]) if len(res) == 8 else res[:2]
    grads = [torch.empty_like(t) for t in (q, k, v)]
    _call(fa._flash_attn_backward, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=grads[0], dk=grads[1],
          dv=grads[2], softmax_scale=0.4, causal=causal, softcap=softcap, alibi_slopes=slopes,
          **_window_args(release, -1, -1))
    _check_against(want, out, lse, grads, torch.bfloat16)
    if softcap:  # negative control: the cap changes the result at these scores
        plain = _definition(inputs, 0.4, causal, 0.0, slopes)
        with pytest.raises(AssertionError):
            assert_close("out", out, plain["out"], OUT_TOL[torch.bfloat16])


def test_double_reads_softmax_lse_as_a_dense_buffer_and_keeps_flash_attns_refusals() -> None:
    fa21, fa27 = _interface("2.1"), _interface("2.7")
    q, k, v, dout = _inputs(2, 5, 5, 4, 2, 16, torch.bfloat16, seed=6).values()
    out, lse = fa27._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)[:2]
    grads = lambda: [torch.empty_like(t) for t in (q, k, v)]  # noqa: E731
    right, strided = grads(), grads()
    fa21._flash_attn_backward(dout, q, k, v, out, lse, *right, 0.0, 0.25, True)
    # the same values in a [b, sq, h] buffer seen as [b, h, sq]: the kernel indexes the pointer densely
    fa21._flash_attn_backward(dout, q, k, v, out, lse.transpose(1, 2).contiguous().transpose(1, 2), *strided,
                              0.0, 0.25, True)
    assert not torch.equal(right[0], strided[0])
    refusals = [
        (lambda: fa27._flash_attn_forward(q.float(), k.float(), v.float(), 0.0, 0.25, True, -1, -1, 0.0, None, False),
         "only support fp16 and bf16"),
        (lambda: fa27._flash_attn_forward(q, k, v, 0.1, 0.25, True, -1, -1, 0.0, None, False), "dropout"),
        (lambda: fa21._flash_attn_forward(q, k, v, 0.0, 0.25, True, True), "return_softmax is only supported"),
        (lambda: fa27._flash_attn_forward(q[..., :12], k[..., :12], v[..., :12], 0.0, 0.25, True, -1, -1, 0.0, None,
                                          False), "multiple of 8"),
        (lambda: fa21._flash_attn_backward(dout, q, k, v, out.float(), lse, *grads(), 0.0, 0.25, True),
         "query and out must have the same dtype"),
        (lambda: fa21._flash_attn_backward(dout, q, k, v, out, lse.double(), *grads(), 0.0, 0.25, True),
         "read as float32"),
        (lambda: fa21._flash_attn_backward(dout, q, k, v, out, lse, q.float(), *grads()[1:], 0.0, 0.25, True),
         "dq must have the same dtype"),
        (lambda: fa21._flash_attn_backward(dout[..., :12], q[..., :12], k[..., :12], v[..., :12], out[..., :12], lse,
                                           None, None, None, 0.0, 0.25, True), "multiple of 8"),
    ]
    for call, message in refusals:
        with pytest.raises((RuntimeError, NotImplementedError), match=message):
            call()
    # before 2.7 the forward pads a head size that is not a multiple of 8 and returns the padded tensors
    res = fa21._flash_attn_forward(q[..., :12], k[..., :12], v[..., :12], 0.0, 0.25, True, False)
    assert res[0].shape[-1] == 12 and res[1].shape[-1] == 16 and res[4].shape[-1] == 16 and res[6] is None


def _interface(release: str):
    from flash_attn_double import interface

    return interface(release)


# ---- 2. ring_sp's FlashAttnKernel through the double ----------------------------------------

@pytest.mark.parametrize("dtype", HALF.values(), ids=HALF)
@pytest.mark.parametrize("release", RELEASES)
def test_backend_blocks_match_the_oracle(release: str, dtype: torch.dtype) -> None:
    """One block (causal and not, GQA) fed its own statistics; two key blocks merged and fed the
    GLOBAL out/lse (strided, as the ring holds it); window bands and edge blocks where supported."""
    with installed(release) as fa:
        if release == "2.7":  # custom ops hide the Python signature: the shim must find it in _init_fn
            assert "softmax_scale" not in inspect.signature(fa._flash_attn_forward).parameters
        kernel = get_kernel("flash_attn", CPU, dtype, 16)
        assert kernel.name == "flash_attn" and kernel.supports_window == (release in WINDOWED)
        for causal, (h, h_kv) in itertools.product((False, True), ((4, 4), (8, 2))):
            inputs = _inputs(2, 7, 7, h, h_kv, 16, dtype, seed=h_kv + 2 * causal)
            q, k, v, dout = inputs.values()
            want = oracle_results(inputs, causal=causal, scale=0.25)
            out, lse = kernel.forward(q, k, v, causal=causal, scale=0.25)
            _check_against(want, out, lse, kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25), dtype)

        check_two_key_blocks(kernel, _inputs(2, 6, 12, 8, 2, 16, dtype, seed=9), scale=0.25)

        for causal, window in ((True, 3), (False, 1)):  # a band, and the edge block key >= query
            inputs = _inputs(1, 8, 8, 4, 2, 16, dtype, seed=window)
            q, k, v, dout = inputs.values()
            mask = _mask(8, 8, causal=causal, left=window - 1, right=0 if causal else -1)
            want = oracle_results(inputs, causal=False, scale=0.25, mask=mask)
            if not kernel.supports_window and causal:
                with pytest.raises(ValueError, match="only the edge block"):
                    kernel.forward(q, k, v, causal=causal, scale=0.25, window=window)
                continue
            out, lse = kernel.forward(q, k, v, causal=causal, scale=0.25, window=window)
            grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=0.25, window=window)
            _check_against(want, out, lse, grads, dtype)


def test_backend_refuses_what_flash_attn_cannot_run_even_with_the_double() -> None:
    with installed("2.7"):
        with pytest.raises(RuntimeError, match="flash-attn takes float16 or bfloat16, not torch.float32"):
            get_kernel("flash_attn", CPU, torch.float32, 16)
        with pytest.raises(RuntimeError, match="head_dim a multiple of 8"):
            get_kernel("flash_attn", CPU, torch.bfloat16, 12)
        with pytest.raises(RuntimeError, match="value head size"):
            get_kernel("flash_attn", CPU, torch.bfloat16, 16, 8)
        assert get_kernel("auto", CPU, torch.bfloat16, 16).name == "torch"  # auto on CPU never picks flash_attn
    with pytest.raises(RuntimeError, match="flash-attn is not installed"):  # uninstalled again
        get_kernel("flash_attn", CPU, torch.bfloat16, 16)


# ---- 3. ring, Ulysses and the grid through the double ----------------------------------------

def _dist_cases(world_size: int, dtypes: tuple[str, ...], full: bool) -> list[AttnCase]:
    """On ``world_size`` ranks: the ring over every layout (causal and not, GQA), windows, packed
    documents (with a window too), sinks; Ulysses and (at 4 ranks) the 2x2 grid. ``full``: every
    combination; else one case per feature, the layouts and head ratios rotated through."""
    dt = itertools.cycle(dtypes)
    layouts = ("contiguous", "zigzag", "striped")
    heads = ((4, 1), (8, 2), (4, 4))
    cases: list[AttnCase] = []

    def add(mode: str, layout: str, causal: bool, b: int, n: int, h: int, h_kv: int, **extra) -> None:
        cases.append(AttnCase(mode, layout, causal, b, n, h, h_kv, 16, next(dt), seed=len(cases),
                              ring=1 if mode == "ulysses" else (2 if mode == "hybrid" else world_size),
                              ulysses=world_size if mode == "ulysses" else (2 if mode == "hybrid" else 1),
                              backend="flash_attn", **extra))

    ring = itertools.product(layouts, (True, False), heads) if full else zip(layouts, (True, False, True), heads)
    for layout, causal, (h, h_kv) in ring:
        add("ring", layout, causal, 2, 6, h, h_kv)
    for layout, window in itertools.product(layouts, (1, 3, 8)) if full else [("striped", 3)]:
        add("ring", layout, True, 1, 8, 4, 2, window=window)
    for layout in layouts + ("document_zigzag",) if full else ("contiguous", "document_zigzag"):
        add("ring", layout, True, 1, 8, 4, 2, packed=True, window=5 if layout == "contiguous" else None)
    add("ring", "zigzag", True, 1, 6, 4, 2, sinks=True)
    for layout, causal in itertools.product(("zigzag", "striped"), (True, False)) if full else [("zigzag", False)]:
        add("ulysses", layout, causal, 1, 4, 2 * world_size, world_size // 2 or 1, sinks=not causal)
    if world_size == 4:
        for layout, packed in itertools.product(("zigzag", "contiguous"), (False, True)) if full else [("zigzag", True)]:
            add("hybrid", layout, True, 1, 4, 4, 2, packed=packed, window=3 if packed else None)
    return cases


@pytest.mark.parametrize("release,world_size", [("2.7", 4), ("2.1", 2)])
def test_distributed_through_the_double(pools, release: str, world_size: int) -> None:
    """The default sample: the newest signature (windows natively) on 4 ranks with the grid,
    and 2.1 (no window argument: the schedule cuts the bands) on 2."""
    cases = _dist_cases(world_size, ("bf16", "fp16"), full=False)
    pools.get(world_size).run(run_installed, release, check_attention_cases, cases, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("release", RELEASES)
def test_distributed_through_the_double_sweep(pools, release: str, world_size: int) -> None:
    cases = _dist_cases(world_size, ("bf16", "fp16"), full=True)
    pools.get(world_size).run(run_installed, release, check_attention_cases, cases, timeout=900)
