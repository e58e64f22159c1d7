"""PyTorch's fused CPU flash-attention op (the default backend on CPU).

``aten._scaled_dot_product_flash_attention_for_cpu`` returns the logsumexp (float32 for
low-precision inputs, float64 for float64) and its backward op accepts an arbitrary
``out``/``logsumexp``, which is exactly the global-statistics backward the ring needs.
Both ops take ``[b, h, s, d]`` and run fastest when each head's rows are dense (the backward
3-5% faster at 4 heads, 16% at 16, 4K-8K tokens): the kernel is ``head_major``, so Ulysses
hands it views of ``[b, h, s, d]`` storage, which pass as they are. The forward copies other
inputs head-major (faster, copies included, see ``_forward``); the backward takes them as
transposed views (no copy, for memory; bf16/fp16 get the cast's one copy, head-major). Both
hand back transposed views of their results. The op supports GQA natively.

bf16/fp16 blocks are computed in float32 and their partial results (out, dq, dk, dv) are
returned in float32: the ring accumulates partials in float32 anyway, and rounding every
partial to bf16 first would add one rounding per ring step (measured: max error up to
~2.5x the single-device kernel's at R=4). On CPU this costs little: the bf16 forward runs
at the fp32 speed, the backward ~1.4x slower.

The op needs one head size for q, k AND v (torch 2.13 raises "Q/K/V should have the same
head size"), so a different value head size (MLA) is unavailable here and ``auto`` picks
the reference kernel on CPU for it.
"""

from __future__ import annotations

import torch

from .base import FusedKernel

_aten = torch.ops.aten


def _bhsd(x: torch.Tensor, *, dense_heads: bool = False) -> torch.Tensor:
    """[b, s, h, d] as [b, h, s, d], in float32 if x is bf16/fp16 (see module docstring): a view
    when no cast is needed and (unless ``dense_heads``) whatever the strides; otherwise ONE copy,
    laid out head-major because that is what the op runs fastest on."""
    x = x.transpose(1, 2)
    dtype = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    if dtype != x.dtype:
        return x.to(dtype, memory_format=torch.contiguous_format)
    # (not ``x.to(memory_format=...)``: it returns x itself for these strides, no copy)
    return x.contiguous() if dense_heads and not _rows_dense(x) else x


def _rows_dense(x: torch.Tensor) -> bool:
    """Each head's rows of ``[b, h, s, d]`` are one dense block (any head and batch strides)."""
    return x.stride(-1) == 1 and (x.shape[-2] <= 1 or x.stride(-2) == x.shape[-1])


def unavailable_reason(head_dim: int, value_head_dim: int) -> str | None:
    """Why the CPU op cannot run these head sizes, or None."""
    if value_head_dim != head_dim:
        return (f"PyTorch's CPU flash-attention op needs the value head size equal to the q/k head size; "
                f"got head_dim={head_dim}, value head_dim={value_head_dim} (MLA)")
    return None


class TorchCPUKernel(FusedKernel):
    """Fused CPU flash attention (fp64, fp32; bf16/fp16 computed in fp32)."""

    name = "torch"
    head_major = True

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        # rows dense per head: on [b, s, h, d] storage the op reads each head's rows h*d apart;
        # copying such inputs head-major first is faster, copies included (4K tokens causal, one
        # thread, interleaved medians: 0.97x at 4 heads, 0.70x at 16). Ulysses' outputs and their
        # row blocks are dense already (no copy). Not in the backward: its five copies would
        # raise the ring's backward peak past the planner's minimum (tests/test_memory.py)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q, dense_heads=True), _bhsd(k, dense_heads=True), _bhsd(v, dense_heads=True), 0.0, causal,
            scale=scale
        )
        return out.transpose(1, 2), lse

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
