"""PyTorch's fused CUDA attention ops (the "torch" backend on CUDA).

Two aten ops return the logsumexp and have a backward that accepts any ``out``/``logsumexp``,
which is the global-statistics backward the ring needs (PyTorch's own context parallelism,
torch/distributed/tensor/experimental/_context_parallel/_attention.py, relies on the same):

* ``_scaled_dot_product_flash_attention``: fp16/bf16, head_dim a multiple of 8 and <= 256,
  sm80+. Its flash-attn 2 port takes ``h_kv`` KV heads natively; lse is ``[b, h, sq]``.
  It needs one head size for q, k and v.
* ``_scaled_dot_product_efficient_attention``: fp32, and fp16/bf16 where flash cannot run,
  including a value head size different from q/k's (MLA; each aligned as below).
  It needs equal head counts, so KV heads are expanded here and dk/dv summed back. Its lse
  is padded to a multiple of 32 queries (``kAlignLSE``), and its backward reads that padding,
  which must be +inf (what the forward writes there) so padded rows add exp(-inf) = 0.

Both take ``[b, h, s, d]``; we pass transposed views of our ``[b, s, h, d]`` tensors.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .base import FusedKernel

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
# The CUDA (CUTLASS) efficient kernel pads lse to 32 queries; ROCm's does not (see its meta function).
_LSE_ALIGN = 1 if torch.version.hip else 32


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[b, s, h, d] <-> [b, h, s, d] view; the ops also need a unit stride on head_dim."""
    return (x if x.stride(-1) == 1 else x.contiguous()).transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _flash_reason(dtype: torch.dtype, head_dim: int, capability: tuple[int, int],
                  value_head_dim: int | None = None) -> str | None:
    """Why the flash op cannot run this, or None."""
    if value_head_dim is not None and value_head_dim != head_dim:
        return f"the flash op needs equal q/k and v head sizes; got {head_dim} and {value_head_dim}"
    if dtype not in _HALF:
        return f"the flash op takes float16/bfloat16, not {dtype}"
    # is_flash_attention_available is missing from some torch >= 2.4 releases; assume built then.
    if not getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)():
        return "this PyTorch build has no flash attention"
    if capability < (8, 0):
        return f"the flash op needs an sm80+ GPU; this one is sm{capability[0]}{capability[1]}"
    if head_dim % 8 or head_dim > 256:
        return f"the flash op needs head_dim a multiple of 8 and <= 256; got {head_dim}"
    return None


def _efficient_reason(dtype: torch.dtype, head_dim: int, capability: tuple[int, int],
                      value_head_dim: int | None = None) -> str | None:
    """Why the memory-efficient op cannot run this, or None (alignment rule of sdp_utils,
    which it applies to the q/k and the value head size alike)."""
    if dtype == torch.bfloat16 and capability < (8, 0):
        return f"bfloat16 attention needs an sm80+ GPU; this one is sm{capability[0]}{capability[1]}"
    align = 8 if dtype in _HALF else 4
    for name, size in (("head_dim", head_dim), ("value head_dim", value_head_dim if value_head_dim is not None else head_dim)):
        if size % align:
            return f"PyTorch's memory-efficient attention needs {name} divisible by {align} for {dtype}; got {size}"
    return None


def unavailable_reason(dtype: torch.dtype, head_dim: int, value_head_dim: int | None = None) -> str | None:
    """Why neither fused op can run ``dtype``/``head_dim`` (and ``value_head_dim``, None = the
    same) on the current GPU, or None."""
    if not torch.cuda.is_available():
        return "CUDA is not available here (torch.cuda.is_available() is False)"
    if dtype not in (*_HALF, torch.float32):
        return f"{str(dtype).removeprefix('torch.')} has no fused CUDA attention op (float16, bfloat16, float32 only)"
    capability = torch.cuda.get_device_capability()
    if _flash_reason(dtype, head_dim, capability, value_head_dim) is None:
        return None
    return _efficient_reason(dtype, head_dim, capability, value_head_dim)


def _use_flash(q: torch.Tensor, v: torch.Tensor) -> bool:
    return _flash_reason(q.dtype, q.shape[-1], _capability(q.device), v.shape[-1]) is None


def _no_dropout_rng() -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholders for the backward ops' RNG arguments, which are read only when dropout_p > 0.

    torch 2.4 calls them philox_seed/philox_offset (CPU int64 scalars without dropout); later
    releases pass rng_state/unused in the same positions. The ring never uses dropout.
    """
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, s, h_kv, d] -> [b, s, h_kv * groups, d]: query head i uses KV head i // groups."""
    return x.repeat_interleave(groups, dim=2) if groups > 1 else x


def _sum_groups(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of ``_repeat_kv`` for gradients, summed in fp32: [b, s, h, d] -> [b, s, h_kv, d]."""
    if dx.shape[2] == kv_heads:
        return dx
    return dx.unflatten(2, (kv_heads, -1)).sum(3, dtype=torch.float32).to(dx.dtype)


class TorchCUDAKernel(FusedKernel):
    """Fused CUDA attention: the flash op where it can run, else the memory-efficient op."""

    name = "torch"

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        if _use_flash(q, v):
            out, lse = _aten._scaled_dot_product_flash_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale
            )[:2]
            return _bhsd(out), lse
        groups = q.shape[2] // k.shape[2]
        out, lse = _aten._scaled_dot_product_efficient_attention(
            _bhsd(q), _bhsd(_repeat_kv(k, groups)), _bhsd(_repeat_kv(v, groups)), None, True, 0.0, causal, scale=scale
        )[:2]
        return _bhsd(out), lse[:, :, : q.shape[1]]  # drop the kAlignLSE padding

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seed, offset = _no_dropout_rng()
        if _use_flash(q, v):
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse,
                None, None, q.shape[1], k.shape[1],  # cum_seq_q/k: None = dense (not varlen) batch
                0.0, causal, seed, offset, scale=scale,
            )
            return _bhsd(dq), _bhsd(dk), _bhsd(dv)
        groups = q.shape[2] // k.shape[2]
        padded = -lse.shape[-1] % _LSE_ALIGN
        lse = F.pad(lse, (0, padded), value=float("inf")) if padded else lse
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(_repeat_kv(k, groups)), _bhsd(_repeat_kv(v, groups)), None,
            _bhsd(out), lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
        )
        return _bhsd(dq), _sum_groups(_bhsd(dk), k.shape[2]), _sum_groups(_bhsd(dv), k.shape[2])
