"""A CPU double of torch's two cuDNN attention ops, so CI runs ring_sp's ``cudnn`` backend.

``aten._scaled_dot_product_cudnn_attention`` and ``..._backward`` exist only in CUDA builds
with cuDNN. :class:`CudnnOps` computes what they compute, in float32 from the definition (the
attention math of flash_attn_double's ``_Problem``: no ring_sp code), behind their argument
names, return tuples and layouts, and it keeps the hazards ring_sp must steer around, each
read from torch's aten/src/ATen/native/cudnn/MHA.cpp, transformers/cuda/sdp_utils.cpp and
cudnn-frontend's issues (the ``cudnn`` module's docstring cites them):

* inputs ``[b, h, s, d]`` views of dense ``[b, s, h, d]`` storage (the unpacked layout of
  ``check_cudnn_layout``), float16/bfloat16, head sizes multiples of 8 and <= 128 (an sm90 card
  with cuDNN 9.19, as :data:`ENVIRONMENT` says), GQA native, ``d_v`` free, no mask tensor, no
  dropout, key length 1 refused;
* causal masks top-left aligned (query i sees keys j <= i, whatever the lengths);
* forward: out in q's layout order and dtype, lse ``[b, h, s, 1]`` float32 only with
  ``compute_log_sumexp=True``;
* backward: ``same_strides(out, grad_out)`` asserted (torch issue 176915); the lse read as packed
  ``[b, h, s, 1]`` from its storage whatever its strides (cuDNN < 9.26, cudnn-frontend PR 304);
  the graph cached by q/k/v's shapes and strides only, so a later call reads out, grad_out and
  the lse with the strides of the call that built it; ``exp(0 - lse)`` on a tile tail where
  lse < -ln(FLT_MAX): NaN in dq rows for a key tail (cudnn-frontend PR 628), in all of dk/dv for a
  query tail (issue 1072); grads in the input dtype, dk/dv summed over each GQA group in float32.

Not modelled: the non-determinism of the backward, and cuDNN's own bf16 rounding of P and dS
inside its GEMMs (the double is slightly more accurate than the real kernel, never less).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flash_attn_double import _Problem

ENVIRONMENT = ((9, 0), 91900)  # (compute capability, cuDNN version) the double stands for: an H200, cuDNN 9.19
TILE = 128  # the rows of the sm90 backward's KV / query tiles (CudnnOps' default)
_OVERFLOW = math.log(torch.finfo(torch.float32).max)  # exp(x) is inf in fp32 beyond this (88.72)
_HALF = (torch.float16, torch.bfloat16)


def _check(condition: bool, message: str) -> None:
    """torch's TORCH_CHECK (a RuntimeError)."""
    if not condition:
        raise RuntimeError(message)


def _bshd(x: torch.Tensor, name: str) -> torch.Tensor:
    """A ``[b, h, s, d]`` argument as ``[b, s, h, d]``, checked to be dense in that order."""
    _check(x.dim() == 4, f"{name} must be 4-D [b, h, s, d]; got {tuple(x.shape)}")
    _check(x.transpose(1, 2).is_contiguous(),
           f"{name} tensor was not in cuDNN-supported unpacked QKV layout {x.stride()}")
    return x.transpose(1, 2)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: object, dropout_p: float) -> None:
    _check(q.dtype in _HALF and k.dtype == q.dtype and v.dtype == q.dtype,
           f"cuDNN attention takes float16/bfloat16 q, k, v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    _check(attn_bias is None, "the cuDNN double models no mask tensor (ring_sp never passes one)")
    if dropout_p:
        raise NotImplementedError("the cuDNN double does not model dropout")
    b, h, _, d = q.shape
    _check(k.shape[0] == b and v.shape[0] == b and k.shape[3] == d and k.shape[:3] == v.shape[:3],
           f"q, k, v shapes do not match: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _check(h % k.shape[1] == 0, f"query heads {h} must be a multiple of key/value heads {k.shape[1]}")
    _check(k.shape[2] != 1, "cudnn SDPA does not support key/value sequence length 1")
    for size in (d, v.shape[3]):
        _check(size % 8 == 0 and size <= 128, f"head_dim should be a multiple of 8 and no more than 128; got {size}")


def _like_q(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[b, s, h, d]`` values as the op hands them back: ``[b, h, s, d]`` laid out like q (dense bshd)."""
    return x.to(dtype).contiguous().transpose(1, 2)


def _packed(x: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
    """What a kernel reads for ``x`` when it addresses x's storage with ``strides``."""
    return torch.as_strided(x, shape, strides, x.storage_offset())


class CudnnOps:
    """Stands in for ``torch.ops.aten`` in ring_sp.kernels.cudnn: the two cuDNN ops are the
    double, every other op is torch's. ``calls`` counts the double's forward and backward calls;
    ``graphs`` is the backward's graph cache (MHA.cpp's mhagraphbackwardcache); ``tile``: the
    backward's tile rows (a smaller one lets small test problems have whole tiles)."""

    def __init__(self, tile: int = TILE) -> None:
        self.tile = tile
        self.calls = {"forward": 0, "backward": 0}
        self.graphs: dict[tuple, tuple[tuple[int, ...], ...]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.ops.aten, name)

    def _scaled_dot_product_cudnn_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias: torch.Tensor | None,
        compute_log_sumexp: bool, dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False,
        *, scale: float | None = None,
    ) -> tuple[Any, ...]:
        self.calls["forward"] += 1
        _check_inputs(query, key, value, attn_bias, dropout_p)
        q, k, v = _bshd(query, "Query"), _bshd(key, "Key"), _bshd(value, "Value")
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out, lse = _Problem(q, k, v, scale, is_causal, -1, -1, 0.0, None, top_left=True).forward(q.dtype)
        lse = lse.unsqueeze(-1).contiguous() if compute_log_sumexp else torch.empty(0)
        empty = torch.empty((), dtype=torch.long)
        return _like_q(out, q.dtype), lse, None, None, q.shape[1], k.shape[1], empty, empty.clone(), None

    def _scaled_dot_product_cudnn_attention_backward(
        self, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        out: torch.Tensor, logsumexp: torch.Tensor, philox_seed: torch.Tensor, philox_offset: torch.Tensor,
        attn_bias: torch.Tensor | None, cum_seq_q: torch.Tensor | None, cum_seq_k: torch.Tensor | None, max_q: int,
        max_k: int, dropout_p: float, is_causal: bool, *, scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls["backward"] += 1
        _check_inputs(query, key, value, attn_bias, dropout_p)
        _check(cum_seq_q is None and cum_seq_k is None, "the cuDNN double models the dense (not ragged) ops only")
        _check(out.dtype == query.dtype and grad_out.dtype == query.dtype, "out and grad_out must have q's dtype")
        _check(out.shape == grad_out.shape, f"out {tuple(out.shape)} and grad_out {tuple(grad_out.shape)} differ")
        _check(_same_strides(out, grad_out),
               "same_strides(o, dO_) INTERNAL ASSERT FAILED: cuDNN SDPA expected grad_output.strides() == "
               "output.strides()")
        _check(logsumexp.dtype == torch.float32, f"logsumexp is read as float32; got {logsumexp.dtype}")
        b, h, sq, _ = query.shape
        _check(logsumexp.numel() == b * h * sq, f"logsumexp must hold [b, h, s_q, 1] = {(b, h, sq, 1)} values")
        key_ = (tuple(query.shape), query.stride(), tuple(key.shape), key.stride(), tuple(value.shape), value.stride(),
                is_causal)
        strides = self.graphs.setdefault(key_, (out.stride(), grad_out.stride()))  # built by the first call
        out, grad_out = (_packed(x, tuple(x.shape), s) for x, s in zip((out, grad_out), strides))
        lse = _packed(logsumexp, (b, h, sq), (h * sq, sq, 1))  # packed BHSD, whatever its strides
        q, k, v = _bshd(query, "Query"), _bshd(key, "Key"), _bshd(value, "Value")
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        problem = _Problem(q, k, v, scale, is_causal, -1, -1, 0.0, None, top_left=True)
        dq, dk, dv, _ = problem.backward(grad_out.transpose(1, 2), out.transpose(1, 2), lse)
        overflow = lse < -_OVERFLOW  # exp(0 - lse) of a tail entry is inf, times a zero operand: NaN
        if k.shape[1] % self.tile and overflow.any():
            dq = dq.masked_fill(overflow.transpose(1, 2).unsqueeze(-1), math.nan)
        if q.shape[1] % self.tile and overflow.any():
            dk, dv = torch.full_like(dk, math.nan), torch.full_like(dv, math.nan)
        group = problem.group
        dk, dv = (x.unflatten(2, (x.shape[2] // group, group)).sum(3) for x in (dk, dv))  # fp32 sums over GQA groups
        return _like_q(dq, q.dtype), _like_q(dk, q.dtype), _like_q(dv, q.dtype)


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    """MHA.cpp's same_strides: the strides of the dimensions larger than 1, in order."""
    return [s for s, n in zip(a.stride(), a.shape) if n > 1] == [s for s, n in zip(b.stride(), b.shape) if n > 1]


@contextlib.contextmanager
def installed(tile: int = TILE) -> Iterator[CudnnOps]:
    """ring_sp's cudnn backend on the double, and its hardware gate open for CPU tensors
    (:data:`ENVIRONMENT`); everything restored on exit. Works in any process (pool ranks too).
    ``tile``: the double's tile rows, and ring_sp's ``cudnn.TILE`` with it (scaled down, small
    problems get blocks of both kinds: whole tiles on the double, the rest on the tail kernel)."""
    from ring_sp.kernels import cudnn as backend

    ops = CudnnOps(tile)
    saved = backend._aten, backend._environment, backend.TILE
    backend._aten, backend._environment, backend.TILE = ops, lambda device: ENVIRONMENT, tile  # the op, the GPU
    try:
        yield ops
    finally:
        backend._aten, backend._environment, backend.TILE = saved


def run_installed(tile: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, dict[str, int]]:
    """``fn(*args, **kwargs)`` with the double installed with ``tile`` (a pool case function):
    its result and the double's call counts."""
    with installed(tile) as ops:
        return fn(*args, **kwargs), dict(ops.calls)
