"""The ``cudnn`` backend's checks that need a GPU, collected through tests/test_kernels_cuda.py
(the file gpu_check's ``kernel_tests`` section runs); each skips without CUDA or cuDNN attention.

Its blocks against the float64 oracle run there as the ``cudnn`` variant of the shared block
tests; these add what is particular to it: which blocks reach cuDNN, rows whose lse is below
-88.7 (with and without a tile tail), grad_out in another layout than out, deterministic mode,
and its head-size rule against torch's own dispatcher rule.
"""

from __future__ import annotations

import pytest
import torch

from oracle import GRAD_TOL, OUT_TOL, assert_close, oracle_results
from ring_sp.kernels import cudnn, unavailable_reason
from ring_sp.kernels.torch_cuda import TorchCUDAKernel

CUDA = torch.device("cuda")


def _cudnn_kernel(dtype: torch.dtype = torch.bfloat16, head_dim: int = 64) -> cudnn.CudnnKernel:
    reason = unavailable_reason("cudnn", CUDA, dtype, head_dim) if torch.cuda.is_available() else "no CUDA"
    if reason is not None:
        pytest.skip(reason)
    return cudnn.CudnnKernel(tail=TorchCUDAKernel())


def _inputs(s: int, dtype: torch.dtype, seed: int, h: int = 4, h_kv: int = 2, d: int = 64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(q=(1, s, h, d), k=(1, s, h_kv, d), v=(1, s, h_kv, d), dout=(1, s, h, d))
    return {n: torch.randn(x, generator=gen, dtype=torch.float64).to(CUDA, dtype) for n, x in shapes.items()}


def test_cudnn_runs_whole_tiles_and_hands_tails_to_torch() -> None:
    kernel = _cudnn_kernel()
    for s, on_cudnn in ((256, True), (192, False), (130, False)):
        q, k, v, dout = _inputs(s, torch.bfloat16, seed=s).values()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out, lse = kernel.forward(q, k, v, causal=True, scale=0.125)
            kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.125)
        names = {e.name for e in prof.events()}
        assert ("aten::_scaled_dot_product_cudnn_attention" in names) == on_cudnn, (s, sorted(names))
        assert ("aten::_scaled_dot_product_cudnn_attention_backward" in names) == on_cudnn, s


@pytest.mark.parametrize("s", [256, 192])
def test_cudnn_rows_with_very_negative_lse(s: int) -> None:
    """Every logit ~ -120 (lse < -88.7: torch issue 196678's recipe). 256: whole tiles on cuDNN,
    which must then be finite (the module's claim); 192 (= 64 mod 128, the NaN length on
    cuDNN < 9.26): the tail kernel. dq's first component is ill-conditioned (module test in
    test_cudnn_double.py), so it is only checked finite."""
    kernel = _cudnn_kernel()
    inputs = _inputs(s, torch.bfloat16, seed=s)
    inputs["q"] = inputs["q"] * 0.1
    inputs["q"][..., 0], inputs["k"][..., 0] = 1.0, -120 * 8.0  # scale 1/8
    q, k, v, dout = inputs.values()
    want = oracle_results(inputs, causal=True, scale=0.125)
    assert want["lse"].max() < -88.8
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.125)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.125)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert_close("out", out, want["out"], OUT_TOL[torch.bfloat16])
    for got, name in ((dq[..., 1:], "dq"), (dk, "dk"), (dv, "dv")):
        assert_close(name, got, want[name][..., 1:] if name == "dq" else want[name], GRAD_TOL[torch.bfloat16])


def test_cudnn_grad_out_in_another_layout_than_out() -> None:
    """grad_out stored head-major, out sequence-major (torch issue 176915's mismatch), and a
    strided lse: the same gradients as with everything dense."""
    kernel = _cudnn_kernel()
    q, k, v, dout = _inputs(256, torch.bfloat16, seed=3).values()
    out, lse = kernel.forward(q, k, v, causal=False, scale=0.125)
    dense = kernel.backward(dout, q, k, v, out, lse, causal=False, scale=0.125)
    head_major = dout.transpose(1, 2).contiguous().transpose(1, 2)
    strided_lse = lse.transpose(1, 2).contiguous().transpose(1, 2)
    for a, b in zip(dense, kernel.backward(head_major, q, k, v, out, strided_lse, causal=False, scale=0.125)):
        assert torch.equal(a, b) or (a.float() - b.float()).abs().max() < 1e-2  # the backward is not deterministic


def test_cudnn_is_refused_in_deterministic_mode() -> None:
    _cudnn_kernel()
    try:
        torch.use_deterministic_algorithms(True)
        assert "non-deterministic" in unavailable_reason("cudnn", CUDA, torch.bfloat16, 64)
    finally:
        torch.use_deterministic_algorithms(False)


def _torch_allows(d: int, d_v: int) -> bool:
    """torch's own SDPA rule for cuDNN on requires_grad inputs of these head sizes."""
    q = torch.empty(1, 4, 256, d, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(1, 4, 256, d, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(1, 4, 256, d_v, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    except TypeError:  # torch < 2.5: no enable_gqa
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False)
    return torch.backends.cuda.can_use_cudnn_attention(params, False)


def test_cudnn_head_size_rule_is_never_looser_than_torchs() -> None:
    _cudnn_kernel()
    capability, version = torch.cuda.get_device_capability(), torch.backends.cudnn.version()
    for d, d_v in ((64, 64), (128, 128), (128, 64), (160, 160), (192, 128), (192, 192), (256, 256)):
        if cudnn.head_size_reason(d, d_v, capability, version) is None:
            assert _torch_allows(d, d_v), (d, d_v, capability, version)
