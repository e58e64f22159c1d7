"""Lean layer pieces: autograd Functions that keep less for the backward than the usual modules.

Pure PyTorch (CPU and CUDA, no Triton, no framework), each exact against the plain module it
replaces: the forward runs the same ops, and the backward runs the same ops autograd would
have run (same operands, same dtypes, same casts), on tensors recomputed from what was kept.

* :func:`rms_norm`: keeps its input (its dtype) and one fp32 ``rstd`` per row, where the
  plain module keeps an fp32 copy of the input and the fp32 normalised rows (8 bytes per
  element); three affine styles (:data:`NORM_VARIANTS`).
* :func:`rotary`: RoPE on q and k that keeps only the positions: ``cos`` / ``sin`` are
  recomputed for the backward by the caller's ``cos_sin(positions)``, and the gradient is
  rotated back (``g * cos - rotate_half(g * sin)``, autograd's own ops).
* :func:`gated_mlp`: ``down(act(gate(x)) * up(x))`` keeping its input, gate and up; the
  activation and the product (``down``'s input) are recomputed.
* :func:`linear_keeping_input`: a linear over ``x``'s last two dims flattened that keeps
  ``x`` as given, so an attention output the attention keeps anyway (in whatever strides it
  has) is not kept a second time as a contiguous copy for the output projection.

Autocast: the forwards run under the caller's autocast like the plain modules; the backwards
cast explicitly to the dtypes the forward used and run with autocast off (as autograd does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .gemm import linear_grads

NORM_VARIANTS = ("llama", "olmo", "gemma")
"""How an RMSNorm applies its weight to the fp32 normalised rows ``n``, input dtype ``t``:
``llama`` ``w * n.to(t)`` (Llama, Qwen2/3, Mistral); ``olmo`` ``(w * n).to(t)`` (OLMo 2, gpt-oss);
``gemma`` ``(n * (1 + w.float())).to(t)`` (Gemma 1/2/3)."""

FP32 = torch.float32


def _autocast_off(t: torch.Tensor):
    return torch.autocast(t.device.type, enabled=False)


# ---------------------------------------------------------------- RMSNorm

def _affine(variant: str, normed: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight applied to the fp32 normalised rows, exactly as each module family does."""
    if variant == "llama":
        return weight * normed.to(dtype)
    if variant == "olmo":
        return (weight * normed).to(dtype)
    return (normed * (1.0 + weight.float())).to(dtype)


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """One fp32 ``1 / rms`` per row of the fp32 rows ``xf``, as the modules compute it."""
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str = "llama") -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., H]`` in plain autograd ops, bit for bit :func:`rms_norm`'s forward.

    For a caller that recomputes the normalised rows itself, tile by tile (a tiled MLP that
    keeps the norm's input instead of its output, :func:`..tiling.rowwise_origin`): autograd
    then keeps one tile's fp32 rows at a time."""
    xf = x.to(FP32)
    return _affine(variant, xf * _rstd(xf, eps), weight, x.dtype)


class _RMSNorm(torch.autograd.Function):
    """``x [..., H]`` -> RMSNorm(x) ``[..., H]``; keeps x and rstd ``[..., 1]`` fp32.

    x comes twice (the same tensor): an fp32 x gets the gradients of its two uses (the
    product with rstd, then the square) as two contributions, in that order, as autograd
    hands them to x's other consumers' sum (the residual stream's), bit for bit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, _x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str) -> torch.Tensor:
        xf = x.to(FP32)
        rstd = _rstd(xf, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.variant = variant
        return _affine(variant, xf * rstd, weight, x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        with _autocast_off(x):
            xf = x.to(FP32)
            normed = xf * rstd  # bit for bit the forward's
            gw = None
            if ctx.variant == "llama":  # y = w * n.to(t)
                low = normed.to(x.dtype)
                if need_w:
                    gw = (g * low).sum_to_size(weight.shape).to(weight.dtype)
                del low
                gn = (g * weight).to(x.dtype).to(FP32)
            elif ctx.variant == "olmo":  # y = (w * n).to(t)
                gp = g.to(torch.promote_types(weight.dtype, FP32))
                if need_w:
                    gw = (gp * normed).sum_to_size(weight.shape).to(weight.dtype)
                gn = (gp * weight).to(FP32)
            else:  # gemma: y = (n * (1 + w.float())).to(t)
                gp = g.to(FP32)
                if need_w:
                    gw = (gp * normed).sum_to_size(weight.shape).to(weight.dtype)
                gn = gp * (1.0 + weight.float())
            del normed
            if not need_x:
                return None, None, gw, None, None
            # normed = xf * rsqrt(mean(xf ** 2) + eps): autograd's mul, rsqrt, mean and pow backwards
            g_rstd = (gn * xf).sum_to_size(rstd.shape)
            g_mean = ((-0.5 * g_rstd) * rstd.pow(3)) / x.shape[-1]
            g_product = gn.mul_(rstd)
            g_square = g_mean * (2.0 * xf)
        if x.dtype == FP32:  # no cast: two contributions to x
            return g_product, g_square, gw, None, None
        return (g_product + g_square).to(x.dtype), None, gw, None, None  # summed in fp32 by the cast's node


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str = "llama") -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` ``[..., H]`` with ``weight`` ``[H]`` (style ``variant``,
    see :data:`NORM_VARIANTS`), keeping only ``x`` and one fp32 rstd per row for the backward."""
    if variant not in NORM_VARIANTS:
        raise ValueError(f"variant={variant!r} is not an RMSNorm style ring_sp knows; use one of {NORM_VARIANTS}")
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors; got {type(x).__name__} and {type(weight).__name__}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [H] for x {tuple(x.shape)} (H = x's last dim)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps={eps!r} must be a float >= 0 (the module's variance epsilon)")
    return _RMSNorm.apply(x, x, weight, float(eps), variant)


# ---------------------------------------------------------------- RoPE

def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _unrotate_half(h: torch.Tensor) -> torch.Tensor:
    """The gradient through :func:`_rotate_half` (autograd's cat, neg and slice backwards), in
    a fresh contiguous tensor as autograd's slice backward makes it (later reductions over
    it then run over the same memory order as the plain module's)."""
    half = h.shape[-1] // 2
    out = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    out[..., :half] = h[..., half:]
    torch.neg(h[..., :half], out=out[..., half:])
    return out


class _Rotary(torch.autograd.Function):
    """(q, k) -> (q * cos + rotate_half(q) * sin, same for k); keeps only ``positions``."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cos_sin: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], dim: int, cast: bool):
        c, s = cos.unsqueeze(dim), sin.unsqueeze(dim)
        qe, ke = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        if cast:
            qe, ke = qe.to(q.dtype), ke.to(k.dtype)
        ctx.save_for_backward(positions)
        ctx.cos_sin, ctx.dim, ctx.meta = cos_sin, dim, (cos.shape, cos.dtype, q.dtype, k.dtype)
        ctx.sum_dtypes = (torch.promote_types(q.dtype, cos.dtype), torch.promote_types(k.dtype, cos.dtype))
        return qe, ke

    @staticmethod
    @once_differentiable
    def backward(ctx, gq: torch.Tensor | None, gk: torch.Tensor | None):
        (positions,) = ctx.saved_tensors
        shape, dtype, q_dtype, k_dtype = ctx.meta
        with torch.no_grad():
            cos, sin = ctx.cos_sin(positions)
        if cos.shape != shape or sin.shape != shape or cos.dtype != dtype or sin.dtype != dtype:
            raise RuntimeError(f"the rotary embedding recomputed for the backward is {tuple(cos.shape)} {cos.dtype} "
                               f"/ {tuple(sin.shape)} {sin.dtype}, the forward's was {tuple(shape)} {dtype}: "
                               f"cos_sin(positions) must return what the forward was given")
        c, s = cos.unsqueeze(ctx.dim), sin.unsqueeze(ctx.dim)
        grads = []
        with _autocast_off(c):
            for g, need, in_dtype, sum_dtype in ((gq, ctx.needs_input_grad[0], q_dtype, ctx.sum_dtypes[0]),
                                                 (gk, ctx.needs_input_grad[1], k_dtype, ctx.sum_dtypes[1])):
                if g is None or not need:
                    grads.append(None)
                    continue
                g = g.to(sum_dtype)
                grad = _unrotate_half((g * s).to(in_dtype))
                grad += (g * c).to(in_dtype)  # autograd adds the product's gradient last, into the slices'
                grads.append(grad)
        return grads[0], grads[1], None, None, None, None, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           cos_sin: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], *, unsqueeze_dim: int = 1,
           cast_to_input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE as transformers' ``apply_rotary_pos_emb``, keeping nothing but ``positions``.

    q ``[b, h, n, d]``, k ``[b, h_kv, n, d]`` (``unsqueeze_dim=1``; 2 for ``[b, n, h, d]``),
    cos / sin ``[b, n, d]`` as ``cos_sin(positions)`` returns them (called again, without
    grad, in the backward: it must give the same tensors). ``cast_to_input``: the result in
    q's / k's dtype (OLMo 2) instead of the promoted one. Returns (q, k) rotated.
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor; got {type(t).__name__}")
    if not callable(cos_sin):
        raise TypeError(f"cos_sin must be a callable positions -> (cos, sin); got {type(cos_sin).__name__}")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("cos and sin must not require grad: the lean RoPE makes them again from the positions and "
                         "gives them no gradient; use transformers' apply_rotary_pos_emb for trainable tables")
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(f"cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} must match")
    d = q.shape[-1]
    if d % 2 or k.shape[-1] != d or cos.shape[-1] != d:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and cos {tuple(cos.shape)} need one even last "
                         f"dim (the rotated head size)")
    return _Rotary.apply(q, k, cos, sin, positions, cos_sin, unsqueeze_dim, bool(cast_to_input))


# ---------------------------------------------------------------- linears

class _KeptInputLinear(torch.autograd.Function):
    """``x [..., a, b]`` -> ``linear(x.flatten(-2))``; keeps x itself (no contiguous copy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        return F.linear(x.reshape(*x.shape[:-2], -1).contiguous(), weight, bias)  # the copy lives in here only

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        with _autocast_off(g):
            gx, gw, gb = linear_grads(g, x.reshape(*x.shape[:-2], -1), weight, bias, *ctx.needs_input_grad)
        return None if gx is None else gx.view(x.shape), gw, gb


def linear_keeping_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x.reshape(..., a * b).contiguous(), weight, bias)`` for ``x`` ``[..., a, b]``
    (an attention output ``[b, n, h, d]`` in any strides), keeping ``x`` itself for the
    backward rather than the contiguous copy; the gradient of x comes back contiguous."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise ValueError(f"x must be a tensor [..., a, b] of at least 3 dims; got {getattr(x, 'shape', x)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-2] * x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [out, a * b] for x {tuple(x.shape)}")
    return _KeptInputLinear.apply(x, weight, bias)


# ---------------------------------------------------------------- gated MLP

class _GatedMLP(torch.autograd.Function):
    """``down(act(gate(x)) * up(x))``; keeps x, gate and up (act and the product recomputed).

    x comes twice (the same tensor): its gradients through up and through gate are two
    contributions, in the order autograd runs the plain module's nodes (up's, then gate's),
    so x's other consumers' sum (a residual stream's) rounds as with the plain module."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, _x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], gate_w: torch.Tensor,
                gate_b: torch.Tensor | None, up_w: torch.Tensor, up_b: torch.Tensor | None, down_w: torch.Tensor,
                down_b: torch.Tensor | None) -> torch.Tensor:
        gate, up = F.linear(x, gate_w, gate_b), F.linear(x, up_w, up_b)
        y = F.linear(act(gate) * up, down_w, down_b)
        ctx.save_for_backward(x, gate, up, gate_w, gate_b, up_w, up_b, down_w, down_b)
        device = x.device.type
        autocast = torch.is_autocast_enabled(device)
        ctx.act, ctx.autocast = act, (device, autocast, torch.get_autocast_dtype(device))
        # autocast casts a float32 leaf once for both linears (its cast cache): the two gradients
        # then meet in the cast's dtype, before the cast back
        ctx.shared_cast = (autocast and torch.is_autocast_cache_enabled() and x.is_leaf and x.requires_grad
                           and x.dtype == FP32 and not x._is_view())
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: torch.Tensor):
        x, gate, up, gate_w, gate_b, up_w, up_b, down_w, down_b = ctx.saved_tensors
        need = (ctx.needs_input_grad[0], *ctx.needs_input_grad[2:])  # as if x came once
        need_in = need[0] or any(need[2:6])  # anything before the product
        device, autocast, autocast_dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
            gate_ = gate.detach().requires_grad_(need_in)
            up_ = up.detach().requires_grad_(need_in)
            product = ctx.act(gate_) * up_  # as the forward computed it (same autocast)
        with _autocast_off(gy):
            g_product, g_down_w, g_down_b = linear_grads(gy, product.detach(), down_w, down_b, need_in, need[6],
                                                          need[7])
            if not need_in:
                return None, None, None, None, None, None, None, g_down_w, g_down_b
            g_gate, g_up = torch.autograd.grad(product, (gate_, up_), g_product)
            del product, gate_, up_, g_product
            cast = not ctx.shared_cast
            gx_gate, g_gate_w, g_gate_b = linear_grads(g_gate, x, gate_w, gate_b, need[0], need[2], need[3], cast)
            gx_up, g_up_w, g_up_b = linear_grads(g_up, x, up_w, up_b, need[0], need[4], need[5], cast)
        if need[0] and ctx.shared_cast:  # one cast of x for both: summed in its dtype, then cast back
            gx_up, gx_gate = (gx_up + gx_gate).to(x.dtype), None
        return gx_up, gx_gate, None, g_gate_w, g_gate_b, g_up_w, g_up_b, g_down_w, g_down_b


def gated_mlp(x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], gate_w: torch.Tensor,
              gate_b: torch.Tensor | None, up_w: torch.Tensor, up_b: torch.Tensor | None, down_w: torch.Tensor,
              down_b: torch.Tensor | None) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` for ``x`` ``[..., H]`` (weights ``[F, H]``, ``[F, H]``,
    ``[H, F]``), keeping only x, gate and up ``[..., F]`` for the backward."""
    if not callable(act):
        raise TypeError(f"act must be a callable (the MLP's activation); got {type(act).__name__}")
    hidden, ffn = x.shape[-1], gate_w.shape[0]
    if gate_w.shape != (ffn, hidden) or up_w.shape != (ffn, hidden) or down_w.shape != (hidden, ffn):
        raise ValueError(f"weights gate {tuple(gate_w.shape)}, up {tuple(up_w.shape)}, down {tuple(down_w.shape)} "
                         f"must be [F, H], [F, H], [H, F] for x {tuple(x.shape)} (H = x's last dim)")
    return _GatedMLP.apply(x, x, act, gate_w, gate_b, up_w, up_b, down_w, down_b)


__all__ = ["NORM_VARIANTS", "gated_mlp", "linear_keeping_input", "rms_norm", "rms_norm_rows", "rotary"]
