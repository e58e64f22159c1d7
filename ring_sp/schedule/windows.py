"""Sliding windows: query i sees key j iff ``i - window < j <= i`` (and, packed, the same document).

Each shard is cut into RUNS of consecutive coordinates in one frame: global positions for
contiguous, zigzag and document_zigzag (one or two runs per shard, two per document), and
for striped the local index itself (rank r's a-th token is r + R*a, so the window becomes a
band of ceil((window - (r - s)) / R) local tokens). A pair of runs is a block between two
intervals of that frame, i.e. a BAND. Kernels with a window argument (``native_window``:
flash-attention's ``window_size_left/right``) take it whole, as ONE block trimmed to the
pairs it holds (:func:`band_blocks`; a band flash-attention's window arithmetic cannot state
exactly is split in two, see :func:`~.blocks.bottom_right_window`). For the others it is
covered exactly with full rectangles, square causal blocks and square "edge" blocks (key
c >= query a), which the fused torch ops run as their causal mask on both sequences flipped.
Nothing here builds a mask tensor, so memory stays O(block) whatever the window.
"""

from __future__ import annotations

import torch

from ..layouts import LAYOUTS, Boundaries, shard_runs
from ..runs import ShardRuns
from .blocks import BlockTask, bottom_right_window, interval_blocks, shifted
from .documents import matching_pairs, ring_runs, shard_pieces


def band_blocks(q: tuple[int, int], kv: tuple[int, int], window: int, native_window: bool = False) -> list[BlockTask]:
    """Blocks covering exactly the pairs (i, j), ``i`` in query interval ``q`` and ``j`` in key
    interval ``kv`` (half-open, one frame), with ``i - window < j <= i``. Slices are in that frame.
    ``native_window``: the band whole (one block, two where :func:`_exact_bands` must split);
    else full, causal and edge squares."""
    if window < 1:
        return []
    if native_window:
        return _exact_bands(q, kv, -window, 0)
    return [piece for block in interval_blocks(q, kv, True) for piece in _lower_edge(block, window)]


def _exact_bands(q: tuple[int, int], kv: tuple[int, int], lo: int | None, hi: int | None) -> list[BlockTask]:
    """The pairs ``lo < j - i <= hi`` (frame coordinates; None: unbounded) of ``q x kv`` as
    blocks flash-attention's bottom-right window states exactly: the band trimmed to rows that
    see a key and keys some row sees, and, where its right bound is ``>= seqlen_k`` yet still
    hides keys from the first rows (:func:`~.blocks.bottom_right_window`), split where the rows
    start to see the last key: below, no right bound; above, the same band again, shorter."""
    inf = float("inf")
    top, bottom = (-inf if lo is None else lo), (inf if hi is None else hi)
    rows = (max(q[0], kv[0] - bottom), min(q[1], kv[1] - top - 1))
    keys = (max(kv[0], q[0] + top + 1), min(kv[1], q[1] + bottom))
    if rows[0] >= rows[1] or keys[0] >= keys[1]:
        return []
    (r0, r1), (k0, k1) = (int(rows[0]), int(rows[1])), (int(keys[0]), int(keys[1]))
    nq, nk = r1 - r0, k1 - k0
    shift = r0 - k0  # frame j - i = block c - a - shift
    block_lo, block_hi = (None if lo is None else lo + shift), (None if hi is None else hi + shift)
    if block_hi is not None and block_hi - (nk - nq) >= nq - 1:
        block_hi = None  # every row reaches the last key
    if block_lo is not None and block_lo <= -nq:
        block_lo = None  # every row reaches the first key
    if block_hi is not None and block_hi - (nk - nq) >= nk:  # flash would take this right bound as none
        split = k1 - 1 - hi  # the first frame row that sees the last key
        return _exact_bands((r0, split), (k0, k1), lo, hi) + _exact_bands((split, r1), (k0, k1), lo, hi)
    task = _band_task(slice(r0, r1), slice(k0, k1), block_lo, block_hi)
    bottom_right_window(nq, nk, task.causal, task.window, task.diagonal)  # exact by construction
    return [task]


def _band_task(q: slice, kv: slice, lo: int | None, hi: int | None) -> BlockTask:
    """The block ``lo < c - a <= hi`` in canonical form: a plain full or causal block where it is one."""
    if lo is None:
        return BlockTask(q, kv, hi is not None, None, hi or 0)
    if hi is None:
        return BlockTask(q, kv, False, 1, lo + 1)
    return BlockTask(q, kv, True, hi - lo, hi)


def _lower_edge(block: BlockTask, window: int) -> list[BlockTask]:
    """``block`` (a full rectangle with every key <= every query, or a square causal block)
    restricted to keys ``j > i - window``, in full, causal and edge squares."""
    qa, qb, ka, kb = block.q.start, block.q.stop, block.kv.start, block.kv.stop
    if block.causal:  # square diagonal block: row i sees [max(qa, i - window + 1), i]
        if qb - qa <= window:
            return [block]
        pieces = []
        for t in range(qa, qb, window):  # diagonal squares of `window` rows, plus what lies left of each
            e = min(t + window, qb)
            pieces.append(BlockTask(slice(t, e), slice(t, e), True))
            if t > qa:
                pieces.extend(_lower_edge(BlockTask(slice(t, e), slice(t - window, t), False), window))
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


def _striped_runs(shard: ShardRuns, frame_start: int, cu_seqlens: Boundaries | None) -> tuple[torch.Tensor, ...]:
    """A striped shard as one run in the local frame starting at ``frame_start``, cut at document
    boundaries: LongTensors (local start, local stop, frame coordinate of the local start,
    document id), documents in increasing order."""
    begin, end, _, docs = shard_pieces(shard, cu_seqlens, consecutive=False)
    return begin, end, begin + frame_start, docs


def _global_runs(layout: str, ulysses_size: int, world_size: int, local_len: int, rank: int,
                 cu_seqlens: Boundaries | None) -> tuple[torch.Tensor, ...]:
    """A ring shard's runs of consecutive global positions, as :func:`_striped_runs` gives them
    (the frame is the global position), cached per packing and rank (:func:`.documents.ring_runs`)."""
    runs = ring_runs(layout, ulysses_size, world_size, local_len * world_size, cu_seqlens, rank)
    return runs.local, runs.local + (runs.stop - runs.start), runs.start, runs.doc


def window_step_tasks(layout: str, rank: int, source: int, world_size: int, local_len: int, window: int,
                      cu_seqlens: Boundaries | None = None, native_window: bool = False, *,
                      ulysses_size: int = 1) -> tuple[BlockTask, ...]:
    """Causal sliding-window blocks ring rank ``rank`` computes against the KV of ``source``:
    query at global position i sees key j iff ``i - window < j <= i`` (and the same document
    of ``cu_seqlens``). ``native_window``: the kernel takes bands whole (one block per pair of
    runs; else they are cut into full, causal and edge squares of ``window`` rows). Empty tuple: the
    step computes nothing (and, in the ring, exchanges nothing)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    # the ring shards (after the Ulysses all-to-all over ulysses_size ranks, in increasing order)
    if layout == "striped" and world_size > 1:
        q_shard, kv_shard = (shard_runs(layout, ulysses_size, world_size, local_len * world_size, r, cu_seqlens)
                             for r in (rank, source))
        # query a (position rank + R*a) vs key c (source + R*c): c <= a (source <= rank) or
        # c <= a - 1 (source > rank); c > a - ceil((window - (rank - source)) / R).
        shift = 1 if source > rank else 0
        frame_window = -(-(window - (rank - source)) // world_size) - shift
        q_runs, kv_runs = _striped_runs(q_shard, -shift, cu_seqlens), _striped_runs(kv_shard, 0, cu_seqlens)
    else:
        frame_window = window
        q_runs, kv_runs = (_global_runs(layout, ulysses_size, world_size, local_len, r, cu_seqlens)
                           for r in (rank, source))
    (qa, qb, qf, q_doc), (ka, kb, kf, kv_doc) = q_runs, kv_runs
    qi, ki = matching_pairs(q_doc, kv_doc)  # run pairs of one document, by query run then key run
    qa, qb, qf, ka, kb, kf = qa[qi], qb[qi], qf[qi], ka[ki], kb[ki], kf[ki]
    # keys not all in the future, nor all before the window
    near = (kf <= qf + (qb - qa) - 1) & (kf + (kb - ka) - 1 > qf - frame_window)
    tasks: list[BlockTask] = []
    for qa_, qb_, qf_, ka_, kb_, kf_ in zip(*(t[near].tolist() for t in (qa, qb, qf, ka, kb, kf))):
        for t in band_blocks((qf_, qf_ + qb_ - qa_), (kf_, kf_ + kb_ - ka_), frame_window, native_window):
            tasks.append(shifted(t, qa_ - qf_, ka_ - kf_))
    return tuple(tasks)
