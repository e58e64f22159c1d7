"""The one autograd Function behind every mode: Ulysses all-to-all (U > 1), ring (R >= 1), back.

Forward: q and the packed KV go sequence -> head shard (reordered into the ring layout),
the ring loop runs on ``H/U`` heads, the output goes head -> sequence shard. Backward runs
the mirror image explicitly, which is what lets gradients stay in float32 until their last
reduction: dq and un-replicated dk/dv are rounded once, then sent; dk/dv of REPLICATED KV
heads (U > h_kv) travel in float32 and are summed over replicas before the single rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .kernels import softmax_stat_dtype
from .layouts import Reorder
from .recompute import RecomputePlan
from .ring import RingSpec, ring_backward, ring_forward
from .ulysses import (exchange, head_from_recv, head_send_buffer, head_to_seq, kv_grads_from_recv,
                      kv_grads_send_buffer, pack_kv, seq_from_recv, seq_to_head, unpack_kv)


@dataclass(frozen=True)
class UlyssesSpec:
    """The Ulysses side of the grid: its group, size and the reorder into the ring layout."""

    group: dist.ProcessGroup
    size: int
    reorder: Reorder | None


class SequenceParallelFunction(torch.autograd.Function):
    """(q, k, v) shards -> (out shard, lse); lse is only meaningful without Ulysses."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingSpec, ulysses: UlyssesSpec | None,
                recompute: RecomputePlan | None = None):
        kv_heads = k.shape[2]
        if ulysses is not None:
            # Also on a checkpoint's re-run: the backward needs q and k/v in head layout, and
            # re-sending them costs less than keeping them from the first run.
            q = seq_to_head(q, ulysses.group, ulysses.reorder, "ulysses_a2a_q")
            packed = exchange(pack_kv(k, v, ulysses.size), ulysses.group, "ulysses_a2a_kv")
            k, v = unpack_kv(head_from_recv(packed, ulysses.reorder))
            del packed
        # Recompute (ring_sp.recompute): a checkpoint's re-run gets the first run's out/lse
        # back instead of running the ring again; a first run keeps them for that re-run.
        reused = recompute.reused if recompute is not None else None
        out, lse = ring_forward(q, k, v, ring) if reused is None else reused
        if recompute is not None:
            recompute.reused = None
            recompute.kept(ctx, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.ulysses, ctx.kv_heads = ring, ulysses, kv_heads
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for lse in backward (memory)
        if ulysses is not None:
            out = head_to_seq(out, ulysses.group, ulysses.reorder, "ulysses_a2a_out")
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        ulysses: UlyssesSpec | None = ctx.ulysses
        dtype = q.dtype
        if ulysses is None:
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.ring, dtype)
            return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None
        group, order, u = ulysses.group, ulysses.reorder, ulysses.size
        dout = seq_to_head(dout, group, order, "ulysses_a2a_dout")
        replicated = ctx.kv_heads % u != 0
        acc_dtype = softmax_stat_dtype(dtype)
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.ring, acc_dtype if replicated else dtype)
        # Memory: the saved q, k/v, out stay alive until this function returns, so every buffer
        # below is dropped as soon as the next one exists (``del``), keeping the peak at the
        # kernel's backward (as in DeepSpeed's DistributedAttention, whose saved tensors go
        # before its gradient all-to-alls), not at the all-to-alls.
        del dout
        send = head_send_buffer(dq.to(dtype), u, order)  # dq rounded once, then sent
        del dq
        recv = exchange(send, group, "ulysses_a2a_dq")
        del send
        dq = seq_from_recv(recv)
        del recv
        # dk and dv written straight into the packed send buffer (no cat). Replicated KV heads:
        # their gradients travel in fp32 and are summed over the replicas before the single rounding.
        send = kv_grads_send_buffer(dk, dv, u, order, acc_dtype if replicated else dtype)
        del dk, dv
        recv = exchange(send, group, "ulysses_a2a_dkv")
        del send
        dk, dv = kv_grads_from_recv(recv, ctx.kv_heads)
        del recv
        return dq, dk.to(dtype), dv.to(dtype), None, None, None
