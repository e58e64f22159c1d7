"""The optional flash-attn 2/3 backend (CUDA only).

flash-attn cannot even be installed without CUDA, so nothing here imports it at module
import time: ``_interface`` imports it once, on first use. We call its low-level forward and
backward (not the autograd wrappers) because the ring's backward must take the GLOBAL
``out``/``lse``. flash-attn takes ``[b, s, h, d]`` and ``h_kv`` KV heads natively, returns lse
``[b, h, sq]`` fp32, and writes the backward into the dq/dk/dv buffers we pass (dk/dv with
``h_kv`` heads). Causal masks are bottom-right aligned (>= 2.1), which equals top-left for the
square blocks the contract allows.

Signatures of ``_flash_attn_forward`` / ``_flash_attn_backward`` by release:

=============  ==================================================================================
FA2 2.0-2.2    fwd(q, k, v, dropout_p, softmax_scale, causal, return_softmax)
               bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
               rng_state=None); 2.0 aligns causal masks top-left (same result on square blocks)
FA2 2.3        both + window_size=(left, right) after causal
FA2 2.4.0      both + alibi_slopes
FA2 2.4.1-2.5  bwd + deterministic
FA2 2.6        both + softcap
FA2 2.7-2.8    window_size -> window_size_left, window_size_right; torch custom ops
FA3 (hopper)   many optional inputs (k_new, qv, cu_seqlens_*, page_table, ...), no dropout/alibi;
               the bwd flag is ``causal`` or (newest) ``is_causal``
=============  ==================================================================================

The forward returns (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state) before FA2 2.7
and (out, softmax_lse, ...) from FA2 2.7 and in FA3. ``_forward`` and ``_backward`` below hold
every one of these differences. A row that sees no key would get lse = +inf (not our -inf); every
row of a block the ring issues sees a key (square blocks contain their diagonal, bands are
trimmed), so none occurs. Bands of any shape go in as bottom-right windows
(:func:`ring_sp.schedule.bottom_right_window`), which flash-attn aligns that way from 2.1 and
takes from 2.3. Every FA2 signature runs
on CPU through the double in tests/flash_attn_double.py.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..schedule.blocks import bottom_right_window
from .base import FusedKernel

_NOT_INSTALLED = "flash-attn is not installed: pip install 'ring-sp[flash]' on a CUDA machine"


@functools.lru_cache(maxsize=None)
def _interface() -> ModuleType | str:
    """flash-attn's low-level interface module, or why it cannot be imported (tried once)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        try:  # FA3 is built from hopper/ and runs on sm90 only
            import flash_attn_interface

            return flash_attn_interface
        except ImportError:
            pass
    try:
        from flash_attn import flash_attn_interface
    except ImportError as exc:
        if exc.name == "flash_attn":
            return _NOT_INSTALLED
        return f"flash-attn is installed but failed to import ({exc})"
    return flash_attn_interface


def unavailable_reason(dtype: torch.dtype, head_dim: int, value_head_dim: int | None = None,
                       device: torch.device | None = None) -> str | None:
    """Why flash-attn cannot run ``dtype``/``head_dim`` tensors on ``device`` (None: the current
    GPU), or None. ``value_head_dim`` (None = ``head_dim``): flash-attn 2's kernels take one head
    size for q, k and v; a different value head size (MLA) is refused here rather than padded."""
    interface = _interface()
    if isinstance(interface, str):
        return interface
    if value_head_dim is not None and value_head_dim != head_dim:
        return (f"flash-attn's low-level entry points need the value head size equal to the q/k head size; "
                f"got head_dim={head_dim}, value head_dim={value_head_dim} (MLA)")
    reason = _device_reason(device)
    if reason is not None:
        return reason
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn takes float16 or bfloat16, not {dtype}"
    if head_dim % 8 or not 0 < head_dim <= 256:
        # its low-level entry points require a multiple of 8 (only the autograd wrappers pad)
        return f"flash-attn needs head_dim a multiple of 8 and <= 256; got {head_dim}"
    return None


def _device_reason(device: torch.device | None) -> str | None:
    """Why flash-attn's kernels cannot run on ``device`` (None: the current GPU), or None: the
    one hardware gate (tests/flash_attn_double.py replaces only this to run its CPU double)."""
    if device is not None and device.type != "cuda":
        return f"backend='flash_attn' needs CUDA tensors; got device {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available here (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"flash-attn needs an Ampere (sm80) or newer GPU; this one is sm{major}{minor}"
    return None


def _module() -> ModuleType:
    interface = _interface()
    if isinstance(interface, str):
        raise RuntimeError(interface)
    return interface


# Arguments the ring never varies, under every name some release gives them (see the table).
_FIXED = dict(
    dropout_p=0.0, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None
)


@functools.lru_cache(maxsize=None)
def _params(fn: Callable[..., Any]) -> Any:
    # Once per entry point: inspect.signature costs more host time than a small block's kernel.
    # torch.library.custom_op (FA2 >= 2.7 on torch >= 2.4, newest FA3) keeps the Python function in _init_fn
    return inspect.signature(getattr(fn, "_init_fn", fn)).parameters


def _call(fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """Call a flash-attn entry point by parameter name. Names in ``values`` get that value;
    other parameters keep their default, or get None if they have none (FA3's optional inputs)."""
    params = _params(fn)
    return fn(**{name: values.get(name) for name, p in params.items() if name in values or p.default is p.empty})


def _has_window(fa: ModuleType) -> bool:
    """Whether this release takes a sliding window (FA2 >= 2.3 and FA3, forward and backward)."""
    return all({"window_size", "window_size_left"} & set(_params(fn)) for fn in (fa._flash_attn_forward, fa._flash_attn_backward))


def _window_values(q_len: int, k_len: int, causal: bool, window: int | None, diagonal: int = 0) -> dict[str, Any]:
    """flash-attn's causal flag and window arguments for a block: key c visible iff
    a + k_len - q_len - left <= c <= a + k_len - q_len + right (bottom-right aligned), -1 =
    unbounded. Ours: the band ``diagonal - window < c - a <= diagonal`` (``BlockTask``)."""
    if window is None and not diagonal:
        return dict(causal=causal, is_causal=causal)
    left, right = bottom_right_window(q_len, k_len, causal, window, diagonal)
    plain = (left, right) == (-1, 0)  # a causal mask flash-attn draws itself (it forces right = 0 when causal)
    return dict(causal=plain, is_causal=plain, window_size=(left, right), window_size_left=left,
                window_size_right=right)


def _forward(
    fa: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    window: int | None = None, diagonal: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[b, sq, h, d]``, lse ``[b, h, sq]``) from any supported flash-attn release."""
    res = _call(
        fa._flash_attn_forward,
        dict(_FIXED, q=q, k=k, v=v, softmax_scale=scale, return_softmax=False,
             **_window_values(q.shape[1], k.shape[1], causal, window, diagonal)),
    )
    return res[0], res[5] if len(res) == 8 else res[1]  # 8 items: FA2 < 2.7 (see the module docstring)


def _backward(
    fa: ModuleType,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    window: int | None = None,
    diagonal: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq/dk/dv from any supported flash-attn release (every one writes into buffers we pass)."""
    dq, dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))
    _call(
        fa._flash_attn_backward,
        dict(
            _FIXED, dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, softmax_scale=scale,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            **_window_values(q.shape[1], k.shape[1], causal, window, diagonal),
        ),
    )
    return dq, dk, dv


class FlashAttnKernel(FusedKernel):
    """flash-attn 2 (or 3 on Hopper) forward/backward with global-statistics backward."""

    name = "flash_attn"

    @property
    def supports_window(self) -> bool:  # type: ignore[override]
        """FA2 >= 2.3 and FA3 take ``window_size`` (so bands of any shape); older releases get the
        schedule's cut blocks."""
        return _has_window(_module())

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 window: int | None = None, diagonal: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(_module(), q, k, v, causal, scale, window, diagonal)

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, window: int | None = None,
                  diagonal: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward(_module(), dout, q, k, v, out, lse, causal, scale, window, diagonal)
