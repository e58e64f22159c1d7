"""Local attention backends and the choice between them.

Backends (all follow :mod:`ring_sp.kernels.base`):

``"torch"``      PyTorch's fused ops: the CPU flash op on CPU; on CUDA the flash op
                 (fp16/bf16) or the memory-efficient op (fp32).
``"cudnn"``      cuDNN's fused attention through torch's aten ops (CUDA only; blocks whose
                 lengths are not multiples of 128 run on torch's op, see :mod:`.cudnn`).
``"flash_attn"`` the optional flash-attn 2/3 package (CUDA only, imported lazily).
``"reference"``  plain PyTorch math with explicit masks: the test oracle.
``"auto"``       the first backend of :data:`AUTO_ORDER` that can run the tensors' device,
                 dtype and head sizes, else reference (float64 on CUDA; MLA head sizes on
                 CPU, whose op needs equal head sizes).

An explicit backend that cannot run is an error that says why, never a fallback. Where the
torch backend (or cudnn's tail blocks) will run torch's flash op on CUDA, :func:`get_kernel`
makes that op FlashAttention-4 when flash-attn-4 is installed (:mod:`.fa4`).
"""

from __future__ import annotations

import torch

from ..shapes import softmax_stat_dtype
from ..validation import BACKENDS
from . import cudnn, fa4, flash_attn, torch_cpu, torch_cuda
from .base import AttentionKernel
from .cudnn import CudnnKernel
from .flash_attn import FlashAttnKernel
from .reference import ReferenceKernel
from .torch_cpu import TorchCPUKernel

__all__ = ["AUTO_ORDER", "AttentionKernel", "BACKENDS", "get_kernel", "softmax_stat_dtype", "unavailable_reason"]

# backend="auto": the backends tried, in order, per (device type, CUDA compute-capability major;
# None = any other); the first that can run wins. MEASURED, not assumed (benchmarks/gpu_check's
# per-backend forward/backward rates re-measure it on each card; cite that record here):
# - sm90, cudnn before torch: H200, torch 2.11 + cuDNN 9.19, bf16, 32K tokens (shared/gpu/README.md
#   item 5, torch.profiler): cuDNN backward 88.5 ms vs the torch backend's FlashAttention-2 156 ms,
#   forward 54 vs 52 ms. flash_attn (FA2/FA3 package) against cudnn: not yet measured (no flash-attn there).
# - sm10x: cudnn first as torch's own SDPA priority (sdp_utils.cpp, check_prefer_cudnn_attention); not measured here.
# - other CUDA GPUs: torch's priority (flash before cuDNN); not measured here.
AUTO_ORDER: dict[tuple[str, int | None], tuple[str, ...]] = {
    ("cuda", 9): ("cudnn", "flash_attn", "torch"),
    ("cuda", 10): ("cudnn", "flash_attn", "torch"),
    ("cuda", None): ("flash_attn", "torch", "cudnn"),
    ("cpu", None): ("torch",),
}


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
    if backend == "cudnn":  # its tail blocks run on the torch backend's kernel
        return (cudnn.unavailable_reason(dtype, head_dim, d_v, device)
                or unavailable_reason("torch", device, dtype, head_dim, d_v))
    raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")


def _auto_backend(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int | None) -> str:
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" and torch.cuda.is_available() else None
    candidates = AUTO_ORDER.get((device.type, major), AUTO_ORDER.get((device.type, None), ()))
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
    d_v = head_dim if value_head_dim is None else value_head_dim
    name = _auto_backend(device, dtype, head_dim, value_head_dim) if backend == "auto" else backend
    reason = unavailable_reason(name, device, dtype, head_dim, value_head_dim)
    if reason is not None:
        raise RuntimeError(f"backend={name!r} is unavailable: {reason}. Use backend='auto' or 'reference'.")
    if name in ("torch", "cudnn") and device.type == "cuda":  # the one place FA4 is switched on (see .fa4)
        fa4.activate_if_available(device, dtype, head_dim, d_v)
    if name == "reference":
        return ReferenceKernel()
    if name == "torch":
        return _torch_kernel(device, dtype, head_dim, d_v)
    if name == "cudnn":
        return CudnnKernel(tail=_torch_kernel(device, dtype, head_dim, d_v))
    return FlashAttnKernel()


def _torch_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int) -> AttentionKernel:
    """backend="torch": the CPU op on CPU, on CUDA the op that runs these tensors (fixed now, so the
    schedule knows what it takes). tests/torch_flash_double.py routes CPU tensors to the CUDA kernel."""
    if device.type == "cpu":
        return TorchCPUKernel()
    return torch_cuda.kernel_for(device, dtype, head_dim, value_head_dim)
