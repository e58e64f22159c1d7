"""cuDNN's fused attention through PyTorch's aten ops (the ``"cudnn"`` backend, CUDA only).

``aten._scaled_dot_product_cudnn_attention`` returns the logsumexp and
``_scaled_dot_product_cudnn_attention_backward`` takes any ``out``/``logsumexp``: the
global-statistics backward the ring needs (torch's own context parallelism calls the same pair).
On an H200 its backward ran 1.77x faster than the FlashAttention-2 one of the ``torch``
backend (shared/gpu/README.md: 88.5 vs 156 ms at 32K tokens; forward 54 vs 52 ms).

What the ops need, and what this module does about it (torch's aten/src/ATen/native/cudnn/MHA.cpp
and transformers/cuda/sdp_utils.cpp, cudnn-frontend's issues):

* ``[b, h, s, d]`` in, ``[b, h, s, d]`` out laid out like q; the lse is ``[b, h, s, 1]`` float32,
  natural log (the op returns it with ``compute_log_sumexp=True``); causal masks are top-left
  aligned, which equals bottom-right on the square blocks the ring issues; GQA is native (k/v
  keep ``h_kv`` heads, dk/dv come back with ``h_kv``); ``d_v`` may differ from ``d``.
* Inputs must be contiguous: every tensor goes in as a view of dense ``[b, s, h, d]`` storage
  (a copy only when a block is not, e.g. a sequence slice of a batch > 1).
* The backward's graph is cached by the shapes and strides of q, k, v ONLY, yet built with the
  strides of out, grad_out and the lse: a later call with other strides for those would run a
  graph that reads them wrongly. And grad_out must have out's strides (torch issue 176915:
  ``same_strides(o, dO)`` asserts), and cuDNN < 9.26 reads the lse as packed BHSD whatever its
  strides (cudnn-frontend PR 304). So out and grad_out always go in dense ``[b, s, h, d_v]`` and
  the lse dense ``[b, h, s, 1]``: one layout per shape, every call.
* No mask tensor is ever passed (``attn_bias=None``): the NaN of torch issue 196678 (an explicit
  mask, ``s % 128 == 64``) cannot occur.
* Very negative lse (H200, cudnn-frontend PR 628 and issue 1072, torch issue 196678): the sm90
  backward evaluates ``exp(s - lse)`` on the zero-filled tail of its last 128-row tile too, where
  ``s = 0``; for a row whose lse < -ln(FLT_MAX) = -88.7 that is inf, and inf * 0 = NaN in dq
  (KV tail, cuDNN < 9.26) or dk/dv (query tail, still open on 9.26). The ring feeds each block
  the GLOBAL lse, which is >= every score of the row in every block, so a far block does not
  make it smaller; it is below -88.7 only when all of a row's logits are (real: Qwen2.5's
  "massive activation" heads, huggingface/trl issue 7181). The guard is exact and needs no look
  at the values: a block runs on cuDNN only when both its lengths are multiples of 128
  (:data:`TILE`), so no tile has a tail and every ``exp(s - lse)`` cuDNN evaluates is of a real
  score (<= 1) or a masked one (0). Other blocks (short ones, window bands, document pieces,
  ragged shard ends) run on ``tail``, torch's fused kernel for the device, with the same
  contract. cuDNN's other tail troubles (key length 1 unsupported; torch 2.10 turning cuDNN off
  for query lengths not divisible by 128, torch issue 169849) fall under the same rule.
* The backward is non-deterministic (torch's SDPA never picks cuDNN under
  ``torch.use_deterministic_algorithms(True)``): so here too, unless ``warn_only=True``.
* Head sizes: multiples of 8, both <= 128 on sm80-sm121; beyond that only where torch's newest
  rule lets cuDNN train them (sm90/sm10x, cuDNN > 9.22: (192, 128) and (256, 256)). Older torch
  allowed up to 256 on sm90 from cuDNN 9.10 but then narrowed the backward to these shapes.
* The op's arguments changed between torch releases, so they are passed by name, checked
  against this torch's schema once (:func:`schema_reason`); a torch whose forward has no
  ``compute_log_sumexp`` is refused (the ring needs the lse of every block).

CPU tests run this module through ``tests/cudnn_double.py`` (a double of the two ops' contract,
the hazards above included); ``tests/test_kernels_cuda.py`` runs it on a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .base import AttentionKernel, FusedKernel

_aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
TILE = 128  # a block runs on cuDNN only when both its lengths are multiples of this (module docstring)
_MIN_CUDNN = 90000  # torch builds cuDNN attention only against cuDNN >= 9.0

# What the ring passes, by argument name (any release's order); see _call.
_FIXED = dict(attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, return_debug_mask=False, cum_seq_q=None,
              cum_seq_k=None)
_FORWARD_NEEDS = {"query", "key", "value", "compute_log_sumexp", "is_causal", "scale"}
_BACKWARD_NEEDS = {"grad_out", "query", "key", "value", "out", "logsumexp", "is_causal", "scale"}
_BACKWARD_SETS = _BACKWARD_NEEDS | set(_FIXED) | {"philox_seed", "philox_offset", "max_q", "max_k"}


@functools.lru_cache(maxsize=None)
def _arguments(name: str) -> dict[str, bool]:
    """This torch's ``aten::name`` arguments: name -> has a default (read once: every block call uses them)."""
    schema = getattr(torch.ops.aten, name).default._schema
    return {a.name: a.has_default_value() for a in schema.arguments}


@functools.lru_cache(maxsize=None)
def schema_reason() -> str | None:
    """Why this torch's cuDNN attention ops cannot be called as the ring calls them, or None."""
    try:
        forward = _arguments("_scaled_dot_product_cudnn_attention")
        backward = _arguments("_scaled_dot_product_cudnn_attention_backward")
    except (AttributeError, RuntimeError) as exc:
        return f"this PyTorch {torch.__version__} has no cuDNN attention ops ({exc})"
    for op, args, needs, sets in (("", forward, _FORWARD_NEEDS, _FORWARD_NEEDS | set(_FIXED)),
                                  ("_backward", backward, _BACKWARD_NEEDS, _BACKWARD_SETS)):
        missing = sorted(needs - set(args))
        unknown = sorted(name for name, has_default in args.items() if name not in sets and not has_default)
        if missing or unknown:
            return (f"torch {torch.__version__}'s aten::_scaled_dot_product_cudnn_attention{op} lacks {missing} "
                    f"or takes arguments ring_sp does not know {unknown} (the ring needs the forward's lse: "
                    f"compute_log_sumexp=True)")
    return None


def _environment(device: torch.device | None) -> tuple[tuple[int, int], int] | str:
    """(compute capability, cuDNN version) of ``device`` (None: the current GPU), or why cuDNN
    attention cannot run there: the one hardware gate (tests/cudnn_double.py replaces only it)."""
    if device is not None and device.type != "cuda":
        return f"backend='cudnn' needs CUDA tensors; got device {device}"
    if torch.version.hip:
        return "ROCm builds of PyTorch have no cuDNN attention"
    if not torch.cuda.is_available():
        return "CUDA is not available here (torch.cuda.is_available() is False)"
    if not torch.backends.cudnn.is_available():
        return "this PyTorch build has no cuDNN"
    version = torch.backends.cudnn.version() or 0
    if version < _MIN_CUDNN:
        return f"cuDNN attention needs cuDNN >= 9.0; this PyTorch runs cuDNN {version}"
    return torch.cuda.get_device_capability(device), version


def _switch_reason() -> str | None:
    """The process-wide switches that turn cuDNN attention off, or None."""
    if not torch.backends.cudnn.enabled:
        return "cuDNN is disabled (torch.backends.cudnn.enabled is False)"
    if not getattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)():
        return "cuDNN attention is disabled (torch.backends.cuda.enable_cudnn_sdp(False))"
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return ("cuDNN's attention backward is non-deterministic and torch.use_deterministic_algorithms(True) is "
                "set (torch's own SDPA skips cuDNN then too); use another backend, or warn_only=True")
    return None


def head_size_reason(head_dim: int, value_head_dim: int, capability: tuple[int, int], cudnn_version: int) -> str | None:
    """Why cuDNN cannot train these head sizes on this GPU, or None (rules: module docstring)."""
    for name, size in (("head_dim", head_dim), ("value head_dim", value_head_dim)):
        if size <= 0 or size % 8:
            return f"cuDNN attention needs {name} a positive multiple of 8; got {size}"
    if head_dim <= 128 and value_head_dim <= 128:
        return None
    major, minor = capability
    large = ((major == 9 and minor == 0) or major == 10) and cudnn_version > 92200
    if large and (head_dim, value_head_dim) in ((192, 128), (256, 256)):
        return None
    return (f"cuDNN attention trains head sizes <= 128, or (192, 128) and (256, 256) on sm90/sm10x with cuDNN "
            f"> 9.22; got ({head_dim}, {value_head_dim}) on sm{major}{minor} with cuDNN {cudnn_version}")


def unavailable_reason(dtype: torch.dtype, head_dim: int, value_head_dim: int | None = None,
                       device: torch.device | None = None) -> str | None:
    """Why cuDNN attention cannot run ``dtype`` tensors of these head sizes on ``device``
    (None: the current GPU), or None. ``value_head_dim``: None = ``head_dim``."""
    env = _environment(device)
    if isinstance(env, str):
        return env
    capability, version = env
    reason = schema_reason() or _switch_reason()
    if reason is not None:
        return reason
    if dtype not in _HALF:
        return f"cuDNN attention takes float16 or bfloat16, not {dtype}"
    if not (8, 0) <= capability <= (12, 1):
        return f"cuDNN attention needs sm80-sm121; this GPU is sm{capability[0]}{capability[1]}"
    return head_size_reason(head_dim, head_dim if value_head_dim is None else value_head_dim, capability, version)


def on_cudnn(seq_q: int, seq_k: int) -> bool:
    """Whether a ``seq_q x seq_k`` block runs on cuDNN (no tile tail), else on the tail kernel."""
    return seq_q % TILE == 0 and seq_k % TILE == 0


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d]`` -> a ``[b, h, s, d]`` view of dense ``[b, s, h, d]`` storage (a copy if not
    dense), with the standard strides even on size-1 dimensions (a slice of a batch keeps its
    parent's there): one layout per shape, as the backward's graph cache needs."""
    x = x if x.is_contiguous() else x.contiguous()
    return x.view(-1).view(x.shape).transpose(1, 2)


def _call(name: str, values: dict[str, Any]) -> Any:
    """``aten::name`` with ``values`` by argument name; only the names this torch's op has
    (schema_reason has checked that every argument without a default is among them)."""
    return getattr(_aten, name)(**{n: values[n] for n in _arguments(name) if n in values})


def _no_dropout_rng() -> tuple[torch.Tensor, torch.Tensor]:
    """philox_seed/offset: read by the backward only when dropout_p > 0 (never here)."""
    return torch.empty((), dtype=torch.long), torch.empty((), dtype=torch.long)


class CudnnKernel(FusedKernel):
    """cuDNN attention on plain blocks (full, or square causal) whose lengths are multiples of
    :data:`TILE`; ``tail`` (torch's fused kernel for the device) on every other block, and on
    what only ``tail`` takes: bands (window arguments, ``supports_window``) and many blocks of a
    step as one varlen call (``supports_varlen``), so windows and packed documents keep one call
    per step (:mod:`ring_sp.schedule.calls`) while whole-shard blocks run on cuDNN."""

    name = "cudnn"

    def __init__(self, tail: AttentionKernel) -> None:
        self.tail = tail

    @property
    def supports_window(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.tail, "supports_window", False))

    @property
    def supports_varlen(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.tail, "supports_varlen", False))

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 window: int | None = None, diagonal: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if window is not None or diagonal or not on_cudnn(q.shape[1], k.shape[1]):
            return self.tail.forward(q, k, v, causal=causal, scale=scale, window=window, diagonal=diagonal)
        out, lse = _call("_scaled_dot_product_cudnn_attention",
                         dict(_FIXED, query=_dense(q), key=_dense(k), value=_dense(v), is_causal=causal,
                              scale=scale))[:2]
        return out.transpose(1, 2), lse[..., 0] if lse.dim() == 4 else lse

    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, window: int | None = None,
                  diagonal: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if window is not None or diagonal or not on_cudnn(q.shape[1], k.shape[1]):
            return self.tail.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window=window,
                                      diagonal=diagonal)
        seed, offset = _no_dropout_rng()
        grads = _call("_scaled_dot_product_cudnn_attention_backward", dict(
            _FIXED, grad_out=_dense(dout), query=_dense(q), key=_dense(k), value=_dense(v), out=_dense(out),
            logsumexp=lse.unsqueeze(-1), philox_seed=seed, philox_offset=offset, max_q=q.shape[1],
            max_k=k.shape[1], is_causal=causal, scale=scale,
        ))
        return tuple(g.transpose(1, 2) for g in grads)  # type: ignore[return-value]

    def forward_segments(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A varlen call: the tail's (cuDNN's ragged path is not used)."""
        return self.tail.forward_segments(*args, **kwargs)  # type: ignore[attr-defined]

    def backward_segments(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tail.backward_segments(*args, **kwargs)  # type: ignore[attr-defined]
