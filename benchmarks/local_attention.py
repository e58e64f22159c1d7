"""One device's attention with a ring_sp kernel, as a plain differentiable module.

It is the single-rank baseline and the ``local_attention`` that DeepSpeed's
``DistributedAttention`` wraps, so every mode of the benchmark runs the same kernel
(the one ``ring_sp.kernels.get_kernel`` picks) on identical inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from ring_sp.kernels import AttentionKernel


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: AttentionKernel, causal: bool,
                scale: float) -> torch.Tensor:
        out, lse = kernel.forward(q, k, v, causal=causal, scale=scale)
        out = out.to(q.dtype)  # bf16 blocks come back in fp32 from the CPU kernel
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.causal, ctx.scale = kernel, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(dout.contiguous(), q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class LocalAttention(nn.Module):
    """q ``[b, s, h, d]``, k/v ``[b, s, h_kv, d]`` -> ``[b, s, h, d]`` on one device."""

    def __init__(self, kernel: AttentionKernel, *, causal: bool, scale: float) -> None:
        super().__init__()
        self.kernel, self.causal, self.scale = kernel, causal, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _KernelAttention.apply(q, k, v, self.kernel, self.causal, self.scale)
