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
"""

from __future__ import annotations

from dataclasses import dataclass

from .layouts import LAYOUTS


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
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


def causal_work_per_rank(layout: str, world_size: int, local_len: int, causal: bool = True) -> list[int]:
    """(query, key) pairs each ring rank computes over a whole ring pass: the load balance."""
    return [
        sum(
            task.visible_pairs()
            for step in range(world_size)
            for task in ring_step_tasks(layout, causal, rank, (rank - step) % world_size, local_len)
        )
        for rank in range(world_size)
    ]
