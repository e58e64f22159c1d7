"""Lean layer pieces: autograd Functions that keep less for the backward than the modules they replace.

At long context every ``[n, hidden]`` tensor a layer keeps for its backward is a real cost.
transformers' RMSNorm, for example, computes in fp32 through autograd, so it keeps an fp32
copy of its input and its normalised value besides its output: 6 extra bytes per hidden unit
per token in bf16, 4 in fp32. :func:`rms_norm` keeps only its input (in the model's dtype:
the residual stream, alive anyway) and one fp32 ``rstd`` per row, and recomputes the
normalised value in the backward (one multiply). Pure PyTorch, CPU and CUDA alike; exact
against the modules it stands for up to the order of fp32 operations (1e-6 in fp32; in
bf16 the modules' own rounding, a few bf16 ulps).
"""

from __future__ import annotations

import torch

NORM_VARIANTS = ("llama", "olmo", "gemma")
"""How an RMSNorm applies its weight ``w`` to the fp32 normalised value ``x_hat``, ``dt`` the input dtype:
``llama``: ``w * x_hat.to(dt)`` (Llama, Qwen2/3, Mistral); ``olmo``: ``(w * x_hat).to(dt)`` (OLMo 2,
gpt-oss); ``gemma``: ``(x_hat * (1 + w.float())).to(dt)`` (Gemma 1/2/3)."""


def _scaled(x_hat: torch.Tensor, weight: torch.Tensor, variant: str, dtype: torch.dtype) -> torch.Tensor:
    if variant == "llama":
        return weight * x_hat.to(dtype)
    if variant == "olmo":
        return (weight * x_hat).to(dtype)
    return (x_hat * (1.0 + weight.float())).to(dtype)


class _RMSNorm(torch.autograd.Function):
    """``x [..., H] -> y [..., H]``; keeps ``x``, ``weight`` and the fp32 ``rstd [..., 1]``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = _scaled(xf * rstd, weight, variant, x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.variant = variant
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        variant, dtype = ctx.variant, x.dtype
        # the gradient reaching x_hat (fp32) and the weight's, in the order autograd takes them through the module
        if variant == "llama":
            x_hat_dt = x_hat.to(dtype)
            dweight = dy * x_hat_dt if ctx.needs_input_grad[1] else None
            dx_hat = (dy * weight).to(dtype).float()
        else:
            dyf = dy.float()
            dweight = dyf * x_hat if ctx.needs_input_grad[1] else None
            dx_hat = dyf * (weight.float() if variant == "olmo" else 1.0 + weight.float())
        if dweight is not None:
            dweight = dweight.reshape(-1, dweight.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat)), the mean over the row
            dx = (rstd * (dx_hat - x_hat * (dx_hat * x_hat).mean(-1, keepdim=True))).to(dtype)
        return dx, dweight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str = "llama") -> torch.Tensor:
    """RMSNorm of ``x [..., H]`` with ``weight [H]`` as a Hugging Face module of ``variant``
    (:data:`NORM_VARIANTS`) computes it, keeping only ``x`` and one fp32 ``rstd`` per row for
    the backward. Returns ``[..., H]`` in the module's output dtype."""
    if variant not in NORM_VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {NORM_VARIANTS}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [{x.shape[-1]}] for x {tuple(x.shape)}")
    return _RMSNorm.apply(x, weight, float(eps), variant)


__all__ = ["NORM_VARIANTS", "rms_norm"]
