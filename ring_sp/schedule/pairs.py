"""How much of a ring pass's attention work the mask needs: score pairs the kernel calls
compute (:func:`call_pairs`) against the pairs the mask needs (:func:`mask_pairs`), and the
kernel calls per step (:func:`rank_pair_count`). Pure functions of the schedule and the
kernel's capabilities (:class:`~.calls.KernelCaps`): tests, benchmarks and gpu_check count
with them, no kernel runs.

What a kernel computes for a block: a full block ``nq x nk``, a causal square its triangle,
a band its band (the fused ops compute an edge block as their causal mask on flipped
sequences: its triangle), a block whose mask is an explicit tensor its whole rectangle.
With ``tile=(tq, tk)`` the count is rounded up to the kernel's tiles instead: a tile with any
pair the mask keeps is computed whole (flash-attention skips only tiles with none), per
segment of a varlen call: an estimate of what a GPU pays for small or ragged blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..layouts import Boundaries, shard_runs
from ..spans import Spans
from .blocks import BlockTask, band_pairs
from .calls import KernelCall, KernelCaps, step_calls
from .ring_pass import exchange_plan


class PairCount(NamedTuple):
    """One ring rank's pass: score pairs computed and needed, kernel calls per step."""

    computed: int
    needed: int
    calls: tuple[int, ...]


def block_pairs(task: BlockTask, caps: KernelCaps, tile: tuple[int, int] | None = None) -> int:
    """Score pairs the kernel computes for one block (module docstring)."""
    nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
    masked = task.causal or task.window is not None
    if caps.explicit_masks and masked:
        lo, hi = None, None
    else:
        lo, hi = task.band()
    return band_pairs(nq, nk, lo, hi) if tile is None else _tiled_pairs(nq, nk, lo, hi, tile)


def call_pairs(call: KernelCall, caps: KernelCaps, tile: tuple[int, int] | None = None) -> int:
    """Score pairs one kernel call computes: its blocks' (fillers compute none)."""
    return sum(block_pairs(task, caps, tile) for task in call.blocks)


def _tiled_pairs(nq: int, nk: int, lo: int | None, hi: int | None, tile: tuple[int, int]) -> int:
    """Pairs of the ``tq x tk`` tiles holding a pair ``lo < c - a <= hi`` (each whole)."""
    tq, tk = tile
    total = 0
    for a0 in range(0, nq, tq):
        a1 = min(a0 + tq, nq) - 1  # the tile's last row; rows' key ranges only move right
        first = 0 if lo is None else max(0, a0 + lo + 1)
        last = nk - 1 if hi is None else min(nk - 1, a1 + hi)
        if first <= last:
            total += (last // tk - first // tk + 1) * tq * tk
    return total


def mask_pairs(q_positions: torch.Tensor, kv_positions: torch.Tensor, *, causal: bool, window: int | None = None,
               cu_seqlens: Boundaries | None = None, spans: Spans | None = None) -> int:
    """Pairs (query i, key j) of global positions the mask keeps: j in i's document of
    ``cu_seqlens``, ``j <= i`` if ``causal`` (``j < stop`` for i in a bidirectional span
    ``[start, stop)`` of ``spans``), ``j > i - window``. Per query a range of keys, counted by
    binary search over the sorted keys: O((nq + nk) log nk), no dense mask."""
    keys = kv_positions.sort().values
    i = q_positions
    if cu_seqlens is None:
        first, stop = torch.zeros_like(i), torch.full_like(i, 1 << 62)
    else:
        bounds = torch.tensor(cu_seqlens)
        doc = torch.searchsorted(bounds, i, right=True) - 1
        first, stop = bounds[doc], bounds[doc + 1]
    last = i if causal else stop - 1
    if causal and spans:  # a query inside a span also sees the span's later tokens
        starts, stops = torch.tensor(spans[0::2]), torch.tensor(spans[1::2])
        at = (torch.searchsorted(starts, i, right=True) - 1).clamp(min=0)
        inside = (starts[at] <= i) & (i < stops[at])
        last = torch.where(inside, torch.maximum(last, stops[at] - 1), last)
    if window is not None:
        first = torch.maximum(first, i - window + 1)
    counts = torch.searchsorted(keys, last, right=True) - torch.searchsorted(keys, first)
    return int(counts.clamp(min=0).sum())


def rank_pair_count(layout: str, causal: bool, rank: int, world_size: int, local_len: int,
                    cu_seqlens: Boundaries | None = None, window: int | None = None, *, ulysses_size: int = 1,
                    caps: KernelCaps = KernelCaps(), tile: tuple[int, int] | None = None,
                    spans: Spans | None = None) -> PairCount:
    """Ring rank ``rank``'s whole pass (``local_len``: its ring shard, after the Ulysses
    all-to-all over ``ulysses_size`` ranks; ``spans``: bidirectional spans): pairs its kernel
    calls compute (the schedule cut for ``caps``, grouped by :func:`~.calls.step_calls`), pairs
    its mask needs, calls per step."""
    plan = exchange_plan(layout, causal, rank, world_size, local_len, cu_seqlens, window, caps.bands,
                         ulysses_size=ulysses_size, spans=spans)
    calls = [step_calls(tasks, caps) for tasks in plan.schedule]
    computed = sum(call_pairs(call, caps, tile) for step in calls for call in step)
    seq_len = local_len * world_size
    positions = [shard_runs(layout, ulysses_size, world_size, seq_len, r, cu_seqlens).positions()
                 for r in range(world_size)]
    needed = sum(mask_pairs(positions[rank], keys, causal=causal, window=window, cu_seqlens=cu_seqlens, spans=spans)
                 for keys in positions)
    return PairCount(computed, needed, tuple(len(step) for step in calls))
