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
tensor is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layouts import LAYOUTS, Boundaries, layout_positions


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


def packed_step_tasks(layout: str, causal: bool, rank: int, source: int, world_size: int, local_len: int,
                      cu_seqlens: Boundaries) -> tuple[BlockTask, ...]:
    """:func:`ring_step_tasks` restricted to pairs inside one document of ``cu_seqlens``.

    ``document_zigzag`` is zigzag inside each document, so its blocks are zigzag's, per
    document. For the other layouts each block of the plain schedule is cut by the
    documents; a causal block's frame (query i vs key i) makes each cut an interval pair.
    """
    positions = layout_positions(layout, world_size, local_len * world_size, cu_seqlens)
    q_runs, kv_runs = _document_runs(positions[rank], cu_seqlens), _document_runs(positions[source], cu_seqlens)
    tasks: list[BlockTask] = []
    if layout == "document_zigzag":
        for doc, (qa, qb) in q_runs.items():
            tasks.extend(_shifted(t, qa, kv_runs[doc][0]) for t in ring_step_tasks("zigzag", causal, rank, source, qb - qa))
        return tuple(tasks)
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
               cu_seqlens: Boundaries | None) -> tuple[BlockTask, ...]:
    """The blocks of one ring step, with or without documents."""
    if cu_seqlens is None:
        return ring_step_tasks(layout, causal, rank, source, local_len)
    return packed_step_tasks(layout, causal, rank, source, world_size, local_len, cu_seqlens)


def causal_work_per_rank(layout: str, world_size: int, local_len: int, causal: bool = True,
                         cu_seqlens: Boundaries | None = None) -> list[int]:
    """(query, key) pairs each ring rank computes over a whole ring pass: the load balance."""
    return [
        sum(
            task.visible_pairs()
            for step in range(world_size)
            for task in step_tasks(layout, causal, rank, (rank - step) % world_size, world_size, local_len, cu_seqlens)
        )
        for rank in range(world_size)
    ]
