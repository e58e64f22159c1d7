"""Every mode's autograd: Ulysses all-to-all (U > 1), the ring (R >= 1), back.

:func:`sequence_parallel_attention` chains three nodes, as DeepSpeed's DistributedAttention
does, so that each frees its buffers before the next runs in backward (the backward peak is
the kernel's): :class:`InputsToHeads` (q and the packed KV go sequence -> head shard,
reordered into the ring layout), :class:`SequenceParallelFunction` (the ring on ``H/U``
heads; the only node that saves tensors; recompute-aware, see :mod:`ring_sp.recompute`) and
:class:`OutputToSequence` (head -> sequence shard). Without Ulysses only the middle one runs.
Gradients stay in float32 until their last reduction: dq and un-replicated dk/dv are rounded
once, then sent; dk/dv of REPLICATED KV heads (U > h_kv) travel in float32 (handed past
autograd's cast by :class:`_KVGradLink`) and are summed over replicas before the single rounding.

Attention sinks (one logit per query head) fold into the merged rows once, inside
:func:`ring_sp.ring.ring_forward`; the ring node gets this Ulysses rank's ``H/U`` of them
(a differentiable slice, so autograd puts their gradient back with zeros for the other
heads) and returns its rows' share: summing ``sinks.grad`` over the SP ranks, as the
data-parallel gradient reduction does, gives the whole gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layouts import Reorder
from .merge import sinks_grad
from .recompute import RecomputePlan
from .ring import RingSpec, ring_backward, ring_forward
from .shapes import kv_heads_per_rank, softmax_stat_dtype
from .ulysses import (exchange, head_from_recv, head_send_buffer, head_to_seq, kv_grads_from_recv,
                      kv_grads_send_buffer, pack_kv, seq_from_recv, seq_to_head, unpack_kv)


@dataclass(frozen=True)
class UlyssesSpec:
    """The Ulysses side of the grid: its group, size, the reorder into the ring layout and
    whether the kernel wants head-major storage (``AttentionKernel.head_major``)."""

    group: dist.ProcessGroup
    size: int
    reorder: Reorder | None
    head_major: bool = False


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingSpec,
                                ulysses: UlyssesSpec | None, recompute: RecomputePlan | None,
                                sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k, v) shards -> (out shard, lse); lse is only meaningful without Ulysses.
    ``sinks`` ``[h]``: one logit per GLOBAL query head (see the module docstring).

    With Ulysses, three autograd nodes as in DeepSpeed's DistributedAttention: the inputs'
    all-to-alls, the ring, the output's all-to-all. The engine frees the ring's saved
    tensors (head-sharded q, k/v, out) and its incoming gradient before the gradients'
    all-to-alls run, so the backward peak is the kernel's, not the all-to-alls'.
    """
    if ulysses is None:
        return SequenceParallelFunction.apply(q, k, v, ring, None, recompute, sinks)
    if sinks is not None:  # this rank's heads after the all-to-all
        per_rank = q.shape[2] // ulysses.size
        rank = dist.get_rank(ulysses.group)
        sinks = sinks[rank * per_rank:(rank + 1) * per_rank]
    link = _KVGradLink()
    q, k, v = InputsToHeads.apply(q, k, v, ulysses, link)
    out, lse = SequenceParallelFunction.apply(q, k, v, ring, link, recompute, sinks)
    return OutputToSequence.apply(out, ulysses), lse


class _KVGradLink:
    """Hands float32 dk/dv of REPLICATED KV heads from the ring's backward to the
    all-to-all's, past autograd (which would round them to k's dtype first): they are
    summed over the replicas in float32 and rounded once (DESIGN section 4)."""

    def __init__(self) -> None:
        self.replicated = False
        self.grads: tuple[torch.Tensor, torch.Tensor] | None = None


class InputsToHeads(torch.autograd.Function):
    """q and the packed k/v: sequence -> head shard, in the ring's layout. Backward: dq and
    the packed dk/dv back, each buffer dropped as soon as the next one exists."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses: UlyssesSpec, link: _KVGradLink):
        ctx.ulysses, ctx.link, ctx.kv_heads, ctx.head_dim, ctx.dtype = ulysses, link, k.shape[2], k.shape[3], k.dtype
        link.replicated = k.shape[2] % ulysses.size != 0
        ctx.set_materialize_grads(False)
        # Also on a checkpoint's re-run (ring_sp.recompute): the ring's backward needs q and
        # k/v in head layout, and re-sending them costs less than keeping them.
        order, head_major = ulysses.reorder, ulysses.head_major
        q = seq_to_head(q, ulysses.group, order, "ulysses_a2a_q", head_major)
        packed = exchange(pack_kv(k, v, ulysses.size), ulysses.group, "ulysses_a2a_kv")  # [src, b, n, m*(d + d_v)]
        k, v = unpack_kv(packed, kv_heads_per_rank(k.shape[2], ulysses.size), k.shape[3])
        return q, head_from_recv(k, order, head_major), head_from_recv(v, order, head_major)

    @staticmethod
    def backward(ctx, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None):
        ulysses: UlyssesSpec = ctx.ulysses
        group, order, u = ulysses.group, ulysses.reorder, ulysses.size
        if ctx.link.grads is not None:
            dk, dv = ctx.link.grads
            ctx.link.grads = None
        if dq is not None:
            send = head_send_buffer(dq, u, order)
            del dq
            recv = exchange(send, group, "ulysses_a2a_dq")
            del send
            dq = seq_from_recv(recv)
            del recv
        if dk is None:
            return dq, None, None, None, None
        # dk and dv written straight into the packed send buffer (no cat); replicated KV
        # heads' gradients travel in float32 and are summed before the single rounding.
        send = kv_grads_send_buffer(dk, dv, u, order, dk.dtype)
        del dk, dv
        recv = exchange(send, group, "ulysses_a2a_dkv")
        del send
        dk, dv = kv_grads_from_recv(recv, ctx.kv_heads, ctx.head_dim)
        del recv
        return dq, dk.to(ctx.dtype), dv.to(ctx.dtype), None, None


class OutputToSequence(torch.autograd.Function):
    """The output's all-to-all (head -> sequence shard); backward sends dout to head layout."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, ulysses: UlyssesSpec) -> torch.Tensor:
        ctx.ulysses = ulysses
        return head_to_seq(out, ulysses.group, ulysses.reorder, "ulysses_a2a_out")

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        ulysses: UlyssesSpec = ctx.ulysses
        return seq_to_head(dout, ulysses.group, ulysses.reorder, "ulysses_a2a_dout", ulysses.head_major), None


class SequenceParallelFunction(torch.autograd.Function):
    """The ring on (head-sharded, with Ulysses) q, k, v[, this rank's sinks] -> (out, lse)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingSpec, link: _KVGradLink | None,
                recompute: RecomputePlan | None = None, sinks: torch.Tensor | None = None):
        # Recompute (ring_sp.recompute): a checkpoint's re-run gets the first run's out/lse
        # (sinks folded in) back instead of running the ring again; a first run keeps them.
        reused = recompute.reused if recompute is not None else None
        out, lse = ring_forward(q, k, v, ring, sinks) if reused is None else reused
        if recompute is not None:
            recompute.reused = None
            recompute.kept(ctx, out, lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.link = ring, link
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse in backward (memory)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dtype = q.dtype
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[6]:
            dsinks = sinks_grad(dout, out, lse, sinks).to(sinks.dtype)
        link: _KVGradLink | None = ctx.link
        # (The link needs InputsToHeads' backward to run, which a dq guarantees; without one,
        # replicated dk/dv take autograd's path and are rounded before the replica sum.)
        via_link = link is not None and link.replicated and ctx.needs_input_grad[0]
        deliver = softmax_stat_dtype(dtype) if via_link else dtype
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.ring, deliver)
        if via_link:
            link.grads = (dk, dv)  # float32, to InputsToHeads' backward (which runs after this one)
            return dq.to(dtype), None, None, None, None, None, dsinks
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, dsinks
