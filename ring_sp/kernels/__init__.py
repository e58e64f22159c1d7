"""Local attention backends and the choice between them.

Backends (all follow :mod:`ring_sp.kernels.base`):

``"torch"``      PyTorch's fused ops: the CPU flash op on CPU; on CUDA the flash op
                 (fp16/bf16) or the memory-efficient op (fp32).
``"flash_attn"`` the optional flash-attn 2/3 package (CUDA only, imported lazily).
``"reference"``  plain PyTorch math with explicit masks: the test oracle.
``"auto"``       the fastest available for the tensors' device, dtype and head sizes:
                 CUDA: flash_attn if installed and it supports the dtype/head_dim, else
                 torch; on CUDA float64 (no fused op exists) reference; CPU: torch, or
                 reference when the value head size differs from q/k's (MLA: the CPU
                 op needs equal head sizes).

An explicit backend that cannot run is an error that says why, never a fallback.
"""

from __future__ import annotations

import torch

from ..shapes import softmax_stat_dtype
from ..validation import BACKENDS
from . import flash_attn, torch_cpu, torch_cuda
from .base import AttentionKernel
from .flash_attn import FlashAttnKernel
from .reference import ReferenceKernel
from .torch_cpu import TorchCPUKernel

__all__ = ["AttentionKernel", "BACKENDS", "get_kernel", "softmax_stat_dtype", "unavailable_reason"]


def unavailable_reason(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                       value_head_dim: int | None = None) -> str | None:
    """Why ``backend`` cannot run tensors of this device/dtype/head_dim, or None if it can.
    ``value_head_dim``: v's head size when it differs from q/k's (None = the same)."""
    d_v = head_dim if value_head_dim is None else value_head_dim
    if backend == "reference":
        return None
    if backend == "torch":
        if device.type == "cpu":
            return torch_cpu.unavailable_reason(head_dim, d_v)
        if device.type == "cuda":
            return torch_cuda.unavailable_reason(dtype, head_dim, d_v)
        return f"backend='torch' has no fused attention op with logsumexp for device type {device.type!r}"
    if backend == "flash_attn":
        return flash_attn.unavailable_reason(dtype, head_dim, d_v, device)
    raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")


def _auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int | None) -> str:
    candidates = {"cuda": ("flash_attn", "torch"), "cpu": ("torch",)}.get(device.type, ())
    for candidate in candidates:
        if unavailable_reason(candidate, device, dtype, head_dim, value_head_dim) is None:
            return candidate
    return "reference"  # e.g. float64 on CUDA, MLA head sizes on CPU: no fused kernel exists


def get_kernel(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
               value_head_dim: int | None = None) -> AttentionKernel:
    """Return the kernel object for ``backend`` ("auto" resolved for device/dtype/head sizes;
    ``value_head_dim``: v's head size, None = ``head_dim``).

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` (with the reason) for a
    known backend that cannot run here.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    name = _auto_backend(device, dtype, head_dim, value_head_dim) if backend == "auto" else backend
    reason = unavailable_reason(name, device, dtype, head_dim, value_head_dim)
    if reason is not None:
        raise RuntimeError(f"backend={name!r} is unavailable: {reason}. Use backend='auto' or 'reference'.")
    if name == "reference":
        return ReferenceKernel()
    if name == "torch":
        return _torch_kernel(device, dtype, head_dim, value_head_dim if value_head_dim is not None else head_dim)
    return FlashAttnKernel()


def _torch_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int) -> AttentionKernel:
    """backend="torch": the CPU op on CPU, on CUDA the op that runs these tensors (fixed now, so the
    schedule knows what it takes). tests/torch_flash_double.py routes CPU tensors to the CUDA kernel."""
    if device.type == "cpu":
        return TorchCPUKernel()
    return torch_cuda.kernel_for(device, dtype, head_dim, value_head_dim)
