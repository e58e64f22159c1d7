"""PyTorch's fused CPU flash-attention op (the default backend on CPU).

``aten._scaled_dot_product_flash_attention_for_cpu`` returns the logsumexp (float32 for
low-precision inputs, float64 for float64) and its backward op accepts an arbitrary
``out``/``logsumexp``, which is exactly the global-statistics backward the ring needs.
Both ops take ``[b, h, s, d]``; the forward gets head-major copies of our ``[b, s, h, d]``
tensors (faster, see ``_forward``), the backward transposed views (no copy), and both hand
back transposed views of theirs. The op supports GQA natively.

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


def _bhsd(x: torch.Tensor, *, head_major: bool = False) -> torch.Tensor:
    """[b, s, h, d] as [b, h, s, d] (a view; ``head_major``: contiguous), in float32 if x is
    bf16/fp16 (see module docstring); at most one copy either way."""
    x = x.transpose(1, 2)
    dtype = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    return x.to(dtype, memory_format=torch.contiguous_format if head_major else torch.preserve_format)


def unavailable_reason(head_dim: int, value_head_dim: int) -> str | None:
    """Why the CPU op cannot run these head sizes, or None."""
    if value_head_dim != head_dim:
        return (f"PyTorch's CPU flash-attention op needs the value head size equal to the q/k head size; "
                f"got head_dim={head_dim}, value head_dim={value_head_dim} (MLA)")
    return None


class TorchCPUKernel(FusedKernel):
    """Fused CPU flash attention (fp64, fp32; bf16/fp16 computed in fp32)."""

    name = "torch"

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        # head-major copies: on [b, s, h, d] views the op reads each head's rows h*d apart and
        # ran 2-10% slower, copies included (2K-8K tokens, 4-16 heads, one thread, medians).
        # Not in the backward: its five copies would raise the ring's backward peak past the
        # planner's minimum (tests/test_memory.py), which the forward's three do not
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q, head_major=True), _bhsd(k, head_major=True), _bhsd(v, head_major=True), 0.0, causal, scale=scale
        )
        return out.transpose(1, 2), lse

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, 0.0, causal, scale=scale
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
