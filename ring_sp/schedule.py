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
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .layouts import LAYOUTS, Boundaries, layout_positions, ring_positions


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


def _shifted(task: BlockTask, q_offset: int, kv_offset: int) -> BlockTask:
    return BlockTask(slice(task.q.start + q_offset, task.q.stop + q_offset),
                     slice(task.kv.start + kv_offset, task.kv.stop + kv_offset), task.causal, task.window)


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


def _position_run_tensors(positions: torch.Tensor, cu_seqlens: Boundaries | None, *,
                          consecutive: bool = True) -> tuple[torch.Tensor, ...]:
    """:func:`_position_runs` as LongTensors ``(local start, local stop, global start, document)``."""
    docs = (torch.searchsorted(torch.tensor(cu_seqlens), positions, right=True) - 1 if cu_seqlens is not None
            else torch.zeros_like(positions))
    breaks = docs.diff() != 0
    if consecutive:
        breaks |= positions.diff() != 1
    starts = torch.cat((torch.zeros(1, dtype=torch.long), breaks.nonzero().flatten() + 1))
    stops = torch.cat((starts[1:], torch.tensor([positions.numel()])))
    return starts, stops, positions[starts], docs[starts]


def _position_runs(positions: torch.Tensor, cu_seqlens: Boundaries | None, *,
                   consecutive: bool = True) -> list[tuple[int, int, int, int]]:
    """A shard's runs ``(local start, local stop, global position of the start, document)``:
    cut where the document of ``cu_seqlens`` changes (None: one document, id 0) and, with
    ``consecutive``, where the global position is not its predecessor's + 1. Vectorised."""
    if positions.numel() == 0:
        return []
    return list(zip(*(t.tolist() for t in _position_run_tensors(positions, cu_seqlens, consecutive=consecutive))))


@dataclass(frozen=True)
class _ShardRuns:
    """A ring shard's runs of consecutive global positions inside one document, in local
    order (so documents never decrease): LongTensors ``[runs]`` of the global ``start`` and
    ``stop``, the ``local`` index of the start and the ``doc`` id."""

    start: torch.Tensor
    stop: torch.Tensor
    local: torch.Tensor
    doc: torch.Tensor

    @staticmethod
    def of(positions: torch.Tensor, cu_seqlens: Boundaries) -> _ShardRuns:
        local, local_stop, start, doc = _position_run_tensors(positions, cu_seqlens)
        return _ShardRuns(start, start + (local_stop - local), local, doc)

    def doc_spans(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(document, local start, local stop) of each document: its runs are stored one after the other."""
        docs, counts = torch.unique_consecutive(self.doc, return_counts=True)
        last = counts.cumsum(0) - 1
        first = last - counts + 1
        return docs, self.local[first], self.local[last] + self.stop[last] - self.start[last]


@functools.lru_cache(maxsize=8)  # keyed by the documents: a new packing can come every step
def _ring_runs(ulysses_size: int, ring_size: int, seq_len: int, cu_seqlens: Boundaries) -> tuple[_ShardRuns, ...]:
    """:class:`_ShardRuns` of every ring shard of ``document_zigzag``, once per packing."""
    positions = ring_positions("document_zigzag", ulysses_size, ring_size, seq_len, cu_seqlens)
    return tuple(_ShardRuns.of(row, cu_seqlens) for row in positions)


_new_tuple = tuple.__new__

# Blocks as parallel LongTensors (q start, q stop, kv start, kv stop, causal as 0/1): the
# document schedule has a block or more per document and step, so it is cut and merged
# vectorised and turned into BlockTasks once, at the end.
_Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _tasks_of(blocks: _Blocks, group: torch.Tensor | None = None) -> list[tuple[BlockTask, ...]]:
    """The blocks as BlockTasks, one tuple per distinct ``group`` value in increasing order
    (blocks sorted by group; None: one group)."""
    qa, qb, ka, kb, causal = (t.tolist() for t in blocks)
    # tuple.__new__ straight: a NamedTuple's own __new__ is one more Python call per block (a third of this loop)
    tasks = [_new_tuple(BlockTask, fields) for fields in
             zip(map(slice, qa, qb), map(slice, ka, kb), map((1).__eq__, causal), itertools.repeat(None))]
    if group is None:
        return [tuple(tasks)]
    ends = torch.unique_consecutive(group, return_counts=True)[1].cumsum(0).tolist()
    return [tuple(tasks[a:b]) for a, b in zip([0] + ends, ends)]


def _sorted_by(blocks: _Blocks, group: torch.Tensor, first: torch.Tensor,
               second: torch.Tensor) -> tuple[_Blocks, torch.Tensor]:
    """Blocks (and their ``group``) sorted by (group, first, second) (unique: blocks of a group do not overlap)."""
    if first.numel() == 0:
        return blocks, group
    scale = int(max(first.max(), second.max())) + 1
    order = torch.argsort((group * scale + first) * scale + second)
    return tuple(t[order] for t in blocks), group[order]  # type: ignore[return-value]


def _merged_along(blocks: _Blocks, group: torch.Tensor, along: int) -> tuple[_Blocks, torch.Tensor]:
    """One pass of :func:`_merged`: full blocks of one group with the same other side (``along``
    0: the same keys, adjacent query rows; 1: the same queries, adjacent keys) become one."""
    if blocks[0].numel() == 0:
        return blocks, group
    same = 2 - 2 * along  # index of the other side's start
    blocks, group = _sorted_by(blocks, group, blocks[same], blocks[2 * along])
    a0, a1, s0, s1, causal = blocks[2 * along], blocks[2 * along + 1], blocks[same], blocks[same + 1], blocks[4]
    # block i extends block i - 1: as the greedy merge, whose grown block ends where block i - 1 ends
    joins = ((causal[1:] == 0) & (causal[:-1] == 0) & (group[1:] == group[:-1]) & (s0[1:] == s0[:-1])
             & (s1[1:] == s1[:-1]) & (a1[:-1] == a0[1:]))
    starts = torch.cat((torch.ones(1, dtype=torch.bool), ~joins)).nonzero().flatten()
    lasts = torch.cat((starts[1:], torch.tensor([a0.numel()]))) - 1  # the last block of each chain
    grown = [t[starts] for t in blocks]
    grown[2 * along + 1] = a1[lasts]
    return tuple(grown), group[starts]  # type: ignore[return-value]


def _merged(blocks: _Blocks, group: torch.Tensor) -> tuple[_Blocks, torch.Tensor]:
    """Per ``group``: full blocks that touch along one side become one (fewer kernel calls):
    the same keys for adjacent query rows, then the same queries for adjacent keys; sorted
    by (group, q start, kv start)."""
    blocks, group = _merged_along(*_merged_along(blocks, group, 0), 1)
    return _sorted_by(blocks, group, blocks[0], blocks[2])


def _interval_pieces(qa: torch.Tensor, qb: torch.Tensor, ka: torch.Tensor,
                     kb: torch.Tensor) -> tuple[_Blocks, torch.Tensor]:
    """:func:`_interval_blocks` (causal) of many interval pairs at once, in their frame, and
    the pair each block comes from."""
    start, edge = torch.maximum(ka, qa), torch.minimum(kb, qb)
    pieces = [  # (q start, q stop, kv start, kv stop, causal, which pairs have it)
        (qa, qb, ka, torch.minimum(kb, qa), 0, ka < torch.minimum(kb, qa)),  # keys before every query: all visible
        (start, edge, start, edge, 1, start < edge),  # the shared stretch: a square causal block
        (kb, qb, start, kb, 0, (start < kb) & (kb < qb)),  # queries after every key of the stretch
    ]
    blocks = tuple(torch.cat([(p[i] if i < 4 else torch.full_like(qa, p[4]))[p[5]] for p in pieces]) for i in range(5))
    return blocks, torch.cat([p[5].nonzero().flatten() for p in pieces])  # type: ignore[return-value]


def _document_zigzag_steps(causal: bool, runs: tuple[_ShardRuns, ...], rank: int,
                           sources: list[int]) -> list[tuple[BlockTask, ...]]:
    """The blocks of ring rank ``rank`` against the KV shard of each of ``sources``, from the
    ring shards' runs; vectorised over the runs of every source at once (a step's blocks
    are a few per document, and a Python loop over them would cost more than the layer)."""
    steps: dict[int, tuple[BlockTask, ...]] = {}
    q = runs[rank]
    for source in sources:
        if source == rank or not causal:  # per document, all of its queries against all of its keys
            # on the diagonal the local order is the global order: one square causal block per document
            q_docs, q_start, q_stop = q.doc_spans()
            kv_docs, kv_start, kv_stop = runs[source].doc_spans()
            shared = torch.isin(q_docs, kv_docs)
            at = torch.searchsorted(kv_docs, q_docs[shared])
            steps[source] = _tasks_of((q_start[shared], q_stop[shared], kv_start[at], kv_stop[at],
                                       torch.full_like(at, int(causal))))[0]
    others = [s for s in sources if s not in steps]
    if others:
        # every (query run, key run) pair of one document, cut in global coordinates, then made local
        kv = [runs[s] for s in others]
        kv_doc = torch.cat([r.doc for r in kv])
        by_doc = torch.argsort(kv_doc, stable=True)
        kv_doc = kv_doc[by_doc]
        kv_start, kv_stop, kv_local = (torch.cat([getattr(r, f) for r in kv])[by_doc] for f in ("start", "stop", "local"))
        kv_source = torch.tensor(others).repeat_interleave(torch.tensor([r.doc.numel() for r in kv]))[by_doc]
        lo, hi = torch.searchsorted(kv_doc, q.doc), torch.searchsorted(kv_doc, q.doc, right=True)
        counts = hi - lo
        qi = torch.arange(q.doc.numel()).repeat_interleave(counts)
        ki = lo[qi] + torch.arange(qi.numel()) - (counts.cumsum(0) - counts)[qi]
        (qa, qb, ka, kb, flag), pair = _interval_pieces(q.start[qi], q.stop[qi], kv_start[ki], kv_stop[ki])
        q_shift, kv_shift = (q.local - q.start)[qi[pair]], (kv_local - kv_start)[ki[pair]]
        merged, source = _merged((qa + q_shift, qb + q_shift, ka + kv_shift, kb + kv_shift, flag), kv_source[ki[pair]])
        found = torch.unique_consecutive(source).tolist()  # sources sharing no document get no block
        steps.update(dict.fromkeys(others, ()))
        steps.update(zip(found, _tasks_of(merged, source)))
    return [steps[s] for s in sources]


def document_zigzag_steps(causal: bool, rank: int, sources: list[int], world_size: int, local_len: int,
                          cu_seqlens: Boundaries, ulysses_size: int = 1) -> list[tuple[BlockTask, ...]]:
    """:func:`packed_step_tasks` of ``document_zigzag`` against each of ``sources`` (all
    steps of a ring pass in one vectorised build)."""
    seq_len = local_len * world_size
    ring_positions("document_zigzag", ulysses_size, world_size, seq_len, cu_seqlens)  # validates (cached)
    return _document_zigzag_steps(causal, _ring_runs(ulysses_size, world_size, seq_len, cu_seqlens), rank, sources)


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
        return document_zigzag_steps(causal, rank, [source], world_size, local_len, cu_seqlens, ulysses_size)[0]
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
               cu_seqlens: Boundaries | None, *, ulysses_size: int = 1, window: int | None = None,
               native_window: bool = False) -> tuple[BlockTask, ...]:
    """The blocks of one ring step, with or without documents and a sliding ``window``
    (causal only; ``native_window``: the kernel takes band blocks, see :func:`window_step_tasks`).
    ``ulysses_size``: the Ulysses group size ``U`` of the grid, which the ring shards of
    ``document_zigzag`` with uneven documents depend on (:func:`ring_sp.layouts.ring_positions`)."""
    if window is not None:
        return window_step_tasks(layout, rank, source, world_size, local_len, window, cu_seqlens, native_window,
                                 ulysses_size=ulysses_size)
    if cu_seqlens is None:
        return ring_step_tasks(layout, causal, rank, source, local_len)
    return packed_step_tasks(layout, causal, rank, source, world_size, local_len, cu_seqlens, ulysses_size)


def causal_work_per_rank(layout: str, world_size: int, local_len: int, causal: bool = True,
                         cu_seqlens: Boundaries | None = None, ulysses_size: int = 1,
                         window: int | None = None) -> list[int]:
    """(query, key) pairs each ring rank computes over a whole ring pass: the load balance."""
    return [
        sum(
            task.visible_pairs()
            for step in range(world_size)
            for task in step_tasks(layout, causal, rank, (rank - step) % world_size, world_size, local_len, cu_seqlens,
                                   ulysses_size=ulysses_size, window=window)
        )
        for rank in range(world_size)
    ]


# ---------------------------------------------------------------------------------------------
# Sliding windows: query i sees key j iff i - window < j <= i (and, packed, the same document).
#
# Each shard is cut into RUNS of consecutive coordinates in one frame: global positions for
# contiguous, zigzag and document_zigzag (one or two runs per shard, two per document), and
# for striped the local index itself (rank r's a-th token is r + R*a, so the window becomes a
# band of ceil((window - (r - s)) / R) local tokens). A pair of runs is a block between two
# intervals of that frame, i.e. a BAND; :func:`band_blocks` covers it exactly with full
# rectangles, square causal blocks and square "edge" blocks (key c >= query a). Kernels
# without a window argument get edge blocks only (the fused torch ops flip both sequences
# and run their causal mask); kernels with one (flash-attn, reference) take the band whole.
# Nothing here builds a mask tensor, so memory stays O(block) whatever the window.
# ---------------------------------------------------------------------------------------------


def band_blocks(q: tuple[int, int], kv: tuple[int, int], window: int, native_window: bool = False) -> list[BlockTask]:
    """Blocks covering exactly the pairs (i, j), ``i`` in query interval ``q`` and ``j`` in key
    interval ``kv`` (half-open, one frame), with ``i - window < j <= i``. Slices are in that frame."""
    if window < 1:
        return []
    return [piece for block in _interval_blocks(q, kv, True) for piece in _lower_edge(block, window, native_window)]


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


def _runs(positions: torch.Tensor, frame_start: int | None, cu_seqlens: Boundaries | None) -> list[_Run]:
    """A shard's runs of consecutive global positions (``frame_start`` None), or, for striped,
    its one run in the local frame starting at ``frame_start``; cut at document boundaries."""
    if frame_start is None:
        return _position_runs(positions, cu_seqlens)
    # striped: the local frame advances one per local token; only documents cut it
    return [(a, b, frame_start + a, doc) for a, b, _, doc in _position_runs(positions, cu_seqlens, consecutive=False)]


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
    positions = ring_positions(layout, ulysses_size, world_size, local_len * world_size, cu_seqlens)
    if layout == "striped" and world_size > 1:
        # query a (position rank + R*a) vs key c (source + R*c): c <= a (source <= rank) or
        # c <= a - 1 (source > rank); c > a - ceil((window - (rank - source)) / R).
        shift = 1 if source > rank else 0
        frame_window = -(-(window - (rank - source)) // world_size) - shift
        q_runs, kv_runs = _runs(positions[rank], -shift, cu_seqlens), _runs(positions[source], 0, cu_seqlens)
    else:
        frame_window = window
        q_runs, kv_runs = _runs(positions[rank], None, cu_seqlens), _runs(positions[source], None, cu_seqlens)
    tasks: list[BlockTask] = []
    for qa, qb, qf, qdoc in q_runs:
        for ka, kb, kf, kdoc in kv_runs:
            if qdoc != kdoc or kf > qf + (qb - qa) - 1 or kf + (kb - ka) - 1 <= qf - frame_window:
                continue  # other document, keys all in the future, or all before the window
            for t in band_blocks((qf, qf + qb - qa), (kf, kf + kb - ka), frame_window, native_window):
                tasks.append(_shifted(t, qa - qf, ka - kf))
    return tuple(tasks)


Rows = tuple[int, int]  # a [start, stop) range of a shard's local tokens


@dataclass(frozen=True)
class ExchangePlan:
    """One ring rank's whole pass: the blocks of each step ``t`` (against the KV of rank
    ``rank - t``, slices in that shard's local order) and, per step, the rows of that KV
    shard it receives (``recv_rows``) and the rows of its own shard it sends to ``rank + t``
    (``send_rows``; None: no message). Without a window every step moves the whole shard
    (the full ring of DESIGN section 5); with one, only the halo partners exchange, and only
    the rows some block of the partner reads (their hull)."""

    schedule: tuple[tuple[BlockTask, ...], ...]
    recv_rows: tuple[Rows | None, ...]
    send_rows: tuple[Rows | None, ...]

    @property
    def receives(self) -> tuple[bool, ...]:
        return tuple(rows is not None for rows in self.recv_rows)

    @property
    def sends(self) -> tuple[bool, ...]:
        return tuple(rows is not None for rows in self.send_rows)


def _kv_hull(tasks: tuple[BlockTask, ...]) -> Rows | None:
    """The smallest row range of the KV shard holding every block's keys (None: no block)."""
    return (min(t.kv.start for t in tasks), max(t.kv.stop for t in tasks)) if tasks else None


def exchange_plan(layout: str, causal: bool, rank: int, world_size: int, local_len: int,
                  cu_seqlens: Boundaries | None = None, window: int | None = None,
                  native_window: bool = False, *, ulysses_size: int = 1) -> ExchangePlan:
    """The :class:`ExchangePlan` of ring rank ``rank`` (pure: every rank can compute any rank's)."""

    def tasks(r: int, step: int) -> tuple[BlockTask, ...]:
        return step_tasks(layout, causal, r, (r - step) % world_size, world_size, local_len, cu_seqlens,
                          ulysses_size=ulysses_size, window=window, native_window=native_window)

    if window is None and layout == "document_zigzag" and cu_seqlens is not None:  # all steps in one build
        sources = [(rank - step) % world_size for step in range(world_size)]
        schedule = tuple(document_zigzag_steps(causal, rank, sources, world_size, local_len, cu_seqlens, ulysses_size))
    else:
        schedule = tuple(tasks(rank, step) for step in range(world_size))
    if window is None:
        every = ((0, local_len),) * world_size
        return ExchangePlan(schedule, every, every)
    receives = tuple(_kv_hull(t) for t in schedule)
    sends = tuple(_kv_hull(tasks((rank + step) % world_size, step)) for step in range(world_size))
    return ExchangePlan(schedule, receives, sends)
