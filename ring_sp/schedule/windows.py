"""Sliding windows: query i sees key j iff ``i - window < j <= i`` (and, packed, the same document).

Each shard is cut into RUNS of consecutive coordinates in one frame: global positions for
contiguous, zigzag and document_zigzag (one or two runs per shard, two per document), and
for striped the local index itself (rank r's a-th token is r + R*a, so the window becomes a
band of ceil((window - (r - s)) / R) local tokens). A pair of runs is a block between two
intervals of that frame, i.e. a BAND; :func:`band_blocks` covers it exactly with full
rectangles, square causal blocks and square "edge" blocks (key c >= query a). Kernels
without a window argument get edge blocks only (the fused torch ops flip both sequences
and run their causal mask); kernels with one (flash-attn, reference) take the band whole.
Nothing here builds a mask tensor, so memory stays O(block) whatever the window.
"""

from __future__ import annotations

from ..layouts import LAYOUTS, Boundaries, shard_runs
from ..runs import ShardRuns
from .blocks import BlockTask, interval_blocks, shifted
from .documents import shard_pieces


def band_blocks(q: tuple[int, int], kv: tuple[int, int], window: int, native_window: bool = False) -> list[BlockTask]:
    """Blocks covering exactly the pairs (i, j), ``i`` in query interval ``q`` and ``j`` in key
    interval ``kv`` (half-open, one frame), with ``i - window < j <= i``. Slices are in that frame."""
    if window < 1:
        return []
    return [piece for block in interval_blocks(q, kv, True) for piece in _lower_edge(block, window, native_window)]


def _lower_edge(block: BlockTask, window: int, native_window: bool) -> list[BlockTask]:
    """``block`` (a full rectangle with every key <= every query, or a square causal block)
    restricted to keys ``j > i - window``."""
    qa, qb, ka, kb = block.q.start, block.q.stop, block.kv.start, block.kv.stop
    if block.causal:  # square diagonal block: row i sees [max(qa, i - window + 1), i]
        if qb - qa <= window:
            return [block]
        if native_window:
            return [BlockTask(block.q, block.kv, True, window)]
        pieces = []
        for t in range(qa, qb, window):  # diagonal squares of `window` rows, plus what lies left of each
            e = min(t + window, qb)
            pieces.append(BlockTask(slice(t, e), slice(t, e), True))
            if t > qa:
                pieces.extend(_lower_edge(BlockTask(slice(t, e), slice(t - window, t), False), window, native_window))
        return pieces
    pieces = []
    if qa < min(qb, ka + window):  # rows i <= ka + window - 1 see every key
        pieces.append(BlockTask(slice(qa, min(qb, ka + window)), block.kv, False))
    s, e = max(qa, ka + window), min(qb, kb + window - 1)  # rows that see keys [i - window + 1, kb)
    if s < e:
        pieces.append(BlockTask(slice(s, e), slice(s - window + 1, e - window + 1), False, 1))  # edge square: c >= a
        if e - window + 1 < kb:
            pieces.append(BlockTask(slice(s, e), slice(e - window + 1, kb), False))
    return pieces


# (local start, local stop, frame coordinate of the local start, document id)
_Run = tuple[int, int, int, int]


def _runs(shard: ShardRuns, frame_start: int | None, cu_seqlens: Boundaries | None) -> list[_Run]:
    """A shard's runs of consecutive global positions (``frame_start`` None), or, for striped,
    its one run in the local frame starting at ``frame_start``; cut at document boundaries."""
    if frame_start is None:
        return list(zip(*(t.tolist() for t in shard_pieces(shard, cu_seqlens))))
    # striped: the local frame advances one per local token; only documents cut it
    begin, end, _, docs = (t.tolist() for t in shard_pieces(shard, cu_seqlens, consecutive=False))
    return [(a, b, frame_start + a, doc) for a, b, doc in zip(begin, end, docs)]


def window_step_tasks(layout: str, rank: int, source: int, world_size: int, local_len: int, window: int,
                      cu_seqlens: Boundaries | None = None, native_window: bool = False, *,
                      ulysses_size: int = 1) -> tuple[BlockTask, ...]:
    """Causal sliding-window blocks ring rank ``rank`` computes against the KV of ``source``:
    query at global position i sees key j iff ``i - window < j <= i`` (and the same document
    of ``cu_seqlens``). ``native_window``: the kernel takes ``BlockTask.window`` bands whole
    (else bands are cut into causal and edge squares of ``window`` rows). Empty tuple: the
    step computes nothing (and, in the ring, exchanges nothing)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    # the ring shards (after the Ulysses all-to-all over ulysses_size ranks, in increasing order)
    q_shard, kv_shard = (shard_runs(layout, ulysses_size, world_size, local_len * world_size, r, cu_seqlens)
                         for r in (rank, source))
    if layout == "striped" and world_size > 1:
        # query a (position rank + R*a) vs key c (source + R*c): c <= a (source <= rank) or
        # c <= a - 1 (source > rank); c > a - ceil((window - (rank - source)) / R).
        shift = 1 if source > rank else 0
        frame_window = -(-(window - (rank - source)) // world_size) - shift
        q_runs, kv_runs = _runs(q_shard, -shift, cu_seqlens), _runs(kv_shard, 0, cu_seqlens)
    else:
        frame_window = window
        q_runs, kv_runs = _runs(q_shard, None, cu_seqlens), _runs(kv_shard, None, cu_seqlens)
    tasks: list[BlockTask] = []
    for qa, qb, qf, qdoc in q_runs:
        for ka, kb, kf, kdoc in kv_runs:
            if qdoc != kdoc or kf > qf + (qb - qa) - 1 or kf + (kb - ka) - 1 <= qf - frame_window:
                continue  # other document, keys all in the future, or all before the window
            for t in band_blocks((qf, qf + qb - qa), (kf, kf + kb - ka), frame_window, native_window):
                tasks.append(shifted(t, qa - qf, ka - kf))
    return tuple(tasks)
