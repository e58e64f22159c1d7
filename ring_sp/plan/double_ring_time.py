"""Time of a double ring's pass (``kv_exchange="double_ring"``, :mod:`ring_sp.schedule.ring_order`).

The ring runs ``R_out`` outer passes of ``R_in`` steps. Inside a pass each step lasts as long as its
slowest rank's compute or the next inner step's KV over NVLink, whichever is longer (as the flat
ring's steps); the next pass's held message (one shard of what the node reads, over the inter-node
link) is in flight during the WHOLE pass, so a pass lasts ``max(its steps, that message)``. In
backward the steps also send their fp32 dK/dV partials to the holder (NVLink) and each pass also
carries the previous held sum home (inter-node); the last sums home come after the compute.

A step hides its transfer when its compute is at least as long; compute grows as the chunk
squared and transfers as the chunk, so the chunk from which everything hides is, for each
transfer, ``chunk x transfer / compute`` (:func:`min_chunk`), over NVLink per step and over the
inter-node link per pass: ``R_in`` times the compute to hide each inter-node message behind.
Steps and messages are read from every rank's :func:`~ring_sp.schedule.exchange_plan` (layouts,
windows), the slowest rank setting each step (the ring runs in lockstep).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..schedule import exchange_plan, row_count

@dataclass(frozen=True)
class PassShape:
    """Per step the most (query, key) pairs any rank computes and the largest inner-step message
    (in shards), per outer step the largest held message (in shards); slowest rank each."""

    inner: int
    pairs: tuple[int, ...]
    inner_moves: tuple[float, ...]  # step t: the message that step t receives inside the node (0 at outer steps' first)
    held_moves: tuple[float, ...]  # outer step o: its held message (0 for o = 0)


@functools.lru_cache(maxsize=256)
def pass_shape(layout: str, causal: bool, ring: int, inner: int, chunk: int, window: int | None) -> PassShape:
    plans = [exchange_plan(layout, causal, r, ring, chunk, None, window, inner_size=inner) for r in range(ring)]
    pairs = tuple(max(sum(t.visible_pairs() for t in p.schedule[step]) for p in plans) for step in range(ring))
    inner_moves = tuple(0.0 if step % inner == 0 else max(row_count(p.recv_rows[step]) / chunk for p in plans)
                        for step in range(ring))
    held_moves = (0.0,) + tuple(max(row_count(p.recv_rows[o * inner]) / chunk for p in plans)
                                for o in range(1, ring // inner))
    return PassShape(inner, pairs, inner_moves, held_moves)


@dataclass(frozen=True)
class DoubleRingTime:
    fwd_s: float
    bwd_s: float
    hides_fwd: bool
    hides_bwd: bool
    min_chunk_fwd: int  # the ring chunk from which every transfer hides (the full ring's messages)
    min_chunk_bwd: int


def min_chunk(chunk: int, transfer_s: float, compute_s: float) -> int:
    """The chunk from which ``transfer_s`` (at ``chunk``, linear in it) hides behind ``compute_s`` (quadratic)."""
    return math.ceil(round(transfer_s * chunk / compute_s, 6)) if compute_s > 0 else 0


def double_ring_seconds(shape: PassShape, chunk: int, step_s_per_pair: float, kv_intra_s: float,
                        dkv_intra_s: float, kv_inter_s: float, dkv_inter_s: float, latency: float,
                        backward_ratio: float) -> DoubleRingTime:
    """Forward and backward seconds of one pass; ``*_s``: one whole shard's transfer on that link;
    ``backward_ratio``: a backward step's compute over its forward's."""
    inner, ring = shape.inner, len(shape.pairs)
    compute = [p * step_s_per_pair for p in shape.pairs]
    moves, held = shape.inner_moves + (0.0,), shape.held_moves + (0.0,)
    fwd = bwd = 0.0
    hides_fwd = hides_bwd = True
    for outer in range(ring // inner):
        steps = range(outer * inner, (outer + 1) * inner)
        fwd_steps = [max(compute[t], kv_intra_s * moves[t + 1]) for t in steps]
        bwd_steps = [max(backward_ratio * compute[t], kv_intra_s * moves[t + 1] + dkv_intra_s * moves[t])
                     for t in steps]
        inter_fwd = kv_inter_s * held[outer + 1]
        inter_bwd = inter_fwd + dkv_inter_s * held[outer]  # with it, the previous held sum goes home
        fwd += max(sum(fwd_steps), inter_fwd)
        bwd += max(sum(bwd_steps), inter_bwd)
        hides_fwd &= all(compute[t] >= kv_intra_s * moves[t + 1] for t in steps) and sum(
            compute[t] for t in steps) >= inter_fwd
        hides_bwd &= all(backward_ratio * compute[t] >= kv_intra_s * moves[t + 1] + dkv_intra_s * moves[t]
                         for t in steps) and backward_ratio * sum(compute[t] for t in steps) >= inter_bwd
    bwd += dkv_intra_s * moves[ring - 1] + dkv_inter_s * held[ring // inner - 1]  # the last partials and sum home
    moving = sum(1 for t in range(1, ring) if moves[t] or (t % inner == 0 and held[t // inner]))
    fwd, bwd = fwd + moving * latency, bwd + (moving + 1) * latency
    # the full ring's figures: the inner step with the least compute that an NVLink message overlaps,
    # the pass with the least compute that a held message overlaps
    inner_hardest = min((compute[t] for t in range(ring - 1) if (t + 1) % inner), default=0.0)
    pass_hardest = min((sum(compute[o * inner:(o + 1) * inner]) for o in range(ring // inner - 1)), default=0.0)
    min_fwd = max(min_chunk(chunk, kv_intra_s, inner_hardest), min_chunk(chunk, kv_inter_s, pass_hardest))
    min_bwd = max(min_chunk(chunk, kv_intra_s + dkv_intra_s, backward_ratio * inner_hardest),
                  min_chunk(chunk, kv_inter_s + dkv_inter_s, backward_ratio * pass_hardest))
    return DoubleRingTime(fwd, bwd, hides_fwd, hides_bwd, min_fwd, min_bwd)


__all__ = ["DoubleRingTime", "PassShape", "double_ring_seconds", "min_chunk", "pass_shape"]
