"""Packed sequences (``cu_seqlens``): the blocks of a ring step cut per document.

A token sees only its own document. In every layout a document is one contiguous run of
each shard, so each step's blocks are cut per document (:func:`packed_step_tasks`); steps
sharing no document compute nothing, and no mask tensor is ever built. ``document_zigzag``
(documents of any length, chunks differing by a token) is scheduled from the ring ranks'
runs alone: a ring shard is a union of runs of consecutive global positions, stored in
increasing order, so each (query run, key run) pair of a document is cut in GLOBAL
coordinates by :func:`~.blocks.interval_blocks` and shifted to local indices. Ranks hold
disjoint tokens, so only the diagonal step has masked blocks (one square causal block per
document); every other block is full. Every shard comes as :class:`~ring_sp.layouts.ShardRuns`
and is cut at documents by :func:`shard_pieces`: O(runs + documents) per rank, no position of
any token is built.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layouts import DOCUMENT_LAYOUTS, Boundaries, shard_runs
from ..runs import ShardRuns, memoised
from .blocks import BlockTask, interval_blocks, ring_step_tasks, shifted


def shard_pieces(runs: ShardRuns, cu_seqlens: Boundaries | None, *,
                 consecutive: bool = True) -> tuple[torch.Tensor, ...]:
    """:func:`position_runs` of a shard given as :class:`~ring_sp.layouts.ShardRuns`, as LongTensors
    ``(local start, local stop, global start, document)``: each run cut at the documents it
    crosses, neighbours merged back as :func:`position_runs` would. O(runs + documents crossed):
    no position of any token is built. ``consecutive`` needs unit-stride runs (a striped shard
    has no two consecutive positions)."""
    assert not consecutive or runs.stride == 1, "consecutive pieces of a strided shard are single tokens"
    stride, keep = runs.stride, runs.length > 0
    local = (runs.length.cumsum(0) - runs.length)[keep]
    start, length = runs.start[keep], runs.length[keep]
    if cu_seqlens is None:
        run, lo, hi, doc = torch.arange(start.numel()), torch.zeros_like(start), length, torch.zeros_like(start)
    else:
        bounds = torch.tensor(cu_seqlens)
        first = torch.searchsorted(bounds, start, right=True) - 1  # the documents of each run's ends
        counts = torch.searchsorted(bounds, start + stride * (length - 1), right=True) - first
        run = torch.repeat_interleave(torch.arange(start.numel()), counts)
        doc = first[run] + torch.arange(run.numel()) - (counts.cumsum(0) - counts)[run]

        def offset(edge: torch.Tensor) -> torch.Tensor:  # the run's first local index at or after ``edge``
            return torch.minimum(((edge - start[run]).clamp(min=0) + stride - 1) // stride, length[run])

        lo, hi = offset(bounds[doc]), offset(bounds[doc + 1])
        some = hi > lo  # empty documents, and striped documents this rank holds no token of
        run, lo, hi, doc = run[some], lo[some], hi[some], doc[some]
    begin, end, at = local[run] + lo, local[run] + hi, start[run] + stride * lo
    if begin.numel() == 0:
        return begin, end, at, doc
    joins = doc[1:] == doc[:-1]  # pieces tile the shard in local order: merge within a document
    if consecutive:
        joins &= at[1:] == at[:-1] + (end[:-1] - begin[:-1])
    heads = torch.cat((torch.ones(1, dtype=torch.bool), ~joins)).nonzero().flatten()
    lasts = torch.cat((heads[1:], torch.tensor([begin.numel()]))) - 1
    return begin[heads], end[lasts], at[heads], doc[heads]


def _document_runs(runs: ShardRuns, cu_seqlens: Boundaries) -> dict[int, tuple[int, int]]:
    """Document id -> its (start, stop) run of local indices (positions are increasing)."""
    begin, end, _, docs = shard_pieces(runs, cu_seqlens, consecutive=False)
    return {d: (a, b) for a, b, d in zip(begin.tolist(), end.tolist(), docs.tolist())}


def _position_run_tensors(positions: torch.Tensor, cu_seqlens: Boundaries | None, *,
                          consecutive: bool = True) -> tuple[torch.Tensor, ...]:
    """:func:`position_runs` as LongTensors ``(local start, local stop, global start, document)``."""
    docs = (torch.searchsorted(torch.tensor(cu_seqlens), positions, right=True) - 1 if cu_seqlens is not None
            else torch.zeros_like(positions))
    breaks = docs.diff() != 0
    if consecutive:
        breaks |= positions.diff() != 1
    starts = torch.cat((torch.zeros(1, dtype=torch.long), breaks.nonzero().flatten() + 1))
    stops = torch.cat((starts[1:], torch.tensor([positions.numel()])))
    return starts, stops, positions[starts], docs[starts]


def position_runs(positions: torch.Tensor, cu_seqlens: Boundaries | None, *,
                  consecutive: bool = True) -> list[tuple[int, int, int, int]]:
    """A shard's runs ``(local start, local stop, global position of the start, document)``:
    cut where the document of ``cu_seqlens`` changes (None: one document, id 0) and, with
    ``consecutive``, where the global position is not its predecessor's + 1. Vectorised.
    (The schedule cuts a rank's :class:`~ring_sp.layouts.ShardRuns` instead: :func:`shard_pieces`.)"""
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
    def of(runs: ShardRuns, cu_seqlens: Boundaries) -> _ShardRuns:
        local, local_stop, start, doc = shard_pieces(runs, cu_seqlens)
        return _ShardRuns(start, start + (local_stop - local), local, doc)

    def doc_spans(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(document, local start, local stop) of each document: its runs are stored one after the other."""
        docs, counts = torch.unique_consecutive(self.doc, return_counts=True)
        last = counts.cumsum(0) - 1
        first = last - counts + 1
        return docs, self.local[first], self.local[last] + self.stop[last] - self.start[last]


@memoised(documents=64)  # keyed by the documents (a new packing can come every step) and the ring rank
def ring_runs(layout: str, ulysses_size: int, ring_size: int, seq_len: int, cu_seqlens: Boundaries | None,
              ring_rank: int) -> _ShardRuns:
    """:class:`_ShardRuns` of ring rank ``ring_rank``'s shard (unit-stride layouts): O(runs + documents),
    built once per packing and rank for every step and pair of a pass."""
    return _ShardRuns.of(shard_runs(layout, ulysses_size, ring_size, seq_len, ring_rank, cu_seqlens), cu_seqlens)


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
             zip(map(slice, qa, qb), map(slice, ka, kb), map((1).__eq__, causal), itertools.repeat(None), itertools.repeat(0))]
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
    """:func:`interval_blocks` (causal) of many interval pairs at once, in their frame, and
    the pair each block comes from."""
    start, edge = torch.maximum(ka, qa), torch.minimum(kb, qb)
    pieces = [  # (q start, q stop, kv start, kv stop, causal, which pairs have it)
        (qa, qb, ka, torch.minimum(kb, qa), 0, ka < torch.minimum(kb, qa)),  # keys before every query: all visible
        (start, edge, start, edge, 1, start < edge),  # the shared stretch: a square causal block
        (kb, qb, start, kb, 0, (start < kb) & (kb < qb)),  # queries after every key of the stretch
    ]
    blocks = tuple(torch.cat([(p[i] if i < 4 else torch.full_like(qa, p[4]))[p[5]] for p in pieces]) for i in range(5))
    return blocks, torch.cat([p[5].nonzero().flatten() for p in pieces])  # type: ignore[return-value]


def matching_pairs(q_ids: torch.Tensor, kv_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (i, j) with ``q_ids[i] == kv_ids[j]`` (``kv_ids`` sorted), as index LongTensors, by
    i then j: the (query run, key run) pairs of one document (or span), vectorised."""
    lo, hi = torch.searchsorted(kv_ids, q_ids), torch.searchsorted(kv_ids, q_ids, right=True)
    counts = hi - lo
    qi = torch.arange(q_ids.numel()).repeat_interleave(counts)
    return qi, lo[qi] + torch.arange(qi.numel()) - (counts.cumsum(0) - counts)[qi]


def _pair_steps(causal: bool, runs: Callable[[int], _ShardRuns], documents: int,
                pairs: list[tuple[int, int]]) -> list[tuple[BlockTask, ...]]:
    """The blocks of each ``(query rank, key rank)`` pair, from the ring shards' runs; vectorised
    over the runs of every pair at once (a step's blocks are a few per document, and a Python
    loop over them would cost more than the layer). ``documents``: how many there are."""
    steps: dict[int, tuple[BlockTask, ...]] = {}
    for at, (rank, source) in enumerate(pairs):
        if source == rank or not causal:  # per document, all of its queries against all of its keys
            # on the diagonal the local order is the global order: one square causal block per document
            q_docs, q_start, q_stop = runs(rank).doc_spans()
            kv_docs, kv_start, kv_stop = runs(source).doc_spans()
            shared = torch.isin(q_docs, kv_docs)
            kv_at = torch.searchsorted(kv_docs, q_docs[shared])
            steps[at] = _tasks_of((q_start[shared], q_stop[shared], kv_start[kv_at], kv_stop[kv_at],
                                   torch.full_like(kv_at, int(causal))))[0]
    others = [at for at in range(len(pairs)) if at not in steps]
    if others:
        # every (query run, key run) pair of one document and one rank pair, cut in global
        # coordinates, then made local; keys: (rank pair, document), so one match serves all pairs
        q_parts, kv_parts = [runs(pairs[at][0]) for at in others], [runs(pairs[at][1]) for at in others]

        def joined(parts: list[_ShardRuns]) -> tuple[torch.Tensor, ...]:
            pair = torch.arange(len(parts)).repeat_interleave(torch.tensor([r.doc.numel() for r in parts]))
            return (pair, pair * (documents + 1) + torch.cat([r.doc for r in parts]),
                    *(torch.cat([getattr(r, f) for r in parts]) for f in ("start", "stop", "local")))

        _, q_key, q_start, q_stop, q_local = joined(q_parts)
        kv_pair, kv_key, kv_start, kv_stop, kv_local = joined(kv_parts)
        by_key = torch.argsort(kv_key, stable=True)
        kv_pair, kv_key, kv_start, kv_stop, kv_local = (t[by_key] for t in (kv_pair, kv_key, kv_start, kv_stop, kv_local))
        qi, ki = matching_pairs(q_key, kv_key)
        (qa, qb, ka, kb, flag), pair = _interval_pieces(q_start[qi], q_stop[qi], kv_start[ki], kv_stop[ki])
        q_shift, kv_shift = (q_local - q_start)[qi[pair]], (kv_local - kv_start)[ki[pair]]
        merged, group = _merged((qa + q_shift, qb + q_shift, ka + kv_shift, kb + kv_shift, flag), kv_pair[ki[pair]])
        found = torch.unique_consecutive(group).tolist()  # pairs sharing no document get no block
        steps.update(dict.fromkeys(others, ()))
        steps.update(zip((others[g] for g in found), _tasks_of(merged, group)))
    return [steps[at] for at in range(len(pairs))]


def document_steps(layout: str, causal: bool, pairs: list[tuple[int, int]], world_size: int, local_len: int,
                   cu_seqlens: Boundaries, ulysses_size: int = 1) -> list[tuple[BlockTask, ...]]:
    """:func:`packed_step_tasks` of a document layout (``document_zigzag``, ``document_balanced``)
    for each ``(query ring rank, key ring rank)`` of ``pairs``, in one vectorised build."""
    seq_len = local_len * world_size
    shard_runs(layout, ulysses_size, world_size, seq_len, 0, cu_seqlens)  # validates (cached)
    if not all(0 <= r < world_size for pair in pairs for r in pair):
        raise ValueError(f"pairs={pairs} must all be ring ranks in [0, {world_size})")
    return _pair_steps(causal, functools.partial(ring_runs, layout, ulysses_size, world_size, seq_len, cu_seqlens),
                       len(cu_seqlens) - 1, pairs)


def document_zigzag_steps(causal: bool, rank: int, sources: list[int], world_size: int, local_len: int,
                          cu_seqlens: Boundaries, ulysses_size: int = 1) -> list[tuple[BlockTask, ...]]:
    """:func:`packed_step_tasks` of ``document_zigzag`` against each of ``sources`` (all
    steps of a ring pass in one vectorised build)."""
    return document_steps("document_zigzag", causal, [(rank, source) for source in sources], world_size, local_len,
                          cu_seqlens, ulysses_size)


def packed_step_tasks(layout: str, causal: bool, rank: int, source: int, world_size: int, local_len: int,
                      cu_seqlens: Boundaries, ulysses_size: int = 1) -> tuple[BlockTask, ...]:
    """:func:`ring_step_tasks` restricted to pairs inside one document of ``cu_seqlens``.

    ``world_size`` is the ring size ``R`` and ``local_len`` the ring shard length (after
    the Ulysses all-to-all over ``ulysses_size`` ranks: ``U`` times the SP shard).
    The document layouts (``document_zigzag``, ``document_balanced``) are cut from the ring
    shards' global runs (module docstring). For the other layouts each block of the plain
    schedule is cut by the documents; a causal block's frame (query i vs key i) makes each
    cut an interval pair.
    """
    seq_len = local_len * world_size
    if layout in DOCUMENT_LAYOUTS:
        return document_steps(layout, causal, [(rank, source)], world_size, local_len, cu_seqlens, ulysses_size)[0]
    # a plain layout's ring shard is its shard over the R ring ranks (striped: U > 1 only with R == 1)
    q_runs, kv_runs = (_document_runs(shard_runs(layout, 1, world_size, seq_len, r, cu_seqlens), cu_seqlens)
                       for r in (rank, source))
    tasks: list[BlockTask] = []
    for base in ring_step_tasks(layout, causal, rank, source, local_len):
        for doc, (qa, qb) in q_runs.items():
            if doc not in kv_runs:
                continue
            ka, kb = kv_runs[doc]
            q = (max(qa, base.q.start) - base.q.start, min(qb, base.q.stop) - base.q.start)
            kv = (max(ka, base.kv.start) - base.kv.start, min(kb, base.kv.stop) - base.kv.start)
            if q[0] < q[1] and kv[0] < kv[1]:
                tasks.extend(shifted(b, base.q.start, base.kv.start) for b in interval_blocks(q, kv, base.causal))
    return tuple(tasks)
