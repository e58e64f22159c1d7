"""C3/C4 for the CUDA backends: PyTorch's fused ops ("torch" on CUDA), cuDNN's and flash-attn.

On a CUDA machine each backend's forward (out, lse) and backward (dq, dk, dv) is compared with
the float64 autograd oracle of oracle.py, both for one block fed its own out/lse and for two key
blocks fed the merged GLOBAL out/lse. Without CUDA those cases skip; what runs everywhere:
the unavailability reasons, the lazy import of flash-attn, the aten-op plumbing on the meta
device, and the flash-attn signature shim against fakes of every release's signature.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cudnn_gpu_checks import (  # noqa: F401 (collected here: gpu_check's kernel_tests runs this file)
    test_cudnn_grad_out_in_another_layout_than_out, test_cudnn_head_size_rule_is_never_looser_than_torchs,
    test_cudnn_is_refused_in_deterministic_mode, test_cudnn_rows_with_very_negative_lse,
    test_cudnn_runs_whole_tiles_and_hands_tails_to_torch)
from oracle import GRAD_TOL, LSE_ATOL, OUT_TOL, assert_close, assert_lse_close, oracle_results
from ring_sp.kernels import flash_attn as fa_backend
from ring_sp.kernels import torch_cuda, unavailable_reason
from ring_sp.kernels.cudnn import CudnnKernel
from ring_sp.kernels.flash_attn import FlashAttnKernel
from ring_sp.kernels.torch_cuda import TorchCUDAKernel

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

# ---------------------------------------------------------------------------------------------
# CUDA: every backend against the float64 oracle
# ---------------------------------------------------------------------------------------------

VARIANTS = [
    ("torch-flash", torch.float16), ("torch-flash", torch.bfloat16),
    ("torch-efficient", torch.float16), ("torch-efficient", torch.bfloat16), ("torch-efficient", torch.float32),
    ("flash_attn", torch.float16), ("flash_attn", torch.bfloat16),
    ("cudnn", torch.float16), ("cudnn", torch.bfloat16),  # seq 128: cuDNN; 1 and 17: its tail kernel
]
CASES = pytest.mark.parametrize("variant,dtype", VARIANTS, ids=[f"{v}-{str(d)[6:]}" for v, d in VARIANTS])


def _kernel(variant: str, dtype: torch.dtype, head_dim: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The backend under test; torch-flash / torch-efficient pin the op TorchCUDAKernel picks."""
    if variant == "cudnn":
        reason = unavailable_reason("cudnn", torch.device("cuda"), dtype, head_dim)
        if reason is not None:
            pytest.skip(reason)
        return CudnnKernel(tail=TorchCUDAKernel())
    if variant == "flash_attn":
        reason = fa_backend.unavailable_reason(dtype, head_dim)
        if reason is not None:
            pytest.skip(reason)
        return FlashAttnKernel()
    capability = torch.cuda.get_device_capability()
    if variant == "torch-flash":
        reason = torch_cuda._flash_reason(dtype, head_dim, capability)
    else:
        reason = torch_cuda._efficient_reason(dtype, head_dim, capability)
        monkeypatch.setattr(torch_cuda, "_use_flash", lambda q, v: False)
    if reason is not None:
        pytest.skip(reason)
    return TorchCUDAKernel()


def _inputs(seq_q: int, seq_k: int, h: int, h_kv: int, d: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """q, k, v, dout on the GPU, rounded to ``dtype`` (the oracle starts from the same values)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(q=(2, seq_q, h, d), k=(2, seq_k, h_kv, d), v=(2, seq_k, h_kv, d), dout=(2, seq_q, h, d))
    return {n: torch.randn(s, generator=gen, dtype=torch.float64).to("cuda", dtype) for n, s in shapes.items()}


def _check_grads(grads: tuple[torch.Tensor, ...], want: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    for got, name in zip(grads, ("dq", "dk", "dv")):
        assert got.shape == want[name].shape, name
        assert_close(name, got, want[name], GRAD_TOL[dtype])


@needs_cuda
@CASES
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,h_kv", [(8, 8), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("seq", [1, 17, 128])
def test_block_matches_oracle(
    variant: str, dtype: torch.dtype, causal: bool, h: int, h_kv: int, head_dim: int, seq: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One block, backward fed the block's own out/lse."""
    kernel = _kernel(variant, dtype, head_dim, monkeypatch)
    inputs = _inputs(seq, seq, h, h_kv, head_dim, dtype, seed=seq * 1000 + head_dim)
    q, k, v, dout = inputs.values()
    mask = torch.ones(seq, seq, dtype=torch.bool, device="cuda")
    scale = head_dim**-0.5
    want = oracle_results(inputs, causal=False, scale=scale, mask=mask.tril() if causal else mask)

    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, h, seq)
    assert_close("out", out, want["out"], OUT_TOL[dtype])
    assert_lse_close("lse", lse, want["lse"], LSE_ATOL[dtype])

    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    assert all(g.dtype == dtype for g in grads)
    _check_grads(grads, want, dtype)


@needs_cuda
@CASES
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,h_kv", [(8, 8), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("seq", [1, 17, 128])
def test_two_key_blocks_with_global_statistics(
    variant: str, dtype: torch.dtype, causal: bool, h: int, h_kv: int, head_dim: int, seq: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Queries at positions seq..2seq-1 see a past key block (full) and their own (causal or
    full), as on a ring. Merge the two forwards; each block's backward, fed the merged GLOBAL
    out/lse, gives that block's share of the exact gradient."""
    kernel = _kernel(variant, dtype, head_dim, monkeypatch)
    inputs = _inputs(seq, 2 * seq, h, h_kv, head_dim, dtype, seed=seq * 1000 + head_dim + 1)
    q, k, v, dout = inputs.values()
    own = torch.ones(seq, seq, dtype=torch.bool, device="cuda")
    mask = torch.cat([torch.ones_like(own), own.tril() if causal else own], dim=1)
    scale = head_dim**-0.5
    want = oracle_results(inputs, causal=False, scale=scale, mask=mask)
    blocks = [(slice(0, seq), False), (slice(seq, 2 * seq), causal)]

    parts = [kernel.forward(q, k[:, s], v[:, s], causal=c, scale=scale) for s, c in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])  # the ring's merge (DESIGN section 4), in fp32
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2).unsqueeze(-1) for o, l in parts).to(dtype)
    assert_close("merged out", out, want["out"], OUT_TOL[dtype])
    assert_lse_close("merged lse", lse, want["lse"], LSE_ATOL[dtype])

    lse = lse.transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous global lse, as a ring may hold
    grads = [kernel.backward(dout, q, k[:, s], v[:, s], out, lse, causal=c, scale=scale) for s, c in blocks]
    dq = grads[0][0].double() + grads[1][0].double()
    dk, dv = (torch.cat([grads[0][i], grads[1][i]], dim=1) for i in (1, 2))
    _check_grads((dq, dk, dv), want, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_v", [32, 128])
def test_value_head_size_runs_on_the_efficient_op(dtype: torch.dtype, causal: bool, d_v: int) -> None:
    """MLA head sizes (q/k 64, v 32 or 128): the flash op is refused, the efficient op runs them."""
    assert "equal q/k and v head sizes" in torch_cuda._flash_reason(dtype, 64, torch.cuda.get_device_capability(), d_v)
    assert torch_cuda.unavailable_reason(dtype, 64, d_v) is None
    gen = torch.Generator().manual_seed(d_v)
    shapes = dict(q=(2, 33, 8, 64), k=(2, 33, 2, 64), v=(2, 33, 2, d_v), dout=(2, 33, 8, d_v))
    inputs = {n: torch.randn(sh, generator=gen, dtype=torch.float64).to("cuda", dtype) for n, sh in shapes.items()}
    q, k, v, dout = inputs.values()
    want = oracle_results(inputs, causal=causal, scale=0.125)
    kernel = TorchCUDAKernel()
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.125)
    assert out.shape == (2, 33, 8, d_v)
    assert_close("out", out, want["out"], OUT_TOL[dtype])
    assert_lse_close("lse", lse, want["lse"], LSE_ATOL[dtype])
    _check_grads(kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=0.125), want, dtype)


@needs_cuda
def test_torch_cuda_reasons_on_a_gpu() -> None:
    assert torch_cuda.unavailable_reason(torch.float64, 64).startswith("float64 has no fused CUDA attention op")
    assert torch_cuda.unavailable_reason(torch.float32, 64) is None
    assert "head_dim" in torch_cuda.unavailable_reason(torch.float32, 6)


# ---------------------------------------------------------------------------------------------
# Everywhere: reasons, lazy import, empty blocks
# ---------------------------------------------------------------------------------------------


def test_value_head_size_reasons() -> None:
    """The flash op needs d_v == d; the efficient op aligns both head sizes; flash-attn refuses d_v != d."""
    assert "equal q/k and v head sizes" in torch_cuda._flash_reason(torch.bfloat16, 64, (9, 0), 32)
    assert "head sizes" not in (torch_cuda._flash_reason(torch.bfloat16, 64, (9, 0), 64) or "")  # CPU builds: no flash
    assert torch_cuda._efficient_reason(torch.bfloat16, 64, (9, 0), 32) is None
    assert "value head_dim divisible by 8" in torch_cuda._efficient_reason(torch.bfloat16, 64, (9, 0), 12)
    if not isinstance(fa_backend._interface(), str):  # flash-attn installed: its own reason
        assert "value head size" in fa_backend.unavailable_reason(torch.bfloat16, 64, 32)


def test_efficient_op_plumbing_with_value_head_size_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _SpyAten()
    monkeypatch.setattr(torch_cuda, "_aten", spy)
    monkeypatch.setattr(torch_cuda, "_use_flash", lambda q, v: False)
    q = torch.empty(2, 17, 8, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 17, 2, 64, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 17, 2, 32, device="meta", dtype=torch.bfloat16)
    out, lse = TorchCUDAKernel().forward(q, k, v, causal=True, scale=0.125)
    assert out.shape == (2, 17, 8, 32) and lse.shape == (2, 8, 17)
    dq, dk, dv = TorchCUDAKernel().backward(out, q, k, v, out, lse, causal=True, scale=0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.skipif(CUDA, reason="checks the message given when CUDA is missing")
def test_torch_cuda_says_cuda_is_missing() -> None:
    reason = torch_cuda.unavailable_reason(torch.bfloat16, 64)
    assert reason is not None and "CUDA is not available" in reason


@pytest.mark.skipif(CUDA, reason="checks the message given when flash-attn cannot be installed")
def test_flash_attn_says_it_is_not_installed() -> None:
    assert fa_backend.unavailable_reason(torch.bfloat16, 64) == (
        "flash-attn is not installed: pip install 'ring-sp[flash]' on a CUDA machine"
    )


def test_importing_the_backend_does_not_import_flash_attn() -> None:
    code = (  # nor makes torch's flash op FA4: that happens in get_kernel only (ring_sp.kernels.fa4)
        "import sys, torch, ring_sp.kernels.flash_attn, ring_sp.kernels.torch_cuda, ring_sp.kernels.cudnn\n"
        "loaded = {'flash_attn', 'flash_attn_interface', 'flash_attn_2_cuda', 'flash_attn.cute'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
        "assert torch.nn.attention.current_flash_attention_impl() is None\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("kernel", [TorchCUDAKernel(), FlashAttnKernel(), CudnnKernel(tail=TorchCUDAKernel())],
                         ids=["torch", "flash_attn", "cudnn"])
@pytest.mark.parametrize("seq_q,seq_k", [(0, 5), (5, 0)])
def test_empty_blocks_give_zero_out_and_minus_inf_lse(kernel: Any, seq_q: int, seq_k: int) -> None:
    q, dout = torch.randn(2, seq_q, 4, 16, dtype=torch.bfloat16), torch.randn(2, seq_q, 4, 16, dtype=torch.bfloat16)
    k = v = torch.randn(2, seq_k, 2, 16, dtype=torch.bfloat16)
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.25)
    assert out.shape == q.shape and not out.any()
    assert lse.shape == (2, 4, seq_q) and lse.dtype == torch.float32 and torch.isneginf(lse).all()
    grads = kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and not any(g.any() for g in grads)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_bands_match_oracle(dtype: torch.dtype, head_dim: int) -> None:
    """Bands of any shape as ONE call of the flash op's window (issue 38 item 3), forward and
    backward, against the oracle with the band as its mask; a tall band the op's right >=
    seqlen_k rule would widen is refused, not computed."""
    from test_kernel_calls import _band, _checked, _oracle

    kernel = torch_cuda.kernel_for(torch.device("cuda"), dtype, head_dim, head_dim)
    if not kernel.supports_window:
        pytest.skip(f"this torch's flash op takes no window (torch >= 2.5); flash={kernel.flash}")
    for nq, nk, causal, window, diagonal in ((130, 300, True, 90, 170), (200, 200, True, 64, 0), (96, 96, False, 1, 0),
                                             (300, 70, False, 40, -200), (64, 257, True, None, 193)):
        inputs = [t.cuda() for t in _host_inputs(nq, nk, 8, 2, head_dim, dtype, seed=nq + nk)]
        lo, hi = (None if window is None else diagonal - window), (diagonal if causal else None)
        want, dout = _oracle(inputs, _band(nq, nk, lo, hi), head_dim**-0.5)
        q, k, v, _ = inputs
        out, lse = kernel.forward(q, k, v, causal=causal, scale=head_dim**-0.5, window=window, diagonal=diagonal)
        grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=head_dim**-0.5, window=window,
                                diagonal=diagonal)
        _checked(want, out, lse, grads, dtype, float("-inf"))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,head_major", [(1, False), (2, True)])
def test_flash_segments_match_oracle(dtype: torch.dtype, b: int, head_major: bool) -> None:
    """A step's blocks as one varlen call with filler segments (keys without queries, queries
    without keys) on views: the rows of fillers come back out 0 / lse -inf and their dq, the
    keys of fillers dk = dv = 0 (what torch's flash_api.cpp and the kernels' early exits write,
    and what tests/torch_flash_double.py assumes)."""
    from test_kernel_calls import _checked, _segmented

    from ring_sp.ring.calls import CallPlan
    from ring_sp.schedule import BlockTask, KernelCaps

    kernel = torch_cuda.kernel_for(torch.device("cuda"), dtype, 64, 64)
    if not kernel.supports_varlen:
        pytest.skip("this torch's varlen flash op returns lse [segments, heads, max_q] (before FlashAttention 2.6)")
    blocks = (BlockTask(slice(0, 200), slice(64, 264), True, None, 1),
              BlockTask(slice(300, 430), slice(300, 430), True, None, 1),
              BlockTask(slice(500, 600), slice(520, 700), True, None, 81))  # all (left, right) = (-1, 1)
    (q, k, v, dout), want = _segmented(blocks, b, 720, dtype, head_major, seed=b, head_dim=64)
    q, k, v, dout = (t.cuda() for t in (q, k, v, dout))
    ((call, segments),) = CallPlan((blocks,), KernelCaps(bands=True, varlen=True)).launches(torch.device("cuda"))[0]
    assert segments is not None and call.fills_rows
    rows, keys = call.q, call.kv
    out, lse = kernel.forward_segments(q[:, rows], k[:, keys], v[:, keys], segments, scale=0.25)
    grads = kernel.backward_segments(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out, lse, segments, scale=0.25)
    part = {name: want[name][:, rows] for name in ("out", "dq")} | {"lse": want["lse"][:, :, rows]}
    part |= {name: want[name][:, keys] for name in ("dk", "dv")}
    _checked(part, out.cpu(), lse.cpu(), [g.cpu() for g in grads], dtype, float("-inf"))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_flash_double_matches_the_op(dtype: torch.dtype) -> None:
    """tests/torch_flash_double.py against the real ops, same inputs: dense with windows (and a
    right window >= seqlen_k), varlen with filler segments; out, lse, dq, dk, dv."""
    from torch_flash_double import FlashDouble

    if not torch_cuda.flash_window_arguments() or not torch_cuda.varlen_lse_packed():
        pytest.skip("the double models torch >= 2.5 with FlashAttention 2.6's varlen lse")
    ops, double = torch.ops.aten, FlashDouble()
    g = torch.Generator().manual_seed(0)
    dense = [(40, 90, True, None, None), (90, 40, False, 10, 3), (90, 40, False, None, 60), (64, 64, False, 0, None)]
    for sq, sk, causal, left, right in dense:
        q, dout = (torch.randn(2, sq, 8, 64, generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(2, sk, 2, 64, generator=g).to(dtype) for _ in range(2))
        extra = dict(scale=0.125, window_size_left=left, window_size_right=right)
        _same(ops, double, (q, k, v, dout), (None, None, sq, sk), causal, extra)
    cu_q, cu_k = [0, 30, 30, 75, 80], [0, 50, 70, 110, 110]  # a segment without queries, one without keys
    q, dout = (torch.randn(80, 8, 64, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(110, 2, 64, generator=g).to(dtype) for _ in range(2))
    offsets = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]
    for causal, left, right in ((True, None, None), (False, 7, 0), (False, None, None)):
        _same(ops, double, (q, k, v, dout), (*offsets, 45, 50), causal,
              dict(scale=0.125, window_size_left=left, window_size_right=right))


def _same(ops: Any, double: Any, tensors: tuple[torch.Tensor, ...], lengths: tuple[Any, ...], causal: bool,
          extra: dict[str, Any]) -> None:
    q, k, v, dout = tensors
    cpu = double.forward(q, k, v, *lengths, 0.0, causal, False, **extra)[:2]
    cuda_lengths = tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in lengths)
    gpu = ops._flash_attention_forward(q.cuda(), k.cuda(), v.cuda(), *cuda_lengths, 0.0, causal, False, **extra)[:2]
    for name, a, b in zip(("out", "lse"), cpu, gpu):
        torch.testing.assert_close(b.cpu().float(), a.float(), atol=2e-2, rtol=2e-2, msg=name)
    rng = torch.empty(2, dtype=torch.uint64, device="cuda"), torch.empty((), dtype=torch.uint64, device="cuda")
    grads_cpu = double.backward(dout, q, k, v, cpu[0], cpu[1], *lengths, 0.0, causal, None, None, **extra)
    grads_gpu = ops._flash_attention_backward(dout.cuda(), q.cuda(), k.cuda(), v.cuda(), gpu[0], gpu[1],
                                              *cuda_lengths, 0.0, causal, *rng, **extra)
    for name, a, b in zip(("dq", "dk", "dv"), grads_cpu, grads_gpu):
        torch.testing.assert_close(b.cpu().float(), a.float(), atol=5e-2, rtol=5e-2, msg=name)


def _host_inputs(sq: int, sk: int, h: int, h_kv: int, d: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, sq, h, d), (2, sk, h_kv, d), (2, sk, h_kv, d), (2, sq, h, d))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


# ---------------------------------------------------------------------------------------------
# Everywhere: the aten plumbing of TorchCUDAKernel, on the meta device
# ---------------------------------------------------------------------------------------------


class _SpyAten:
    """Stands in for torch.ops.aten and records the arguments of each op call."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[Any, ...]] = {}
        self.keywords: dict[str, dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name], self.keywords[name] = args, kwargs
            return getattr(torch.ops.aten, name)(*args, **kwargs)

        return call


@pytest.mark.parametrize("flash,dtype", [(True, torch.bfloat16), (False, torch.bfloat16), (False, torch.float32)])
def test_aten_plumbing_on_meta(flash: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes, the GQA expansion of the efficient op and its lse padding, against this torch's op schemas."""
    spy = _SpyAten()
    monkeypatch.setattr(torch_cuda, "_aten", spy)
    q = torch.empty(2, 17, 8, 64, device="meta", dtype=dtype)
    k = v = torch.empty(2, 17, 2, 64, device="meta", dtype=dtype)
    kernel = TorchCUDAKernel(flash=flash)
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.125)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 8, 17) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(out, q, k, v, out, lse, causal=True, scale=0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dk.dtype == dtype
    if flash:
        assert spy.calls["_flash_attention_forward"][1].shape[2] == 2  # KV heads stay h_kv, [b, s, h, d]
        assert spy.calls["_flash_attention_forward"][8] is True and not spy.keywords["_flash_attention_forward"].get(
            "window_size_left")  # plain causal: the flag, no window (torch 2.4's ops have none)
        assert spy.calls["_flash_attention_backward"][5].shape == (2, 8, 17)
        kernel.forward(q[:, :5], k, v, causal=True, window=3, diagonal=12, scale=0.125)  # a 5 x 17 band
        assert spy.keywords["_flash_attention_forward"] == dict(scale=0.125, window_size_left=2, window_size_right=0)
    else:
        assert spy.calls["_scaled_dot_product_efficient_attention"][1].shape[1] == 8  # expanded to h
        assert spy.calls["_scaled_dot_product_efficient_attention_backward"][6].shape == (2, 8, 32)  # kAlignLSE


def test_segments_plumbing_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    """The varlen call: [rows, h, d] views per batch element, int32 offsets, lse [b, h, rows] back."""
    spy = _SpyAten()
    monkeypatch.setattr(torch_cuda, "_aten", spy)
    from ring_sp.kernels.base import Segments

    q = torch.empty(2, 9, 8, 64, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(2, 7, 2, 64, device="meta", dtype=torch.bfloat16)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device="meta") for c in ([0, 4, 9], [0, 3, 7]))
    kernel = TorchCUDAKernel(flash=True)
    assert kernel.supports_varlen and kernel.supports_window  # this torch: window arguments, lse [h, total_q]
    out, lse = kernel.forward_segments(q, k, v, Segments(cu_q, cu_k, 5, 4, (-1, 0), False), scale=0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, 9)
    assert spy.calls["_flash_attention_forward"][0].shape == (9, 8, 64) and spy.calls["_flash_attention_forward"][5] == 5
    grads = kernel.backward_segments(out, q, k, v, out, lse, Segments(cu_q, cu_k, 5, 4, (-1, 0), False), scale=0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert spy.calls["_flash_attention_backward"][5].shape == (8, 9)  # the global lse rows, dense [h, rows]
    with pytest.raises(ValueError, match="takes no segments"):
        TorchCUDAKernel(flash=False).forward_segments(q, k, v, Segments(cu_q, cu_k, 5, 4, (-1, 0), False), scale=0.1)


# ---------------------------------------------------------------------------------------------
# Everywhere: the flash-attn signature shim against fakes of each release's entry points
# ---------------------------------------------------------------------------------------------

_FA2_BWD_HEAD = "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal"
_FA3_FWD_OPTIONAL = (
    "k_new v_new qv out cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k max_seqlen_q max_seqlen_k "
    "page_table kv_batch_idx leftpad_k rotary_cos rotary_sin seqlens_rotary q_descale k_descale v_descale"
)
_FA3_BWD_OPTIONAL = "cu_seqlens_q cu_seqlens_k sequed_q sequed_k max_seqlen_q max_seqlen_k dq dk dv"


def _with_defaults(names: str) -> str:
    return " ".join(f"{name}=" for name in names.split())


# release: (forward parameters, backward parameters, length of the forward's result); "name=" has a default.
RELEASES = {
    "fa2.1": ("q k v dropout_p softmax_scale causal return_softmax", f"{_FA2_BWD_HEAD} rng_state=", 8),
    "fa2.3": (
        "q k v dropout_p softmax_scale causal window_size return_softmax",
        f"{_FA2_BWD_HEAD} window_size rng_state=", 8,
    ),
    "fa2.4": (
        "q k v dropout_p softmax_scale causal window_size alibi_slopes return_softmax",
        f"{_FA2_BWD_HEAD} window_size alibi_slopes deterministic rng_state=", 8,
    ),
    "fa2.6": (
        "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes return_softmax",
        f"{_FA2_BWD_HEAD} window_size softcap alibi_slopes deterministic rng_state=", 8,
    ),
    "fa3-2025": (  # optional inputs without defaults, window_size pair
        f"q k v {_FA3_FWD_OPTIONAL} softmax_scale causal window_size= attention_chunk= softcap= sm_margin=",
        f"dout q k v out softmax_lse {_FA3_BWD_OPTIONAL} softmax_scale causal window_size= softcap= deterministic=", 4,
    ),
    "fa3-newest": (  # everything optional has a default; the backward flag is is_causal
        f"q k v {_with_defaults(_FA3_FWD_OPTIONAL)} softmax_scale= causal= window_size_left= window_size_right= softcap=",
        f"dout q k v out softmax_lse {_with_defaults(_FA3_BWD_OPTIONAL)} softmax_scale= is_causal= window_size_left= "
        "window_size_right= softcap= deterministic=", 4,
    ),
}
# What the ring passes for each name some release uses; every other parameter must get None.
_EXPECTED = dict(
    dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0,
    return_softmax=False, softmax_scale=0.125, causal=True, is_causal=True, deterministic=False,
)
_DEFAULT = object()


def _fake(params: str, calls: list[dict[str, Any]], result: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
    """A function with exactly these parameters that records its arguments and returns result(args)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [inspect.Parameter(p.rstrip("="), kind, default=_DEFAULT if p.endswith("=") else inspect.Parameter.empty)
         for p in params.split()]
    )

    def fn(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        calls.append(dict(bound.arguments))
        return result(bound.arguments)

    fn.__signature__ = signature  # type: ignore[attr-defined]
    return fn


def _fill_grads(args: dict[str, Any]) -> None:
    for i, name in enumerate(("dq", "dk", "dv")):
        args[name].fill_(i + 1)


def _check_call(args: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    for name, value in args.items():
        if name in tensors:
            assert value is tensors[name], name
        elif name in ("dq", "dk", "dv"):
            assert value.is_contiguous() and value.shape == tensors[{"dq": "q", "dk": "k", "dv": "v"}[name]].shape
        elif name in _EXPECTED:
            assert value == _EXPECTED[name], (name, value)
        else:
            assert value is None, (name, value)


@pytest.mark.parametrize("release", RELEASES)
def test_flash_attn_shim_calls_each_release_correctly(release: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fwd_params, bwd_params, layout = RELEASES[release]
    q, k = torch.randn(2, 5, 4, 16, dtype=torch.bfloat16), torch.randn(2, 5, 2, 16, dtype=torch.bfloat16)
    v, out_, lse_ = torch.randn_like(k), torch.randn_like(q), torch.randn(2, 4, 5)
    calls: list[dict[str, Any]] = []

    def forward_result(args: dict[str, Any]) -> tuple[Any, ...]:
        return (out_, q, k, v, out_, lse_, None, None) if layout == 8 else (out_, lse_, None, None)

    fake = SimpleNamespace(
        _flash_attn_forward=_fake(fwd_params, calls, forward_result),
        _flash_attn_backward=_fake(bwd_params, calls, _fill_grads),
    )
    monkeypatch.setattr(fa_backend, "_interface", lambda: fake)
    kernel = FlashAttnKernel()
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.125)
    assert out is out_ and lse is lse_
    _check_call(calls[0], {"q": q, "k": k, "v": v})

    global_lse = lse_.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv = kernel.backward(out_, q, k, v, out_, global_lse, causal=True, scale=0.125)
    args = calls[1]
    assert args["softmax_lse"].is_contiguous() and torch.equal(args["softmax_lse"], lse_)
    _check_call(args, {"dout": out_, "q": q, "k": k, "v": v, "out": out_, "softmax_lse": args["softmax_lse"]})
    assert dk.shape == k.shape and dk.dtype == k.dtype  # h_kv heads, input dtype
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()  # the buffers the fake wrote
