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

Every masked block is square, so kernels' top-left/bottom-right conventions agree, except
the bands of :mod:`.windows` issued to kernels that take a window (``native_window``), which
say where their diagonal is (``BlockTask.diagonal``, :func:`bottom_right_window`).
:func:`interval_blocks` cuts the causal pairs of two intervals of one frame into such
blocks; packed documents (:mod:`.documents`) and sliding windows (:mod:`.windows`) build on it.
"""

from __future__ import annotations

from typing import NamedTuple

from ..layouts import DOCUMENT_LAYOUTS, LAYOUTS


class BlockTask(NamedTuple):
    """Attend queries ``q`` (a slice of the local shard) to keys ``kv`` (a slice of the
    visiting KV shard), with a square causal mask when ``causal``.

    In block coordinates (query ``a = row - q.start``, key ``c = key - kv.start``) the mask
    is the BAND ``lo < c - a <= hi``: ``hi = diagonal`` when ``causal`` (else none) and
    ``lo = diagonal - window`` when ``window`` (else none). ``diagonal`` is 0 and the block
    square for every kernel: ``window`` then adds the lower edge ``c > a - window`` (with
    ``causal`` the band ``a - window < c <= a``, issued only to kernels with a native window;
    ``window=1`` without it is the edge square ``c >= a`` where a window's start crosses the
    block). Kernels that take a window (``native_window``) also get bands whole between two
    intervals: any shape, any ``diagonal``, trimmed so that every row sees a key and every key
    is seen (see :func:`bottom_right_window`). A block with neither mask has ``diagonal`` 0.
    (A named tuple: a packed schedule has thousands, built once per packing, and a tuple is
    the cheapest immutable object to make.)
    """

    q: slice
    kv: slice
    causal: bool
    window: int | None = None
    diagonal: int = 0

    def band(self) -> tuple[int | None, int | None]:
        """``(lo, hi)`` of the mask ``lo < c - a <= hi`` in block coordinates (None: unbounded)."""
        return mask_band(self.causal, self.window, self.diagonal)

    def visible_pairs(self) -> int:
        """Number of (query, key) pairs this block computes: its share of the work."""
        nq = self.q.stop - self.q.start
        nk = self.kv.stop - self.kv.start
        if self.diagonal or (nq != nk and (self.causal or self.window is not None)):
            lo, hi = self.band()
            return band_pairs(nq, nk, lo, hi)
        if self.window is not None:  # square, window >= 1
            w, m = min(self.window, nq), max(nq - self.window, 0)
            if self.causal:  # rows a < w see a + 1 keys, the rest w
                return w * (w + 1) // 2 + m * w
            return nq * w + m * (m + 1) // 2 + m * (w - 1)  # rows a >= w see n - a + w - 1 keys
        return nq * (nq + 1) // 2 if self.causal else nq * nk


def mask_band(causal: bool, window: int | None, diagonal: int) -> tuple[int | None, int | None]:
    """``(lo, hi)`` of a block's mask ``lo < c - a <= hi`` (:class:`BlockTask`; None: unbounded)."""
    return (None if window is None else diagonal - window, diagonal if causal else None)


def band_pairs(nq: int, nk: int, lo: int | None, hi: int | None) -> int:
    """Pairs ``(a, c)`` of an ``nq x nk`` block with ``lo < c - a <= hi`` (None: unbounded), in O(1)."""

    def at_most(t: int | None) -> int:  # pairs with c - a <= t
        if t is None:
            return nq * nk
        # row a sees clamp(a + t + 1, 0, nk) keys: the sum of clamp(x, 0, nk) over x = t + 1 .. t + nq
        return _clamped_sum(t + nq + 1, nk) - _clamped_sum(t + 1, nk)

    return at_most(hi) - (0 if lo is None else at_most(lo))


def _clamped_sum(m: int, nk: int) -> int:
    """Sum of clamp(x, 0, nk) over x < m."""
    if m <= 0:
        return 0
    if m <= nk + 1:
        return m * (m - 1) // 2
    return nk * (nk + 1) // 2 + (m - nk - 1) * nk


def bottom_right_window(nq: int, nk: int, causal: bool, window: int | None, diagonal: int) -> tuple[int, int]:
    """The block's mask as the ``(left, right)`` window of flash-attention kernels, which align
    it to the bottom-right corner: query ``a`` sees keys ``a + nk - nq - left <= c <= a + nk -
    nq + right``, -1 meaning unbounded. A bound no row reaches is given as -1, so a plain causal
    square is ``(-1, 0)`` and a full block ``(-1, -1)``. Raises ``ValueError`` for a band that
    no such window states exactly (one whose last row does not see the last key, or whose
    right bound is ``>= nk`` yet still hides keys from the first rows: flash-attention turns a
    right window ``>= seqlen_k`` into "unbounded"; the schedule splits those bands) and for one
    with rows that see no key (flash-attention's lse is +inf there, ours -inf)."""
    lo, hi = mask_band(causal, window, diagonal)
    shift = nk - nq  # the bottom-right diagonal: c - a = nk - nq
    right = None if hi is None else hi - shift
    left = None if lo is None else shift - lo - 1
    if (right is not None and (right < 0 or nk <= right < nq - 1)) or (left is not None and left < 0):
        raise ValueError(f"the band {lo} < key - query <= {hi} of a {nq} x {nk} block has no exact "
                         f"bottom-right window (left={left}, right={right})")
    if (hi is not None and hi < 0) or (lo is not None and lo >= nk - 1):  # flash's lse would be +inf there
        raise ValueError(f"the band {lo} < key - query <= {hi} of a {nq} x {nk} block leaves its first rows without "
                         f"a key: trim it (ring_sp.schedule.windows does)")
    # a bound every row passes is no bound: right >= nq - 1 reaches the last key, left >= nk - 1 key 0
    right = -1 if right is None or right >= nq - 1 else right
    left = -1 if left is None or left >= nk - 1 else left
    return left, right


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
    if layout in DOCUMENT_LAYOUTS:
        raise ValueError(f"layout={layout!r} needs cu_seqlens: use step_tasks / packed_step_tasks")
    raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")


def shifted(task: BlockTask, q_offset: int, kv_offset: int) -> BlockTask:
    """``task`` moved by ``q_offset`` query rows and ``kv_offset`` keys (into another frame)."""
    return BlockTask(slice(task.q.start + q_offset, task.q.stop + q_offset),
                     slice(task.kv.start + kv_offset, task.kv.stop + kv_offset), task.causal, task.window,
                     task.diagonal)


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
