"""Bidirectional spans (:mod:`ring_sp.spans`): the blocks a span adds to a ring step.

With spans the mask is the causal (documents, window) mask OR each span's UPPER part: the
pairs (query i, key j) of one span with ``j > i``. The two are disjoint (``j <= i`` against
``j > i``), and a window never cuts the upper part (it only bounds keys before the query), so
a step's blocks are the plain schedule's (:mod:`.documents`, :mod:`.windows`) plus the blocks
of :func:`span_step_tasks`, which cover exactly the upper pairs of every span between the
query and the key shard:

* each shard is cut into pieces of one span (:func:`~.documents.shard_pieces` with the span
  edges as boundaries), in a frame where the upper pairs are ``key frame > query frame``:
  global positions for contiguous, zigzag and document_zigzag, and for striped the local
  index (rank r's a-th token is ``r + R*a``: a key of rank s > r at local c is later iff
  ``c >= a``, of s <= r iff ``c > a``, so queries sit one lower in the frame when s > r);
* each (query piece, key piece) pair of one span gives at most three blocks: the rows before
  every key see all keys (full), the shared stretch's rows see the keys after it (full), and
  the stretch's strict upper triangle is the EDGE block (``causal=False, window=1``: key
  ``c >= a`` on rows ``[s, e-1)`` against keys ``[s+1, e)``), which every kernel takes.

Pairs computed are exactly the pairs the mask needs (no block overlaps another or the plain
schedule's); no mask tensor is built, and no key is read that the causal ring does not
already carry to the rank (the KV exchange is the causal case's; with a window the halo
widens to the span keys a rank needs, :func:`~.ring_pass.exchange_plan`'s hull).
"""

from __future__ import annotations

import torch

from ..layouts import LAYOUTS, Boundaries, shard_runs
from ..runs import ShardRuns
from ..spans import Spans
from .blocks import BlockTask
from .documents import matching_pairs, shard_pieces


def _span_pieces(shard: ShardRuns, edges: Boundaries, frame_offset: int | None) -> tuple[torch.Tensor, ...]:
    """The shard's pieces inside spans: LongTensors (local start, local stop, frame start, span index).
    ``edges`` = (0, start_0, stop_0, ..., N): odd pieces are spans. ``frame_offset`` None: the
    global frame (runs of consecutive positions); else the local frame shifted by it (striped)."""
    consecutive = frame_offset is None
    begin, end, at, piece = shard_pieces(shard, edges, consecutive=consecutive)
    inside = piece % 2 == 1
    begin, end, at, piece = begin[inside], end[inside], at[inside], piece[inside]
    return begin, end, (at if consecutive else begin + frame_offset), piece // 2


def _upper_blocks(qa: torch.Tensor, qb: torch.Tensor, ka: torch.Tensor,
                  kb: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Blocks covering exactly the pairs (i, j), i in ``[qa, qb)``, j in ``[ka, kb)`` (one frame),
    with ``j > i``, for many interval pairs at once: ((q start, q stop, kv start, kv stop,
    window 0/1), the pair each block comes from)."""
    s, e = torch.maximum(qa, ka), torch.minimum(qb, kb)
    before = torch.minimum(qb, ka)
    pieces = [  # (q start, q stop, kv start, kv stop, window, which pairs have it)
        (qa, before, ka, kb, 0, qa < before),  # rows before every key: all keys
        (s, e, e, kb, 0, (s < e) & (e < kb)),  # the shared stretch's rows: the keys after it
        (s, e - 1, s + 1, e, 1, e - s >= 2),  # the stretch's strict upper triangle: an edge square
    ]
    blocks = tuple(torch.cat([(p[i] if i < 4 else torch.full_like(qa, p[4]))[p[5]] for p in pieces]) for i in range(5))
    return blocks, torch.cat([p[5].nonzero().flatten() for p in pieces])


def span_step_tasks(layout: str, rank: int, source: int, world_size: int, local_len: int, spans: Spans,
                    cu_seqlens: Boundaries | None = None, *, ulysses_size: int = 1) -> tuple[BlockTask, ...]:
    """The blocks ring rank ``rank`` adds against the KV shard of ``source`` for the upper parts of
    ``spans`` (module docstring): slices in local order, disjoint from :func:`~.ring_pass.step_tasks`'
    causal blocks. ``cu_seqlens``: the documents (``document_zigzag``'s shards depend on them).
    O(spans + runs), vectorised; an empty tuple when the two shards share no span pair."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    seq_len = local_len * world_size
    q_shard, kv_shard = (shard_runs(layout, ulysses_size, world_size, seq_len, r, cu_seqlens) for r in (rank, source))
    edges = (0, *spans, seq_len)
    strided = q_shard.stride > 1  # striped over the ring: the local frame (module docstring)
    q_offset, kv_offset = (-int(source > rank), 0) if strided else (None, None)
    q_begin, q_end, q_frame, q_span = _span_pieces(q_shard, edges, q_offset)
    kv_begin, kv_end, kv_frame, kv_span = _span_pieces(kv_shard, edges, kv_offset)
    qi, ki = matching_pairs(q_span, kv_span)
    (qa, qb, ka, kb, edge), pair = _upper_blocks(q_frame[qi], q_frame[qi] + (q_end - q_begin)[qi], kv_frame[ki],
                                                 kv_frame[ki] + (kv_end - kv_begin)[ki])
    q_shift, kv_shift = (q_begin - q_frame)[qi[pair]], (kv_begin - kv_frame)[ki[pair]]
    rows = zip((qa + q_shift).tolist(), (qb + q_shift).tolist(), (ka + kv_shift).tolist(), (kb + kv_shift).tolist(),
               edge.tolist())
    return tuple(BlockTask(slice(a, b), slice(c, d), False, 1 if w else None) for a, b, c, d, w in rows)
