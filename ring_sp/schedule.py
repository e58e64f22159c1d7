"""Which (query part, key part, mask) blocks a ring rank computes at each step.

A pure function of the layout and the two ranks, kept apart from the ring loop so it can
be tested exhaustively without processes. Ring rank ``r`` at step ``t`` holds the KV of
rank ``s = (r - t) mod R``. With ``n`` local tokens (DESIGN.md section 4):

* non-causal: everything, one full block.
* contiguous: ``s == r`` causal; ``s < r`` full; ``s > r`` nothing (no kernel launch).
* zigzag (chunks ``r, 2R-1-r`` of ``c = n/2`` tokens): ``s == r`` causal over the whole
  shard; ``s < r`` all queries against the first KV chunk; ``s > r`` the second query
  chunk against all keys. Every step after the first is exactly half a block.
* striped: ``s <= r`` causal including the diagonal; ``s > r`` strictly causal, which is
  the square causal block of queries ``1..n-1`` against keys ``0..n-2``.

Every masked block is square, so kernels' top-left/bottom-right conventions agree.

Packed sequences (``cu_seqlens``): a token sees only its own document. In every layout a
document is one contiguous run of each shard, so each step's blocks are cut per document
(:func:`packed_step_tasks`); steps sharing no document compute nothing, and no mask
tensor is ever built. ``document_zigzag`` (documents of any length, chunks differing by a
token) is scheduled from the ring ranks' positions alone: a ring shard is a union of runs
of consecutive global positions, stored in increasing order, so each (query run, key run)
pair of a document is cut in GLOBAL coordinates by :func:`_interval_blocks` and shifted
to local indices. Ranks hold disjoint tokens, so only the diagonal step has masked blocks
(one square causal block per document); every other block is full.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .layouts import LAYOUTS, Boundaries, layout_positions, ring_positions


@dataclass(frozen=True)
class BlockTask:
    """Attend queries ``q`` (a slice of the local shard) to keys ``kv`` (a slice of the
    visiting KV shard), with a square causal mask when ``causal``."""

    q: slice
    kv: slice
    causal: bool

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs this block computes: its share of the work."""
        nq = self.q.stop - self.q.start
        nk = self.kv.stop - self.kv.start
        return nq * (nq + 1) // 2 if self.causal else nq * nk


def ring_step_tasks(layout: str, causal: bool, rank: int, source: int, local_len: int) -> tuple[BlockTask, ...]:
    """Blocks ring rank ``rank`` computes against the KV shard of rank ``source``.

    ``local_len`` is the shard length ``n``; returns an empty tuple for a step that
    computes nothing. Slices are in local token order of the layout.
    """
    n = local_len
    whole = slice(0, n)
    if not causal:
        return (BlockTask(whole, whole, False),)
    if layout == "contiguous":
        if source == rank:
            return (BlockTask(whole, whole, True),)
        return (BlockTask(whole, whole, False),) if source < rank else ()
    if layout == "zigzag":
        half = n // 2
        if source == rank:
            return (BlockTask(whole, whole, True),)
        if source < rank:
            return (BlockTask(whole, slice(0, half), False),)
        return (BlockTask(slice(half, n), whole, False),)
    if layout == "striped":
        if source <= rank:
            return (BlockTask(whole, whole, True),)
        return (BlockTask(slice(1, n), slice(0, n - 1), True),) if n > 1 else ()
    if layout == "document_zigzag":
        raise ValueError("layout='document_zigzag' needs cu_seqlens: use step_tasks / packed_step_tasks")
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


def _shifted(task: BlockTask, q_offset: int, kv_offset: int) -> BlockTask:
    return BlockTask(slice(task.q.start + q_offset, task.q.stop + q_offset),
                     slice(task.kv.start + kv_offset, task.kv.stop + kv_offset), task.causal)


def _interval_blocks(q: tuple[int, int], kv: tuple[int, int], causal: bool) -> list[BlockTask]:
    """Blocks covering exactly the pairs of query interval ``q`` and key interval ``kv``
    (half-open, in one coordinate frame) with ``key <= query`` when ``causal``."""
    (qa, qb), (ka, kb) = q, kv
    if not causal:
        return [BlockTask(slice(qa, qb), slice(ka, kb), False)]
    blocks = []
    if ka < min(kb, qa):  # keys before every query: all visible
        blocks.append(BlockTask(slice(qa, qb), slice(ka, min(kb, qa)), False))
    start = max(ka, qa)
    if start < min(kb, qb):  # the shared stretch: a square causal block
        blocks.append(BlockTask(slice(start, min(kb, qb)), slice(start, min(kb, qb)), True))
    if start < kb < qb:  # queries after every key of the stretch: all visible
        blocks.append(BlockTask(slice(kb, qb), slice(start, kb), False))
    return blocks


def _document_runs(positions: torch.Tensor, cu_seqlens: Boundaries) -> dict[int, tuple[int, int]]:
    """Document id -> its (start, stop) run of local indices (positions are increasing)."""
    docs = torch.searchsorted(torch.tensor(cu_seqlens), positions, right=True) - 1
    ids, counts = torch.unique_consecutive(docs, return_counts=True)
    stops = counts.cumsum(0)
    return {int(d): (int(stop - n), int(stop)) for d, n, stop in zip(ids, counts, stops)}


Runs = dict[int, list[tuple[int, int, int]]]  # document -> [(global start, global stop, local start)]


def _global_runs(positions: torch.Tensor, cu_seqlens: Boundaries) -> Runs:
    """Document id -> its runs of consecutive global positions in the (increasing) shard:
    ``(global start, global stop, local start)`` each."""
    docs = torch.searchsorted(torch.tensor(cu_seqlens), positions, right=True) - 1
    starts = torch.cat((torch.zeros(1, dtype=torch.long), ((positions.diff() != 1) | (docs.diff() != 0)).nonzero().flatten() + 1))
    stops = torch.cat((starts[1:], torch.tensor([positions.numel()])))
    runs: Runs = {}
    for doc, first, a, b in zip(docs[starts].tolist(), positions[starts].tolist(), starts.tolist(), stops.tolist()):
        runs.setdefault(doc, []).append((first, first + b - a, a))
    return runs


@functools.lru_cache(maxsize=8)  # keyed by the documents: a new packing can come every step
def _ring_runs(ulysses_size: int, ring_size: int, seq_len: int, cu_seqlens: Boundaries) -> tuple[Runs, ...]:
    """:func:`_global_runs` of every ring shard of ``document_zigzag``, once per packing."""
    positions = ring_positions("document_zigzag", ulysses_size, ring_size, seq_len, cu_seqlens)
    return tuple(_global_runs(row, cu_seqlens) for row in positions)


def _local_span(runs: list[tuple[int, int, int]]) -> slice:
    """A document's local indices in a shard: its runs are stored one after the other."""
    first, last = runs[0], runs[-1]
    return slice(first[2], last[2] + last[1] - last[0])


def _merged(blocks: list[BlockTask]) -> list[BlockTask]:
    """Full blocks that touch along one side become one (fewer kernel calls): the same
    keys for adjacent query rows, then the same queries for adjacent keys."""
    for same, along in (("kv", "q"), ("q", "kv")):
        blocks = sorted(blocks, key=lambda t: (getattr(t, same).start, getattr(t, along).start))
        out: list[BlockTask] = []
        for t in blocks:
            last = out[-1] if out else None
            if (last is not None and not last.causal and not t.causal and getattr(last, same) == getattr(t, same)
                    and getattr(last, along).stop == getattr(t, along).start):
                grown = slice(getattr(last, along).start, getattr(t, along).stop)
                out[-1] = BlockTask(grown, t.kv, False) if along == "q" else BlockTask(t.q, grown, False)
            else:
                out.append(t)
        blocks = out
    return sorted(blocks, key=lambda t: (t.q.start, t.kv.start))


def _document_zigzag_tasks(causal: bool, q_runs: Runs, kv_runs: Runs, diagonal: bool) -> tuple[BlockTask, ...]:
    """The blocks of one step between two ring shards given by their runs."""
    if diagonal or not causal:  # per document, all of its queries against all of its keys
        # on the diagonal the local order is the global order: one square causal block per document
        return tuple(BlockTask(_local_span(q), _local_span(kv_runs[doc]), causal)
                     for doc, q in q_runs.items() if doc in kv_runs)
    blocks: list[BlockTask] = []
    for doc, queries in q_runs.items():
        for qa, qb, q_local in queries:
            for ka, kb, kv_local in kv_runs.get(doc, ()):
                blocks.extend(_shifted(t, q_local - qa, kv_local - ka) for t in _interval_blocks((qa, qb), (ka, kb), True))
    return tuple(_merged(blocks))


def packed_step_tasks(layout: str, causal: bool, rank: int, source: int, world_size: int, local_len: int,
                      cu_seqlens: Boundaries, ulysses_size: int = 1) -> tuple[BlockTask, ...]:
    """:func:`ring_step_tasks` restricted to pairs inside one document of ``cu_seqlens``.

    ``world_size`` is the ring size ``R`` and ``local_len`` the ring shard length (after
    the Ulysses all-to-all over ``ulysses_size`` ranks: ``U`` times the SP shard).
    ``document_zigzag`` is cut from the ring shards' global runs (module docstring). For the
    other layouts each block of the plain schedule is cut by the documents; a causal
    block's frame (query i vs key i) makes each cut an interval pair.
    """
    seq_len = local_len * world_size
    if layout == "document_zigzag":
        ring_positions(layout, ulysses_size, world_size, seq_len, cu_seqlens)  # validates (cached)
        runs = _ring_runs(ulysses_size, world_size, seq_len, cu_seqlens)
        return _document_zigzag_tasks(causal, runs[rank], runs[source], source == rank)
    positions = layout_positions(layout, world_size, seq_len, cu_seqlens)
    q_runs, kv_runs = _document_runs(positions[rank], cu_seqlens), _document_runs(positions[source], cu_seqlens)
    tasks: list[BlockTask] = []
    for base in ring_step_tasks(layout, causal, rank, source, local_len):
        for doc, (qa, qb) in q_runs.items():
            if doc not in kv_runs:
                continue
            ka, kb = kv_runs[doc]
            q = (max(qa, base.q.start) - base.q.start, min(qb, base.q.stop) - base.q.start)
            kv = (max(ka, base.kv.start) - base.kv.start, min(kb, base.kv.stop) - base.kv.start)
            if q[0] < q[1] and kv[0] < kv[1]:
                tasks.extend(_shifted(b, base.q.start, base.kv.start) for b in _interval_blocks(q, kv, base.causal))
    return tuple(tasks)


def step_tasks(layout: str, causal: bool, rank: int, source: int, world_size: int, local_len: int,
               cu_seqlens: Boundaries | None, ulysses_size: int = 1) -> tuple[BlockTask, ...]:
    """The blocks of one ring step, with or without documents (``ulysses_size``: the
    Ulysses group size ``U`` of the grid, which only ``document_zigzag``'s ring shards depend on)."""
    if cu_seqlens is None:
        return ring_step_tasks(layout, causal, rank, source, local_len)
    return packed_step_tasks(layout, causal, rank, source, world_size, local_len, cu_seqlens, ulysses_size)


def causal_work_per_rank(layout: str, world_size: int, local_len: int, causal: bool = True,
                         cu_seqlens: Boundaries | None = None, ulysses_size: int = 1) -> list[int]:
    """(query, key) pairs each ring rank computes over a whole ring pass: the load balance."""
    return [
        sum(
            task.visible_pairs()
            for step in range(world_size)
            for task in step_tasks(layout, causal, rank, (rank - step) % world_size, world_size, local_len, cu_seqlens,
                                   ulysses_size)
        )
        for rank in range(world_size)
    ]
