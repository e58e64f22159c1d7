"""PyTorch's fused CUDA attention ops (the "torch" backend on CUDA).

Two aten ops return the logsumexp and have a backward that accepts any ``out``/``logsumexp``,
which is the global-statistics backward the ring needs (PyTorch's own context parallelism,
torch/distributed/tensor/experimental/_context_parallel/_attention.py, relies on the same):

* ``_flash_attention_forward`` / ``_backward`` (what ``_scaled_dot_product_flash_attention``
  calls, minus its transposes): fp16/bf16, head_dim a multiple of 8 and <= 256, sm80+,
  FlashAttention-2 ported into torch. It takes ``[b, s, h, d]`` with any row and head strides
  and ``h_kv`` KV heads natively; lse is ``[b, h, sq]``. It needs one head size for q, k and v.
  From torch 2.5 both take ``window_size_left/right`` (read from the op schemas,
  :func:`flash_window_arguments`): bands of any shape then run as ONE call, aligned
  bottom-right (:func:`ring_sp.schedule.bottom_right_window`, which also keeps clear of the
  op turning a right window ``>= seqlen_k`` into "unbounded"; -1 / None is unbounded, and a
  row that sees no key gets out 0 and lse +inf). With ``cum_seq_q/k`` (int32 offsets,
  ``max_q/k``) it is the varlen kernel: q, k, v ``[total, h, d]`` and lse ``[h, total_q]``
  (since torch took FlashAttention 2.6's unpadded lse; asked of the op's meta kernel,
  :func:`varlen_lse_packed`), so many blocks of a ring step run as one call
  (:meth:`TorchCUDAKernel.forward_segments`) on views of the shards, one call per batch
  element (a ``[b, s]`` flattening is no view for Ulysses' head-major storage). Its backward
  allocates dq/dk/dv (``empty_like``) and writes every row and key of every segment (zeros
  where a segment has no queries or no keys; flash_api.cpp mha_varlen_bwd and the kernels'
  early exits), so filler segments need no extra work.
* ``_scaled_dot_product_efficient_attention``: fp32, and fp16/bf16 where flash cannot run,
  including a value head size different from q/k's (MLA; each aligned as below).
  It needs equal head counts, so KV heads are expanded here and dk/dv summed back. Its lse
  is padded to a multiple of 32 queries (``kAlignLSE``), and its backward reads that padding,
  which must be +inf (what the forward writes there) so padded rows add exp(-inf) = 0. It
  takes no window here and no blocks as segments: the schedule cuts bands for it.

Which op runs is fixed when the kernel is made (:func:`kernel_for`: by dtype, head sizes and
GPU), so what it takes (``supports_window``, ``supports_varlen``) is known to the schedule.
On ROCm neither band nor varlen path is used (its flash op is another implementation).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..schedule.blocks import bottom_right_window
from .base import FusedKernel, Segments

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


def kernel_for(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int) -> TorchCUDAKernel:
    """The kernel for such tensors on ``device``: the flash op where it runs, else the efficient op."""
    return TorchCUDAKernel(flash=_flash_reason(dtype, head_dim, _capability(device), value_head_dim) is None)


def _flash_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """aten's flash-attention forward and backward (tests/torch_flash_double.py puts its CPU
    double of them here)."""
    return _aten._flash_attention_forward, _aten._flash_attention_backward


@functools.lru_cache(maxsize=None)
def flash_window_arguments() -> bool:
    """Whether this torch's flash ops take ``window_size_left/right`` (torch >= 2.5), from their schemas."""
    if torch.version.hip:
        return False

    def names(op: Any) -> set[str]:
        return {argument.name for argument in op.default._schema.arguments}

    ops = torch.ops.aten
    return all({"window_size_left", "window_size_right"} <= names(op)
               for op in (ops._flash_attention_forward, ops._flash_attention_backward))


@functools.lru_cache(maxsize=None)
def varlen_lse_packed() -> bool:
    """Whether the varlen flash forward returns lse ``[heads, total_q]`` (FlashAttention >= 2.6 in
    torch; before, ``[segments, heads, max_q]``), asked of the op's meta kernel once."""
    if torch.version.hip:
        return False
    q = torch.empty(3, 1, 8, device="meta", dtype=torch.float16)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device="meta")
    try:
        lse = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, False, False)[1]
    except (RuntimeError, NotImplementedError):
        return False
    return tuple(lse.shape) == (1, 3)


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


def _mask_arguments(window: tuple[int, int]) -> tuple[bool, dict[str, int | None]]:
    """(is_causal, window keywords) of the flash ops for a bottom-right ``(left, right)``; no
    keywords for full and plain causal blocks, so torch 2.4's ops (no window) take those."""
    if window in ((-1, -1), (-1, 0)):
        return window == (-1, 0), {}
    left, right = window
    return False, dict(window_size_left=None if left < 0 else left, window_size_right=None if right < 0 else right)


def _block_window(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int | None,
                  diagonal: int) -> tuple[int, int]:
    if window is None and not diagonal:
        return (-1, 0) if causal else (-1, -1)
    return bottom_right_window(q.shape[1], k.shape[1], causal, window, diagonal)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """The flash ops need a unit stride on head_dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


class TorchCUDAKernel(FusedKernel):
    """Fused CUDA attention: the flash op (``flash=True``), the memory-efficient op
    (``flash=False``), or whichever runs, per call (``flash=None``: then no bands or segments)."""

    name = "torch"

    def __init__(self, flash: bool | None = None) -> None:
        self.flash = flash

    @property
    def supports_window(self) -> bool:  # type: ignore[override]
        return self.flash is True and flash_window_arguments()

    @property
    def supports_varlen(self) -> bool:  # type: ignore[override]
        return self.flash is True and varlen_lse_packed()

    def _flash(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        return _use_flash(q, v) if self.flash is None else self.flash

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 window: int | None = None, diagonal: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self._flash(q, v):
            is_causal, extra = _mask_arguments(_block_window(q, k, causal, window, diagonal))
            return _flash_ops()[0](_dense(q), _dense(k), _dense(v), None, None, q.shape[1], k.shape[1], 0.0,
                                   is_causal, False, scale=scale, **extra)[:2]
        groups = q.shape[2] // k.shape[2]
        out, lse = _aten._scaled_dot_product_efficient_attention(
            _bhsd(q), _bhsd(_repeat_kv(k, groups)), _bhsd(_repeat_kv(v, groups)), None, True, 0.0, causal, scale=scale
        )[:2]
        return _bhsd(out), lse[:, :, : q.shape[1]]  # drop the kAlignLSE padding

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, window: int | None = None,
                  diagonal: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        seed, offset = _no_dropout_rng()
        if self._flash(q, v):
            is_causal, extra = _mask_arguments(_block_window(q, k, causal, window, diagonal))
            return _flash_ops()[1](
                _dense(dout), _dense(q), _dense(k), _dense(v), _dense(out), lse,
                None, None, q.shape[1], k.shape[1],  # cum_seq_q/k: None = dense (not varlen) batch
                0.0, is_causal, seed, offset, scale=scale, **extra,
            )
        groups = q.shape[2] // k.shape[2]
        padded = -lse.shape[-1] % _LSE_ALIGN
        lse = F.pad(lse, (0, padded), value=float("inf")) if padded else lse
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(_repeat_kv(k, groups)), _bhsd(_repeat_kv(v, groups)), None,
            _bhsd(out), lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
        )
        return _bhsd(dq), _sum_groups(_bhsd(dk), k.shape[2]), _sum_groups(_bhsd(dv), k.shape[2])

    def forward_segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments, *,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One varlen call per batch element over ``segments``: q ``[b, rows, h, d]``, k/v
        ``[b, keys, h_kv, d]`` (the call's rows and keys, any strides) -> out ``[b, rows, h, d]``,
        lse ``[b, h, rows]`` (-inf on rows of segments without keys)."""
        self._check_segments()
        is_causal, extra = _mask_arguments(segments.window)
        forward = _flash_ops()[0]
        out = lse = None  # batch 1: the op's results as they are; more: each element's copied in, one at a time
        for j in range(q.shape[0]):
            out_j, lse_j = forward(_dense(q[j]), _dense(k[j]), _dense(v[j]), segments.cu_q, segments.cu_k,
                                   segments.max_q, segments.max_k, 0.0, is_causal, False, scale=scale, **extra)[:2]
            if lse_j.shape != (q.shape[2], q.shape[1]):
                raise RuntimeError(f"the varlen flash op returned lse of shape {tuple(lse_j.shape)}, not [heads, rows] "
                                   f"{(q.shape[2], q.shape[1])}: this torch's layout differs from its meta kernel's")
            if q.shape[0] == 1:
                out, lse = out_j.unsqueeze(0), lse_j.unsqueeze(0)
                break
            if out is None:
                out = out_j.new_empty((q.shape[0], *out_j.shape))
                lse = lse_j.new_empty((q.shape[0], *lse_j.shape))
            out[j].copy_(out_j)
            lse[j].copy_(lse_j)
        if segments.fills_rows:  # the op's lse of a row without keys is +inf; ours is -inf
            lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
        return out, lse

    def backward_segments(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, segments: Segments, *,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of :meth:`forward_segments`' call given the GLOBAL out ``[b, rows, h, d]`` and
        lse ``[b, h, rows]`` of its rows: dq ``[b, rows, h, d]``, dk/dv ``[b, keys, h_kv, d]``."""
        self._check_segments()
        is_causal, extra = _mask_arguments(segments.window)
        backward = _flash_ops()[1]
        seed, offset = _no_dropout_rng()
        grads: list[torch.Tensor] = []
        for j in range(q.shape[0]):
            grads_j = backward(_dense(dout[j]), _dense(q[j]), _dense(k[j]), _dense(v[j]), _dense(out[j]),
                               lse[j].contiguous(),  # read as a dense [heads, rows] buffer
                               segments.cu_q, segments.cu_k, segments.max_q, segments.max_k, 0.0, is_causal, seed,
                               offset, scale=scale, **extra)
            if q.shape[0] == 1:
                return tuple(g.unsqueeze(0) for g in grads_j)  # type: ignore[return-value]
            if not grads:
                grads = [g.new_empty((q.shape[0], *g.shape)) for g in grads_j]
            for whole, part in zip(grads, grads_j):
                whole[j].copy_(part)
        return tuple(grads)  # type: ignore[return-value]

    def _check_segments(self) -> None:
        if not self.supports_varlen:
            raise ValueError(f"this {self.name!r} kernel (flash={self.flash}) takes no segments: only the flash op "
                             "of a torch whose varlen lse is [heads, total] does (supports_varlen)")
