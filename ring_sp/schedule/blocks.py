"""Plain ring steps: which (query part, key part, mask) blocks a ring rank computes at each step.

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
:func:`interval_blocks` cuts the causal pairs of two intervals of one frame into such
blocks; packed documents (:mod:`.documents`) and sliding windows (:mod:`.windows`) build on it.
"""

from __future__ import annotations

from typing import NamedTuple

from ..layouts import LAYOUTS


class BlockTask(NamedTuple):
    """Attend queries ``q`` (a slice of the local shard) to keys ``kv`` (a slice of the
    visiting KV shard), with a square causal mask when ``causal``.

    ``window`` (sliding windows only) adds a lower edge on a SQUARE block: query ``a``
    sees key ``c`` only if ``c > a - window``. With ``causal`` that is the band
    ``a - window < c <= a`` (issued only to kernels with a native window); without it,
    ``window=1`` is the edge square ``c >= a`` where a window's start crosses the block.
    (A named tuple: a packed schedule has thousands, built once per packing, and a tuple is
    the cheapest immutable object to make.)
    """

    q: slice
    kv: slice
    causal: bool
    window: int | None = None

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs this block computes: its share of the work."""
        nq = self.q.stop - self.q.start
        nk = self.kv.stop - self.kv.start
        if self.window is not None:  # square, window >= 1
            w, m = min(self.window, nq), max(nq - self.window, 0)
            if self.causal:  # rows a < w see a + 1 keys, the rest w
                return w * (w + 1) // 2 + m * w
            return nq * w + m * (m + 1) // 2 + m * (w - 1)  # rows a >= w see n - a + w - 1 keys
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


def shifted(task: BlockTask, q_offset: int, kv_offset: int) -> BlockTask:
    """``task`` moved by ``q_offset`` query rows and ``kv_offset`` keys (into another frame)."""
    return BlockTask(slice(task.q.start + q_offset, task.q.stop + q_offset),
                     slice(task.kv.start + kv_offset, task.kv.stop + kv_offset), task.causal, task.window)


def interval_blocks(q: tuple[int, int], kv: tuple[int, int], causal: bool) -> list[BlockTask]:
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
