"""The contract every local attention kernel follows.

A kernel computes attention of one block of queries against one block of keys on ONE
device, and returns the softmax statistics the ring needs to merge blocks exactly.

Conventions (shared by every backend, so the ring loop never branches on the backend):

* Tensors are ``[batch, seq, heads, head_dim]`` ("bshd"). ``q`` has ``h`` heads,
  ``k``/``v`` have ``h_kv`` heads with ``h % h_kv == 0`` (GQA/MQA); a kernel expands KV
  heads internally if its op needs that, and returns ``dk``/``dv`` with ``h_kv`` heads.
  ``v`` may have its own head size ``d_v`` (MLA); ``out`` then has ``d_v``. A backend whose
  op needs ``d_v == d`` says so in its ``unavailable_reason``.
* ``lse`` is ``[batch, heads, seq_q]`` float32 (float64 for float64 inputs): the natural
  log of the sum of ``exp(scale * q.k)`` over the keys this call saw; ``-inf`` for a row
  that saw none.
* ``causal=True`` is only defined for square blocks (``seq_q == seq_k``); the ring only
  issues square masked blocks, so top-left and bottom-right alignment coincide and the
  kernels' different conventions cannot leak into results.
* ``window`` (sliding windows; square blocks only): query ``a`` sees key ``c`` only if
  ``c > a - window`` (and ``c <= a`` when causal). Kernels with ``supports_window`` take any
  window; the fused torch ops have no window argument and take only the edge block
  ``causal=False, window=1`` (``c >= a``), which they run as their causal mask on both
  sequences reversed (exact; O(block) copies, no mask tensor). The schedule cuts every
  other band into full, causal and edge blocks for them.
* ``diagonal`` (kernels with ``supports_window`` only): the mask is the band
  ``diagonal - window < c - a <= diagonal`` (either side absent without ``window`` /
  ``causal``) on a block of any shape, which a kernel with window arguments runs as ONE call
  (:func:`ring_sp.schedule.bottom_right_window` gives flash-attention's ``(left, right)``).
  Square blocks with ``diagonal=0`` are the blocks above.
* ``supports_varlen``: the kernel also takes many blocks of a step in one call,
  :meth:`forward_segments` / :meth:`backward_segments` over :class:`Segments` (segment ``i``:
  rows ``cu_q[i]:cu_q[i+1]`` of ``q`` against keys ``cu_k[i]:cu_k[i+1]``, one window,
  bottom-right aligned per segment; see :mod:`ring_sp.schedule.calls`), with the same
  contract for ``out``/``lse`` and the gradients over all the call's rows and keys (rows of a
  segment without keys: out 0, lse -inf; keys of a segment without queries: dk = dv = 0).
* ``head_major``: the op reads ``[b, h, s, d]``; a kernel with it set runs faster on
  ``[b, s, h, d]`` views of ``[b, h, s, d]`` storage (each head's rows dense) than on
  ``[b, s, h, d]`` storage, so the Ulysses all-to-all, which copies anyway, lays its outputs
  out that way for it (:func:`ring_sp.ulysses.head_from_recv`). Any strides stay valid input.
* ``backward`` receives the GLOBAL ``out`` and ``lse`` (after every block was merged),
  which is what makes the per-block gradients sum to the exact gradient.
* Partial results (``out``, ``dq``, ``dk``, ``dv``) come back in the inputs' dtype, or in
  float32 when a kernel computes bf16/fp16 blocks in float32; the ring accumulates in
  float32 (float64 for float64) either way and casts only its final result.
"""

from __future__ import annotations

import abc
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..shapes import softmax_stat_dtype


@runtime_checkable
class AttentionKernel(Protocol):
    """One local attention backend (see the module docstring for the contract)."""

    name: str
    supports_window: bool  # takes any ``window`` and ``diagonal`` (else only the edge block)
    head_major: bool  # runs faster when each head's rows are dense ([b, h, s, d] storage); see below

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
        window: int | None = None, diagonal: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[b, sq, h, d]``, k ``[b, sk, h_kv, d]``, v ``[b, sk, h_kv, d_v]`` -> out
        ``[b, sq, h, d_v]`` (q's dtype or float32) and lse ``[b, h, sq]`` (float32, float64
        for float64 inputs)."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        window: int | None = None,
        diagonal: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of this block given the global ``out`` ``[b, sq, h, d_v]`` and
        ``lse`` ``[b, h, sq]``: dq ``[b, sq, h, d]``, dk ``[b, sk, h_kv, d]``, dv ``[b, sk, h_kv, d_v]``."""
        ...


class Segments(NamedTuple):
    """One varlen call (see the module docstring): ``cu_q`` / ``cu_k`` int32 ``[segments + 1]``
    on the tensors' device, from 0; the longest segment in queries (at least 2: flash-attention
    takes another path for 1) and in keys; the bottom-right ``window`` ``(left, right)`` (-1:
    unbounded); ``fills_rows``: some segment has queries and no keys."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    window: tuple[int, int]
    fills_rows: bool


def check_block_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       window: int | None = None, diagonal: int = 0, bands: bool = False) -> None:
    """Shape contract shared by every backend; raises ``ValueError`` naming the argument.
    ``bands``: the kernel takes masked blocks of any shape and ``diagonal``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D [batch, seq, heads, head_dim]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree on batch, seq and heads; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must agree on batch and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]}) for GQA/MQA"
        )
    if bands:
        return
    if diagonal:
        raise ValueError(f"diagonal={diagonal} needs a kernel with window arguments (supports_window); "
                         f"the schedule issues it only to those")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal=True needs a square block (seq_q == seq_k) so that the mask alignment "
            f"cannot differ between kernels; got seq_q={q.shape[1]}, seq_k={k.shape[1]}"
        )
    if window is not None and q.shape[1] != k.shape[1]:
        raise ValueError(f"window={window} needs a square block (seq_q == seq_k); got seq_q={q.shape[1]}, seq_k={k.shape[1]}")


def empty_block_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[b, sq, h, d_v]``, lse) of a block with no keys: out 0, lse -inf. Some ops crash on empty inputs."""
    b, s, h, _ = q.shape
    out = torch.zeros((b, s, h, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=softmax_stat_dtype(q.dtype), device=q.device)
    return out, lse


class FusedKernel(abc.ABC):
    """Shared shell of the fused backends: the shape contract, empty blocks (which some
    ops cannot launch, the CPU one dies with SIGFPE) and a dense lse for the backward.
    Subclasses implement ``_forward`` and ``_backward`` on non-empty blocks (with ``window``
    and ``diagonal`` keywords when they take bands)."""

    name: str
    supports_window = False
    supports_varlen = False
    head_major = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
        window: int | None = None, diagonal: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[b, sq, h, d]``, k ``[b, sk, h_kv, d]``, v ``[b, sk, h_kv, d_v]`` -> out ``[b, sq, h, d_v]``,
        lse ``[b, h, sq]``."""
        band = diagonal != 0 or ((causal or window is not None) and q.shape[1] != k.shape[1])
        check_block_shapes(q, k, v, causal, window, diagonal, band and self.supports_window)
        if q.shape[1] == 0 or k.shape[1] == 0:
            return empty_block_result(q, v)
        if window is None and not diagonal:
            return self._forward(q, k, v, causal, scale)
        if self.supports_window:
            return self._forward(q, k, v, causal, scale, window=window, diagonal=diagonal)
        self._check_edge(causal, window)
        out, lse = self._forward(*_reversed(q, k, v), True, scale)  # c >= a is c' <= a' on reversed sequences
        return out.flip(1), lse.flip(-1)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        window: int | None = None,
        diagonal: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients given the GLOBAL out ``[b, sq, h, d_v]`` and lse ``[b, h, sq]``:
        dq ``[b, sq, h, d]``, dk ``[b, sk, h_kv, d]``, dv ``[b, sk, h_kv, d_v]``."""
        if q.shape[1] == 0 or k.shape[1] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        if window is None and not diagonal:
            # the fused kernels index lse as a dense [b, h, sq] buffer (a strided view is wrong)
            return self._backward(dout, q, k, v, out, lse.contiguous(), causal, scale)
        if self.supports_window:
            return self._backward(dout, q, k, v, out, lse.contiguous(), causal, scale, window=window,
                                  diagonal=diagonal)
        self._check_edge(causal, window)
        grads = self._backward(*_reversed(dout, q, k, v, out), lse.flip(-1), True, scale)
        return tuple(g.flip(1) for g in grads)  # type: ignore[return-value]

    def _check_edge(self, causal: bool, window: int | None) -> None:
        if causal or window != 1:
            raise ValueError(
                f"backend {self.name!r} has no window argument: it takes only the edge block (causal=False, "
                f"window=1); got causal={causal}, window={window}. The ring schedule cuts bands for it "
                f"(step_tasks(..., native_window=False))"
            )

    @abc.abstractmethod
    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The op on a non-empty block (same shapes as :meth:`forward`)."""

    @abc.abstractmethod
    def _backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The op's backward on a non-empty block, ``lse`` contiguous."""


def _reversed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each ``[b, s, ...]`` tensor with its sequence reversed (a copy)."""
    return tuple(t.flip(1) for t in tensors)
