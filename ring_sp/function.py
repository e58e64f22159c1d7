"""The one autograd Function behind every mode: Ulysses all-to-all (U > 1), ring (R >= 1), back.

Forward: q and the packed KV go sequence -> head shard (reordered into the ring layout),
the ring loop runs on ``H/U`` heads, the output goes head -> sequence shard. Backward runs
the mirror image explicitly, which is what lets gradients stay in float32 until their last
reduction: dq and un-replicated dk/dv are rounded once, then sent; dk/dv of REPLICATED KV
heads (U > h_kv) travel in float32 and are summed over replicas before the single rounding.

Attention sinks (one logit per query head) fold into the merged rows once, inside
:func:`ring_forward`; their gradient is this rank's rows' share (its H/U heads under
Ulysses, zeros for the others), so summing ``sinks.grad`` over the SP ranks, as the
data-parallel gradient reduction does, gives the whole gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kernels import softmax_stat_dtype
from .layouts import Reorder
from .merge import sinks_grad
from .ring import RingSpec, ring_backward, ring_forward
from .ulysses import head_to_seq, kv_heads_per_rank, pack_kv, pack_kv_grads, seq_to_head, unpack_kv, unpack_kv_grads


@dataclass(frozen=True)
class UlyssesSpec:
    """The Ulysses side of the grid: its group, size and the reorder into the ring layout."""

    group: dist.ProcessGroup
    size: int
    reorder: Reorder | None


def _local_heads(heads: int, ulysses: UlyssesSpec | None) -> slice:
    """The query heads this rank attends after the Ulysses all-to-all (all of them without)."""
    if ulysses is None:
        return slice(0, heads)
    per_rank = heads // ulysses.size
    rank = dist.get_rank(ulysses.group)
    return slice(rank * per_rank, (rank + 1) * per_rank)


class SequenceParallelFunction(torch.autograd.Function):
    """(q, k, v[, sinks]) shards -> (out shard, lse); lse is only meaningful without Ulysses."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingSpec, ulysses: UlyssesSpec | None,
                sinks: torch.Tensor | None = None):
        kv_heads = k.shape[2]
        heads = _local_heads(q.shape[2], ulysses)
        if ulysses is not None:
            q = seq_to_head(q, ulysses.group, ulysses.reorder, "ulysses_a2a_q")
            packed = seq_to_head(pack_kv(k, v, ulysses.size), ulysses.group, ulysses.reorder, "ulysses_a2a_kv")
            k, v = unpack_kv(packed, kv_heads_per_rank(kv_heads, ulysses.size), q.shape[3])
        local_sinks = None if sinks is None else sinks.detach()[heads]
        out, lse = ring_forward(q, k, v, ring, local_sinks)
        ctx.save_for_backward(q, k, v, out, lse, local_sinks)
        ctx.ring, ctx.ulysses, ctx.kv_heads, ctx.heads = ring, ulysses, kv_heads, heads
        ctx.sinks_meta = None if sinks is None else (sinks.shape, sinks.dtype)
        ctx.mark_non_differentiable(lse)
        if ulysses is not None:
            out = head_to_seq(out, ulysses.group, ulysses.reorder, "ulysses_a2a_out")
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
        q, k, v, out, lse, local_sinks = ctx.saved_tensors
        ulysses: UlyssesSpec | None = ctx.ulysses
        dtype = q.dtype
        if ulysses is not None:
            dout = seq_to_head(dout.contiguous(), ulysses.group, ulysses.reorder, "ulysses_a2a_dout")
        dsinks = None
        if ctx.sinks_meta is not None and ctx.needs_input_grad[5]:
            shape, sinks_dtype = ctx.sinks_meta
            dsinks = torch.zeros(shape, dtype=lse.dtype, device=lse.device)
            dsinks[ctx.heads] = sinks_grad(dout, out, lse, local_sinks)
            dsinks = dsinks.to(sinks_dtype)
        replicated = ulysses is not None and ctx.kv_heads % ulysses.size != 0
        acc_dtype = softmax_stat_dtype(dtype)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.ring, acc_dtype if replicated else dtype)
        if ulysses is None:
            return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, dsinks
        dq = head_to_seq(dq.to(dtype), ulysses.group, ulysses.reorder, "ulysses_a2a_dq")
        # Replicated KV heads: their gradients travel in fp32 and are summed over the
        # replicas before the single rounding.
        d_packed = pack_kv_grads(dk, dv, acc_dtype if replicated else dtype)
        d_packed = head_to_seq(d_packed, ulysses.group, ulysses.reorder, "ulysses_a2a_dkv")
        dk, dv = unpack_kv_grads(d_packed, ctx.kv_heads, ulysses.size, q.shape[3])
        return dq, dk.to(dtype), dv.to(dtype), None, None, dsinks
