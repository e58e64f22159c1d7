"""Gradient GEMMs on operands of the model's dtype, summed in fp32: the one place that decides how.

A tiled step sums a parameter's gradient over tiles of tokens (the tiled loss's LM head, the
tiled MLP's weights): ``acc += a @ b`` per tile, ``acc`` fp32 (the sum must not round per
tile), ``a`` and ``b`` in the model's dtype. Upcasting ``a`` and ``b`` to fp32 gives the same
exact products, but a GPU then runs the GEMM on its SIMT units instead of its tensor cores, an
order of magnitude slower (the tiled loss's head gradient took 54% of a bf16 step on an H200
that way, issue 38). How :func:`accumulate_matmul` runs it instead (:func:`fused_accumulation`
decides):

* ``a``, ``b`` already in ``acc``'s dtype (an fp32 / fp64 model): ``acc.addmm_(a, b)``, one GEMM.
* CUDA, torch >= 2.10, bf16 / fp16 operands, fp32 ``acc``:
  ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``: the tensor-core GEMM's fp32
  accumulation goes straight into ``acc`` (cuBLAS ``beta = 1``), nothing rounded to bf16, no
  product buffer. torch 2.8 added ``out_dtype`` to ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm``
  (fp16 / bf16 -> fp32, CUDA only; pytorch#150812), but its ``addmm`` wanted ``self`` in the
  operands' dtype; 2.10 takes an fp32 ``self`` (pytorch#167931). CPU has no ``out_dtype``
  kernel (torch 2.13 included); ROCm builds are left out (not verified there).
* elsewhere: the product in the operands' dtype, in row blocks no larger than the larger
  operand (scratch of the order of what the GEMM reads anyway), each block added into ``acc``.

Error against the fp32 reference (the upcast GEMM: bf16 x bf16 products are exact in fp32, so
it only rounds its fp32 sums), per element of the summed gradient ``G = sum_t P_t`` over ``T``
tiles of ``k`` rows: the fused path rounds like the reference (fp32 accumulation, a different
order): ``|G - G_ref| <= (k + T) 2**-24 sum |a||b|``; the block path rounds each tile's product
once to the operands' dtype: ``+ u sum_t |P_t|``, ``u = 2**-8`` (bf16) or ``2**-11`` (fp16),
the same size as rounding ``G`` itself to a bf16 parameter's ``.grad`` once (tiles whose products
do not cancel). ``tests/test_gemm.py`` measures both against these bounds.
"""

from __future__ import annotations

import re

import torch

FP32 = torch.float32
LOW_PRECISION = (torch.bfloat16, torch.float16)

OUT_DTYPE_ACCUMULATION_SINCE = (2, 10)
"""The first torch release whose CUDA ``addmm(fp32 self, bf16/fp16 mats, out_dtype=fp32)`` runs."""


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.10.0+cu130"`` -> ``(2, 10)``)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"cannot read the torch version {version!r}")
    return int(found.group(1)), int(found.group(2))


TORCH_RELEASE = torch_release()


def fused_accumulation(device: torch.device, operands: torch.dtype, accumulator: torch.dtype, *,
                       release: tuple[int, int] = TORCH_RELEASE, hip: bool | None = None) -> bool:
    """Whether a GEMM of ``operands`` writes its fp32 sum straight into an ``accumulator`` tensor
    on ``device`` (``addmm(..., out_dtype=)``). ``release`` / ``hip``: this torch's (for tests)."""
    hip = torch.version.hip is not None if hip is None else hip
    return (device.type == "cuda" and not hip and release >= OUT_DTYPE_ACCUMULATION_SINCE
            and operands in LOW_PRECISION and accumulator == FP32)


def accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place: ``acc`` ``[m, n]`` fp32 (or the operands' dtype), ``a`` ``[m, k]``
    and ``b`` ``[k, n]`` of one dtype, never upcast (see the module docstring for how and the bound)."""
    if a.dtype != b.dtype or a.dim() != 2 or b.dim() != 2 or acc.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"accumulate_matmul needs acc [m, n] += a [m, k] @ b [k, n] with a and b of one dtype; got "
                         f"acc {tuple(acc.shape)}, a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}")
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype != torch.promote_types(a.dtype, FP32):
        raise ValueError(f"accumulate_matmul sums {a.dtype} products into {acc.dtype}: the accumulator must be "
                         f"{torch.promote_types(a.dtype, FP32)} (or {a.dtype})")
    elif fused_accumulation(acc.device, a.dtype, acc.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        rows = max(1, max(a.numel(), b.numel()) // max(1, b.shape[1]))  # a block no larger than the larger operand
        block = torch.empty((min(rows, a.shape[0]), b.shape[1]), dtype=a.dtype, device=a.device)
        for start in range(0, a.shape[0], rows):
            part = block[:min(rows, a.shape[0] - start)]
            torch.mm(a[start:start + rows], b, out=part)
            acc[start:start + part.shape[0]] += part


def linear_grads(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, need_x: bool,
                 need_w: bool, need_b: bool, cast_x: bool = True,
                 weight_sum: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """Gradients of ``F.linear(x, weight, bias)`` given ``g`` ``[..., out]``, as autograd's mm / addmm
    backwards compute them: operands in the output's dtype (autocast's), results cast back
    (x's only if ``cast_x``). ``weight_sum`` (fp32 ``[out, in]``): the weight's gradient is added
    into it (:func:`accumulate_matmul`) and None returned for it."""
    c = g.dtype
    g2 = g.reshape(-1, g.shape[-1])
    gw = None
    if need_w:  # before gx: its product block and gx are not alive at once
        x2 = x.reshape(-1, x.shape[-1]).to(c)
        if weight_sum is None:
            gw = g2.t().mm(x2).to(weight.dtype)
        else:
            accumulate_matmul(weight_sum, g2.t(), x2)
        del x2
    gx = g2.mm(weight.to(c)).view(*x.shape[:-1], weight.shape[1]) if need_x else None
    gx = gx.to(x.dtype) if gx is not None and cast_x else gx
    gb = g2.sum(0).to(bias.dtype) if need_b and bias is not None else None
    return gx, gw, gb


__all__ = ["OUT_DTYPE_ACCUMULATION_SINCE", "TORCH_RELEASE", "accumulate_matmul", "fused_accumulation", "linear_grads",
           "torch_release"]
