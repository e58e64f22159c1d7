"""FlashAttention-4 (``flash-attn-4``, CuTe DSL) behind torch's flash op.

torch's ``torch.nn.attention`` keeps a registry of flash implementations (PyTorch PR 167348,
Nov 2025, so from torch 2.10 on; checked here on torch 2.13, where it lists "FA3" and "FA4"):
``activate_flash_attention_impl("FA4")`` imports ``flash_attn.cute.interface`` and registers
Python kernels over ``aten::_scaled_dot_product_flash_attention`` and its backward (and the
``_flash_attention_*`` ops) for the WHOLE process, until ``restore_flash_attention_impl()``.
Those are the ops the ``torch`` backend calls on CUDA (and the ``cudnn`` backend's tail
blocks), so activating FA4 makes them FA4 with nothing else changed: FA4 takes the GLOBAL
out/lse in its backward (``_flash_attn_bwd(q, k, v, out, dout, lse)``), returns lse
``[b, h, s]`` float32, takes ``h_kv`` KV heads natively and aligns causal masks bottom-right
(= top-left on the ring's square blocks).

What it needs (torch's ``torch/nn/attention/_fa4.py``, flash-attn-4's ``flash_attn/cute/interface.py``):

* torch with the registry and "FA4" in ``list_flash_attention_impls()`` (feature-tested, not
  version-tested: 2.10-2.12 were not checked here; older releases have no registry);
* the ``flash-attn-4`` distribution below 4.0.0b19: from b19 ``_flash_attn_fwd`` returns 4
  values (5 by b36) and torch's glue unpacks 2 (``out, lse = ...``; PyTorch issue 190212), so
  every activated call would fail; b3-b18 return (out, lse) and take every argument torch's
  2.13 glue passes;
* compute capability 9.x or 10.x (the glue refuses the rest), float16/bfloat16, one head size
  for q, k and v (torch's flash op), 8-256 and a multiple of 8 on sm90, <= 128 or 256 on sm10x.

ring_sp activates it in ONE place, where a kernel is chosen (:func:`ring_sp.kernels.get_kernel`),
only when the tensors at hand are ones FA4 takes, only when no other implementation is active
(a user's ``activate_flash_attention_impl`` choice is kept), and never with ``RING_SP_FA4=0``.
Nothing happens at import. Because the switch is process-wide, the model's own SDPA flash
calls go through FA4 too, and FA4 refuses what it cannot run (dropout, other GPUs) with a
RuntimeError instead of falling back: ``RING_SP_FA4=0`` keeps torch's FlashAttention-2.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.attention as sdpa_attention

ENV_FLAG = "RING_SP_FA4"  # "0"/"off"/"false": never activate FA4
DISTRIBUTION = "flash-attn-4"
_FIRST_INCOMPATIBLE = (4, 0, 0, 19)  # 4.0.0b19: _flash_attn_fwd returns more than (out, lse)
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Registry:
    """torch's flash-implementation registry, or None where this torch has none."""

    listed: Callable[[], list[str]]
    current: Callable[[], str | None]
    activate: Callable[[str], None]

    @staticmethod
    def of_torch() -> Registry | None:
        names = ("list_flash_attention_impls", "current_flash_attention_impl", "activate_flash_attention_impl")
        if not all(hasattr(sdpa_attention, n) for n in names):
            return None
        return Registry(*(getattr(sdpa_attention, n) for n in names))


@functools.lru_cache(maxsize=None)
def installed_version() -> str | None:
    """The installed flash-attn-4's version (package metadata: nothing is imported), or None;
    read once (kernels are chosen per attention call)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int, int, int] | None:
    """'4.0.0b17' -> (4, 0, 0, 17); a final release sorts after its betas; None if unparsable."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:b(\d+))?(?:[.+].*)?", version)
    if match is None:
        return None
    major, minor, patch, beta = match.groups()
    return int(major), int(minor), int(patch), int(beta) if beta is not None else 10**9


def unavailable_reason(registry: Registry | None, version: str | None, capability: tuple[int, int],
                       dtype: torch.dtype, head_dim: int, value_head_dim: int) -> str | None:
    """Why torch's flash op cannot be FA4 for these tensors, or None (pure: every fact is an argument)."""
    if registry is None:
        return f"torch {torch.__version__} has no flash-implementation registry (torch.nn.attention)"
    if "FA4" not in registry.listed():
        return f"torch {torch.__version__} lists no FA4 implementation ({registry.listed()})"
    if version is None:
        return f"{DISTRIBUTION} is not installed"
    release = _release(version)
    if release is None or release >= _FIRST_INCOMPATIBLE:
        return (f"{DISTRIBUTION} {version}: from 4.0.0b19 its _flash_attn_fwd returns more than (out, lse), which "
                f"torch's FA4 glue unpacks as two (PyTorch issue 190212); install {DISTRIBUTION}<4.0.0b19")
    major, minor = capability
    if major not in (9, 10):
        return f"torch's FA4 glue runs on compute capability 9.x or 10.x; this GPU is sm{major}{minor}"
    if dtype not in _HALF:
        return f"FA4 takes float16 or bfloat16, not {dtype}"
    if value_head_dim != head_dim:
        return f"torch's flash op needs one head size for q, k and v; got {head_dim} and {value_head_dim}"
    fits = head_dim <= 256 if major == 9 else (head_dim <= 128 or head_dim == 256)
    if head_dim % 8 or not fits:
        sizes = "<= 256" if major == 9 else "<= 128 or 256"
        return f"FA4 on sm{major}x takes head_dim a multiple of 8, {sizes}; got {head_dim}"
    return None


def _opted_out() -> bool:
    return os.environ.get(ENV_FLAG, "").strip().lower() in ("0", "off", "false", "no")


def activate_if_available(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int) -> str | None:
    """Make torch's flash op FA4 for this process if FA4 can run these tensors, nothing else is
    active and ``RING_SP_FA4`` does not opt out. Returns the active implementation's name
    ("FA4", a user's choice, or None for torch's own FlashAttention-2). Raises RuntimeError if
    an installed FA4 cannot be activated (``RING_SP_FA4=0`` runs without it)."""
    registry = Registry.of_torch()
    current = registry.current() if registry is not None else None
    if current is not None or _opted_out():
        return current
    capability = torch.cuda.get_device_capability(device)
    if unavailable_reason(registry, installed_version(), capability, dtype, head_dim, value_head_dim) is not None:
        return None
    assert registry is not None  # unavailable_reason said why otherwise
    try:
        registry.activate("FA4")
    except Exception as exc:  # the import of flash_attn.cute and its CuTe DSL, or torch's registration
        raise RuntimeError(f"{DISTRIBUTION} {installed_version()} is installed but torch could not activate it "
                           f"({type(exc).__name__}: {exc}); set {ENV_FLAG}=0 to run without it") from exc
    return registry.current()
