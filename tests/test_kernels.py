"""C3/C4: local kernel backends against the float64 oracle, single process."""

from __future__ import annotations

import pytest
import torch

from oracle import GRAD_TOL, OUT_TOL, assert_close, assert_lse_close, LSE_ATOL, oracle_attention
from ring_sp.kernels import BACKENDS, get_kernel, unavailable_reason
from ring_sp.kernels.reference import ReferenceKernel
from ring_sp.kernels.torch_cpu import TorchCPUKernel
from ring_sp.merge import merge_block_

CPU = torch.device("cpu")
KERNELS = {"reference": ReferenceKernel(), "torch": TorchCPUKernel()}


def _inputs(seq_q: int, seq_k: int, h: int, h_kv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return make(2, seq_q, h, d), make(2, seq_k, h_kv, d), make(2, seq_k, h_kv, d), make(2, seq_q, h, d)


def _leaf64(t: torch.Tensor) -> torch.Tensor:
    """A NEW float64 leaf: ``t.double()`` would return ``t`` itself for float64 input."""
    return t.detach().double().requires_grad_()


def _oracle(q, k, v, dout, mask):
    qo, ko, vo = (_leaf64(t) for t in (q, k, v))
    out, lse = oracle_attention(qo, ko, vo, causal=False, mask=mask)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qo.grad, ko.grad, vo.grad


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq,h,h_kv,d", [(1, 2, 2, 8), (7, 8, 2, 80), (33, 4, 1, 16), (16, 2, 2, 256)])
def test_kernel_matches_oracle(name: str, dtype: torch.dtype, causal: bool, seq: int, h: int, h_kv: int, d: int) -> None:
    kernel = KERNELS[name]
    q, k, v, dout = _inputs(seq, seq, h, h_kv, d, dtype)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril() if causal else None
    out_e, lse_e, dq_e, dk_e, dv_e = _oracle(q, k, v, dout, mask)
    scale = d ** -0.5
    out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
    # the fused CPU kernel computes bf16 blocks in fp32 and hands back fp32 partials
    partial_dtype = torch.float32 if name == "torch" and dtype == torch.bfloat16 else dtype
    assert out.dtype == partial_dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and lse.shape == (2, h, seq)
    assert_close("out", out, out_e, OUT_TOL[dtype])
    assert_lse_close("lse", lse, lse_e, LSE_ATOL[dtype])
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    assert dk.shape == k.shape and dv.shape == v.shape and dq.dtype == dk.dtype == dv.dtype == partial_dtype
    for got, want, what in ((dq, dq_e, "dq"), (dk, dk_e, "dk"), (dv, dv_e, "dv")):
        assert_close(what, got, want, GRAD_TOL[dtype])


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_with_global_statistics_sums_to_the_exact_gradient(name: str, dtype: torch.dtype) -> None:
    """Split the keys in two blocks, merge forward, run each block's backward with the
    GLOBAL out/lse: the sum is the full gradient. Fed the block's own lse, it is not."""
    kernel = KERNELS[name]
    q, k, v, dout = _inputs(6, 10, 4, 2, 16, dtype, seed=1)
    scale = 0.25
    out_e, _, dq_e, dk_e, dv_e = _oracle_scaled(q, k, v, dout, scale)
    blocks = [slice(0, 4), slice(4, 10)]
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc_dtype)
    lse = torch.full((2, 4, 6), float("-inf"), dtype=acc_dtype)
    local = []
    for blk in blocks:
        o_b, l_b = kernel.forward(q, k[:, blk], v[:, blk], causal=False, scale=scale)
        local.append((o_b, l_b))
        merge_block_(out, lse, o_b, l_b)
    out = out.to(dtype)
    grads = [kernel.backward(dout, q, k[:, blk], v[:, blk], out, lse, causal=False, scale=scale) for blk in blocks]
    dq = sum(g[0].double() for g in grads)
    assert_close("dq", dq, dq_e, GRAD_TOL[dtype])
    assert_close("dk", torch.cat([g[1] for g in grads], 1), dk_e, GRAD_TOL[dtype])
    assert_close("dv", torch.cat([g[2] for g in grads], 1), dv_e, GRAD_TOL[dtype])
    # negative control: the block's local statistics give a wrong gradient
    wrong = [kernel.backward(dout, q, k[:, blk], v[:, blk], o_b, l_b, causal=False, scale=scale)
             for blk, (o_b, l_b) in zip(blocks, local)]
    with pytest.raises(AssertionError):
        assert_close("dq", sum(g[0].double() for g in wrong), dq_e, GRAD_TOL[dtype])


def _oracle_scaled(q, k, v, dout, scale):
    qo, ko, vo = (_leaf64(t) for t in (q, k, v))
    out, lse = oracle_attention(qo, ko, vo, causal=False, scale=scale)
    out.backward(dout.double())
    return out.detach(), lse.detach(), qo.grad, ko.grad, vo.grad


class _KernelFunction(torch.autograd.Function):
    """One block through a kernel's own forward/backward, for gradcheck."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, causal):
        out, lse = kernel.forward(q, k, v, causal=causal, scale=0.5)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.causal = kernel, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.kernel.backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=0.5), None, None)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_backward_passes_gradcheck(name: str, causal: bool) -> None:
    q, k, v, _ = _inputs(5, 5, 4, 2, 3, torch.float64, seed=2)
    args = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda a, b, c: _KernelFunction.apply(a, b, c, KERNELS[name], causal), args, fast_mode=False)


def test_causal_alignment_of_the_cpu_op_is_top_left() -> None:
    """The raw op aligns a non-square causal mask top-left (row i sees keys <= i). Pinned
    here so a change in PyTorch is caught; our wrappers only accept square causal blocks."""
    q, k, v, _ = _inputs(6, 4, 2, 2, 8, torch.float64)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True, scale=8 ** -0.5)
    top_left = torch.ones(6, 4, dtype=torch.bool).tril()
    expected, _ = oracle_attention(q, k, v, causal=False, mask=top_left)
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=1e-12, rtol=0)


def test_non_square_causal_blocks_are_refused_without_bands() -> None:
    """A kernel without window arguments takes square masked blocks only; one with them (the
    reference) takes any shape, its mask ``c - a <= diagonal`` in block coordinates (top-left)."""
    q, k, v, _ = _inputs(6, 4, 2, 2, 8, torch.float64)
    with pytest.raises(ValueError, match=r"causal=True needs a square block.*seq_q=6, seq_k=4"):
        KERNELS["torch"].forward(q, k, v, causal=True, scale=1.0)
    with pytest.raises(ValueError, match=r"diagonal=1 needs a kernel with window arguments"):
        KERNELS["torch"].forward(q, k, v, causal=False, scale=1.0, diagonal=1)
    for diagonal in (0, 1, 2):
        out, _ = KERNELS["reference"].forward(q, k, v, causal=True, scale=1.0, diagonal=diagonal)
        expected, _ = oracle_attention(q, k, v, causal=False, scale=1.0, mask=torch.ones(6, 4, dtype=torch.bool).tril(diagonal))
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_empty_blocks_give_zero_output_and_minus_infinity() -> None:
    q = torch.randn(1, 0, 2, 8)
    out, lse = TorchCPUKernel().forward(q, q[:, :, :1], q[:, :, :1], causal=True, scale=1.0)
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)


def test_auto_picks_the_fused_cpu_kernel_and_explicit_unavailable_backends_fail_clearly() -> None:
    assert get_kernel("auto", CPU, torch.float32, 64).name == "torch"
    assert get_kernel("reference", CPU, torch.float32, 64).name == "reference"
    with pytest.raises(RuntimeError, match=r"backend='flash_attn' is unavailable: .*CUDA"):
        get_kernel("flash_attn", CPU, torch.bfloat16, 64)
    with pytest.raises(RuntimeError, match=r"backend='cudnn' is unavailable: backend='cudnn' needs CUDA tensors; got device cpu"):
        get_kernel("cudnn", CPU, torch.bfloat16, 64)
    with pytest.raises(ValueError, match=r"backend='xformers' is not one of"):
        get_kernel("xformers", CPU, torch.float32, 64)
    assert unavailable_reason("torch", CPU, torch.float32, 64) is None
    assert set(BACKENDS) == {"auto", "torch", "flash_attn", "reference", "cudnn"}
