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

Head chunks (``head_chunks = C > 1``, whole GQA groups each): the same nodes run the
chunks one after another, so the all-to-all buffers, the ring's KV and dK/dV buffers and the
fp32 accumulators exist for one chunk at a time, forward and backward. With Ulysses,
:class:`InputsToHeads` hands out each chunk's head-layout q, k, v (one all-to-all pair per
chunk), a ring node per chunk runs on them and :class:`OutputToSequence` writes every
chunk's output into its heads of ONE sequence-layout output; in backward each ring node is
freed (its saved tensors with it) as soon as its chunk is done. Each rank keeps the heads it
has unchunked (:func:`ring_sp.ulysses.chunk_heads`), so results equal the unchunked ones
and the bytes moved are the same. Without Ulysses, :class:`RingHeadChunks` runs the ring
per chunk on views of q, k, v, writing into one output and one gradient each: it keeps what
the unchunked ring node keeps (q, k, v, the output, lse), no per-chunk copy.
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

Chunk = tuple[int, int]  # (chunk, chunks): one chunk of whole GQA groups of a rank's heads


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
                                sinks: torch.Tensor | None = None,
                                head_chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q, k, v) shards -> (out shard, lse); lse ``[b, h, n]`` without Ulysses, None with it
    (it would be head-sharded). ``sinks`` ``[h]``: one logit per GLOBAL query head (see the
    module docstring). ``head_chunks``: chunks of whole GQA groups, checked by the caller
    (:func:`ring_sp.validation.check_head_chunk_split`).

    With Ulysses, three autograd nodes as in DeepSpeed's DistributedAttention: the inputs'
    all-to-alls, the ring, the output's all-to-all. The engine frees the ring's saved
    tensors (head-sharded q, k/v, out) and its incoming gradient before the gradients'
    all-to-alls run, so the backward peak is the kernel's, not the all-to-alls'.
    """
    if ulysses is None:
        if head_chunks > 1:
            return RingHeadChunks.apply(q, k, v, sinks, ring, head_chunks, recompute)
        return SequenceParallelFunction.apply(q, k, v, ring, None, recompute, sinks, 0)
    if sinks is not None:  # this rank's heads after the all-to-all
        per_rank = q.shape[2] // ulysses.size
        rank = dist.get_rank(ulysses.group)
        sinks = sinks[rank * per_rank:(rank + 1) * per_rank]
    if recompute is not None:
        recompute.parts = head_chunks  # one (out, lse) per chunk's ring node
    link = _KVGradLink()
    heads = InputsToHeads.apply(q, k, v, ulysses, link, head_chunks)
    outs = [SequenceParallelFunction.apply(*heads[3 * c:3 * c + 3], ring, link, recompute,
                                           _sinks(sinks, (c, head_chunks)), c)[0]
            for c in range(head_chunks)]
    return OutputToSequence.apply(ulysses, *outs), None


class _KVGradLink:
    """Hands float32 dk/dv of REPLICATED KV heads from the ring's backward to the
    all-to-all's, past autograd (which would round them to k's dtype first): they are
    summed over the replicas in float32 and rounded once (DESIGN section 4). (Replicated
    KV heads are never chunked: a rank holds one.)"""

    def __init__(self) -> None:
        self.replicated = False
        self.grads: tuple[torch.Tensor, torch.Tensor] | None = None


class InputsToHeads(torch.autograd.Function):
    """q and the packed k/v: sequence -> head shard, in the ring's layout; per head chunk
    (``chunks``), its q, k, v. Backward: dq and the packed dk/dv back (into their chunk's
    heads), each buffer dropped as soon as the next one exists."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses: UlyssesSpec, link: _KVGradLink,
                chunks: int = 1):
        ctx.ulysses, ctx.link, ctx.kv_heads, ctx.head_dim, ctx.dtype = ulysses, link, k.shape[2], k.shape[3], k.dtype
        ctx.shapes = (q.shape, k.shape, v.shape)
        link.replicated = k.shape[2] % ulysses.size != 0
        ctx.set_materialize_grads(False)
        # Also on a checkpoint's re-run (ring_sp.recompute): the ring's backward needs q and
        # k/v in head layout, and re-sending them costs less than keeping them.
        return tuple(t for c in range(chunks) for t in _to_heads(q, k, v, ulysses, (c, chunks)))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ulysses: UlyssesSpec = ctx.ulysses
        group, order, u = ulysses.group, ulysses.reorder, ulysses.size
        chunks = len(grads) // 3
        if ctx.link.grads is not None:
            grads = (grads[0], *ctx.link.grads)
            ctx.link.grads = None
        grads = list(grads)
        dq = dk = dv = None
        for c in range(chunks):
            chunk = (c, chunks)
            dq_c, dk_c, dv_c = grads[3 * c:3 * c + 3]
            grads[3 * c:3 * c + 3] = None, None, None
            if dq_c is not None:
                send = head_send_buffer(dq_c, u, order)
                del dq_c
                recv = exchange(send, group, "ulysses_a2a_dq")
                del send
                dq = seq_from_recv(recv, _filled(dq, ctx.shapes[:1], recv, chunks), *chunk)
                del recv
            if dk_c is None:
                continue
            # dk and dv written straight into the packed send buffer (no cat); replicated KV
            # heads' gradients travel in float32 and are summed before the single rounding.
            send = kv_grads_send_buffer(dk_c, dv_c, u, order, dk_c.dtype)
            del dk_c, dv_c
            recv = exchange(send, group, "ulysses_a2a_dkv")
            del send
            into = _filled(None if dk is None else (dk, dv), ctx.shapes[1:], recv, chunks)
            dk, dv = kv_grads_from_recv(recv, ctx.kv_heads, ctx.head_dim, into, *chunk)
            del recv
        if dk is not None:  # replicated KV heads' float32 sums: the one rounding (a no-op otherwise)
            dk, dv = dk.to(ctx.dtype), dv.to(ctx.dtype)
        return dq, dk, dv, None, None, None


def _filled(into: torch.Tensor | tuple[torch.Tensor, ...] | None, shapes: tuple[torch.Size, ...], recv: torch.Tensor,
            chunks: int) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """Where a chunk's gradients go: None unchunked (the receiving function allocates), else the
    whole gradients ``into`` the chunks fill (allocated by the first, in ``recv``'s dtype); one
    tensor for one shape, a tuple for several."""
    if chunks == 1:
        return None
    if into is None:
        into = tuple(recv.new_empty(shape) for shape in shapes)
        return into[0] if len(shapes) == 1 else into
    return into


class OutputToSequence(torch.autograd.Function):
    """The output's all-to-all (head -> sequence shard): per head chunk, into its heads of one
    output. Backward: dout to head layout, per chunk."""

    @staticmethod
    def forward(ctx, ulysses: UlyssesSpec, *outs: torch.Tensor) -> torch.Tensor:
        ctx.ulysses, ctx.chunks = ulysses, len(outs)
        if len(outs) == 1:
            return head_to_seq(outs[0], ulysses.group, ulysses.reorder, "ulysses_a2a_out")
        b, un, heads, d_v = outs[0].shape
        out = outs[0].new_empty((b, un // ulysses.size, heads * ulysses.size * len(outs), d_v))
        for c, out_c in enumerate(outs):
            head_to_seq(out_c, ulysses.group, ulysses.reorder, "ulysses_a2a_out", out, c, len(outs))
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        ulysses: UlyssesSpec = ctx.ulysses
        return None, *(seq_to_head(dout, ulysses.group, ulysses.reorder, "ulysses_a2a_dout", ulysses.head_major, c,
                                   ctx.chunks) for c in range(ctx.chunks))


class SequenceParallelFunction(torch.autograd.Function):
    """The ring on (head-sharded, with Ulysses) q, k, v[, this rank's sinks] -> (out, lse);
    with head chunks, on chunk ``chunk``'s heads."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingSpec, link: _KVGradLink | None,
                recompute: RecomputePlan | None = None, sinks: torch.Tensor | None = None, chunk: int = 0):
        # Recompute (ring_sp.recompute): a checkpoint's re-run gets the first run's out/lse
        # (sinks folded in) back instead of running the ring again; a first run keeps them.
        reused = recompute.reuse(chunk) if recompute is not None else None
        out, lse = ring_forward(q, k, v, ring, sinks) if reused is None else reused
        if recompute is not None:
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
            return dq.to(dtype), None, None, None, None, None, dsinks, None
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, dsinks, None


class RingHeadChunks(torch.autograd.Function):
    """The ring without Ulysses in ``chunks`` chunks of heads: each chunk's q, k, v are views
    of the inputs; its output, lse and gradients are written into their heads of one tensor
    each. Saves q, k, v, the output and lse, as :class:`SequenceParallelFunction` does."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, ring: RingSpec,
                chunks: int, recompute: RecomputePlan | None):
        ctx.ring, ctx.chunks = ring, chunks
        ctx.set_materialize_grads(False)
        reused = recompute.reuse(0) if recompute is not None else None
        if reused is None:
            b, n, heads, _ = q.shape
            out = q.new_empty((b, n, heads, v.shape[3]))
            lse = torch.empty((b, heads, n), dtype=softmax_stat_dtype(q.dtype), device=q.device)
            for c in range(chunks):
                out_c, lse_c = ring_forward(*(_heads(t, (c, chunks)) for t in (q, k, v)), ring, _sinks(sinks, (c, chunks)))
                _heads(out, (c, chunks)).copy_(out_c)
                _heads(lse, (c, chunks), dim=1).copy_(lse_c)
                del out_c, lse_c
        else:
            out, lse = reused
        if recompute is not None:
            recompute.kept(ctx, out, lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, _dlse: torch.Tensor | None):
        if dout is None:
            return None, None, None, None, None, None, None
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsinks = []
        for c in range(ctx.chunks):
            chunk = (c, ctx.chunks)
            q_c, k_c, v_c, out_c, dout_c = (_heads(t, chunk) for t in (q, k, v, out, dout))
            lse_c = _heads(lse, chunk, dim=1)
            if sinks is not None and ctx.needs_input_grad[3]:
                dsinks.append(sinks_grad(dout_c, out_c, lse_c, _sinks(sinks, chunk)).to(sinks.dtype))
            grads = ring_backward(dout_c, q_c, k_c, v_c, out_c, lse_c, ctx.ring, q.dtype)
            for into, grad in zip((dq, dk, dv), grads):
                _heads(into, chunk).copy_(grad)  # (dq: the one rounding of its fp32 sum)
            del grads
        return dq, dk, dv, torch.cat(dsinks) if dsinks else None, None, None, None


def _heads(x: torch.Tensor, chunk: Chunk, dim: int = 2) -> torch.Tensor:
    """Chunk ``chunk[0]`` of ``chunk[1]`` of ``x``'s heads (``dim``: 2 for ``[b, n, h, d]``, 1 for
    an lse ``[b, h, n]``), a view: without Ulysses a chunk's heads are consecutive."""
    c, chunks = chunk
    size = x.shape[dim] // chunks
    return x.narrow(dim, c * size, size)


def _sinks(sinks: torch.Tensor | None, chunk: Chunk) -> torch.Tensor | None:
    """The chunk's share of this rank's sinks (its query heads, in order); a differentiable view."""
    return sinks if sinks is None or chunk[1] == 1 else _heads(sinks, chunk, dim=0)


def _to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses: UlyssesSpec,
              chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's q and packed k/v to head layout (KV heads replicated where U > h_kv)."""
    c, chunks = chunk
    order, head_major = ulysses.reorder, ulysses.head_major
    q_c = seq_to_head(q, ulysses.group, order, "ulysses_a2a_q", head_major, c, chunks)
    packed = exchange(pack_kv(k, v, ulysses.size, c, chunks), ulysses.group, "ulysses_a2a_kv")  # [src, b, n, m*(d + d_v)]
    k_c, v_c = unpack_kv(packed, kv_heads_per_rank(k.shape[2], ulysses.size) // chunks, k.shape[3])
    return q_c, head_from_recv(k_c, order, head_major), head_from_recv(v_c, order, head_major)
