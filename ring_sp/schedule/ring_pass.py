"""A ring rank's whole pass: the blocks of any step (:func:`step_tasks`, whatever the
options), the work over a pass (:func:`causal_work_per_rank`, the load balance) and which
rows of KV each step receives and sends (:func:`exchange_plan`). Bidirectional spans add
their upper parts' blocks (:mod:`.spans`) to whatever the causal mask gives."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..layouts import DOCUMENT_LAYOUTS, Boundaries
from ..spans import Spans
from .blocks import BlockTask, ring_step_tasks
from .documents import document_steps, packed_step_tasks
from .ring_order import RingOrder
from .spans import span_step_tasks
from .windows import window_step_tasks


def step_tasks(layout: str, causal: bool, rank: int, source: int, world_size: int, local_len: int,
               cu_seqlens: Boundaries | None, *, ulysses_size: int = 1, window: int | None = None,
               native_window: bool = False, spans: Spans | None = None) -> tuple[BlockTask, ...]:
    """The blocks of one ring step, with or without documents, a sliding ``window``
    (causal only; ``native_window``: the kernel takes band blocks, see :func:`window_step_tasks`)
    and bidirectional ``spans`` (causal only; :func:`~.spans.span_step_tasks` adds theirs).
    ``ulysses_size``: the Ulysses group size ``U`` of the grid, which the ring shards of
    ``document_zigzag`` with uneven documents depend on (:func:`ring_sp.layouts.shard_runs`)."""
    if window is not None:
        tasks = window_step_tasks(layout, rank, source, world_size, local_len, window, cu_seqlens, native_window,
                                  ulysses_size=ulysses_size)
    elif cu_seqlens is None:
        tasks = ring_step_tasks(layout, causal, rank, source, local_len)
    else:
        tasks = packed_step_tasks(layout, causal, rank, source, world_size, local_len, cu_seqlens, ulysses_size)
    return _with_spans(tasks, layout, causal, rank, source, world_size, local_len, cu_seqlens, spans, ulysses_size)


def _with_spans(tasks: tuple[BlockTask, ...], layout: str, causal: bool, rank: int, source: int, world_size: int,
                local_len: int, cu_seqlens: Boundaries | None, spans: Spans | None,
                ulysses_size: int) -> tuple[BlockTask, ...]:
    """A step's causal blocks plus those of the spans' upper parts (none without spans)."""
    if not spans:
        return tasks
    if not causal:
        raise ValueError("spans need causal attention (without it every key of a document is visible already)")
    return tasks + span_step_tasks(layout, rank, source, world_size, local_len, spans, cu_seqlens,
                                   ulysses_size=ulysses_size)


def causal_work_per_rank(layout: str, world_size: int, local_len: int, causal: bool = True,
                         cu_seqlens: Boundaries | None = None, ulysses_size: int = 1,
                         window: int | None = None, spans: Spans | None = None) -> list[int]:
    """(query, key) pairs each ring rank computes over a whole ring pass: the load balance."""
    return [
        sum(
            task.visible_pairs()
            for step in range(world_size)
            for task in step_tasks(layout, causal, rank, (rank - step) % world_size, world_size, local_len, cu_seqlens,
                                   ulysses_size=ulysses_size, window=window, spans=spans)
        )
        for rank in range(world_size)
    ]

Rows = tuple[int, int]  # a [start, stop) range of a shard's local tokens
RowSet = tuple[Rows, ...]  # sorted disjoint ranges: the rows one message carries, in this order

_WHOLE_SHARE = (9, 10)  # a message of at least this share of the shard carries it whole (no staging copy)


def row_count(rows: RowSet | None) -> int:
    """Rows a message of ``rows`` carries (0 for no message)."""
    return 0 if rows is None else sum(b - a for a, b in rows)


def read_rows(tasks: tuple[BlockTask, ...]) -> RowSet:
    """The rows of a KV shard that ``tasks`` read (their keys), merged into sorted ranges."""
    merged: list[list[int]] = []
    for a, b in sorted((t.kv.start, t.kv.stop) for t in tasks):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def message_rows(tasks: tuple[BlockTask, ...], local_len: int) -> RowSet | None:
    """The rows of a KV shard that ``tasks`` read (:func:`read_rows`); the whole shard when that is
    at least 90% of it (sending it costs no staging copy); None when no block."""
    if not tasks:
        return None
    rows = read_rows(tasks)
    if row_count(rows) * _WHOLE_SHARE[1] >= local_len * _WHOLE_SHARE[0]:
        return ((0, local_len),)
    return rows


@dataclass(frozen=True)
class ExchangePlan:
    """One ring rank's whole pass: the blocks of each step ``t`` (against the KV of rank
    ``order.source(rank, t)``; the flat ring's ``rank - t``; slices in that shard's local order) and,
    per step, the rows of that KV shard it receives (``recv_rows``) and the rows it sends to
    ``order.reader(rank, t)`` (``send_rows``; None: no message): the rows some block of the receiver
    reads (:func:`message_rows`), with or without a window, documents or spans. A step whose
    receiver reads nothing exchanges nothing; a batch of documents that all stay whole on their
    ranks exchanges nothing at all. Step 0 is the own shard (``((0, n),)``).

    A double ring (:class:`~.ring_order.RingOrder`, ``order.double``): ``send_rows`` are rows of the
    shard held during the step's outer step, counted in the HELD message (its rows ``recv_rows`` of
    that outer step's first step, which is the inter-node message); ``inter_send[o]`` the rows of
    the own shard sent to ``order.inter_peer(rank, o)`` (what its node reads; index 0: None)."""

    schedule: tuple[tuple[BlockTask, ...], ...]
    recv_rows: tuple[RowSet | None, ...]
    send_rows: tuple[RowSet | None, ...]
    order: RingOrder | None = None
    inter_send: tuple[RowSet | None, ...] = ()

    @property
    def receives(self) -> tuple[bool, ...]:
        return tuple(rows is not None for rows in self.recv_rows)

    @property
    def sends(self) -> tuple[bool, ...]:
        return tuple(rows is not None for rows in self.send_rows)


def exchange_plan(layout: str, causal: bool, rank: int, world_size: int, local_len: int,
                  cu_seqlens: Boundaries | None = None, window: int | None = None,
                  native_window: bool = False, *, ulysses_size: int = 1, spans: Spans | None = None,
                  inner_size: int | None = None) -> ExchangePlan:
    """The :class:`ExchangePlan` of ring rank ``rank`` (pure: every rank can compute any rank's).
    The rows it sends at step ``t`` are those the blocks of their reader read of it, so both ends of
    every message compute its size alike. ``spans``: bidirectional spans (:mod:`.spans`).
    ``inner_size``: ring ranks per node for a double ring (:mod:`.ring_order`; None: the flat ring)."""
    order = RingOrder(world_size, world_size if inner_size is None else inner_size)
    steps = range(world_size)
    inner_steps = [t for t in steps if t and not order.reads_held(t)]  # steps whose KV comes inside the node
    pairs = ([(rank, order.source(rank, t)) for t in steps]
             + [(order.reader(rank, t), order.held(rank, t)) for t in inner_steps]
             + [(q, rank) for outer in range(1, order.outer_size if order.double else 1)
                for q in order.inter_readers(rank, outer)])
    tasks = _pair_tasks(pairs, layout, causal, world_size, local_len, cu_seqlens, window, native_window,
                        ulysses_size, spans)
    schedule = tuple(tasks[:world_size])
    readers = dict(zip(inner_steps, tasks[world_size:world_size + len(inner_steps)]))
    whole: RowSet = ((0, local_len),)
    receives: list[RowSet | None] = [whole] + [message_rows(step_tasks_, local_len) for step_tasks_ in schedule[1:]]
    sends: list[RowSet | None] = [whole] + [None] * (world_size - 1)
    held_rows: RowSet | None = whole  # the rows held during the current outer step (outer step 0: the own shard)
    for t in steps[1:]:
        if order.reads_held(t):  # a double ring's outer step begins: the held shard's rows, what this node reads
            held_rows = receives[t] = message_rows(schedule[t] + sum((readers.get(t + i, ()) for i in
                                                                      range(1, order.inner_size)), ()), local_len)
            continue
        rows = message_rows(readers[t], local_len)
        sends[t] = None if rows is None else within(rows, held_rows)  # type: ignore[arg-type]
    inter = tasks[world_size + len(inner_steps):]
    inter_send = (None,) + tuple(message_rows(sum(inter[o * order.inner_size:(o + 1) * order.inner_size], ()), local_len)
                                 for o in range(order.outer_size - 1)) if order.double else ()
    return ExchangePlan(schedule, tuple(receives), tuple(sends), order if order.double else None, inter_send)


def _pair_tasks(pairs: list[tuple[int, int]], layout: str, causal: bool, world_size: int, local_len: int,
                cu_seqlens: Boundaries | None, window: int | None, native_window: bool, ulysses_size: int,
                spans: Spans | None) -> list[tuple[BlockTask, ...]]:
    """The blocks of each ``(query ring rank, key ring rank)`` of ``pairs``."""
    if window is None and layout in DOCUMENT_LAYOUTS and cu_seqlens is not None:  # every pair in one build
        base = document_steps(layout, causal, pairs, world_size, local_len, cu_seqlens, ulysses_size)
        return [_with_spans(tasks, layout, causal, q, kv, world_size, local_len, cu_seqlens, spans, ulysses_size)
                for tasks, (q, kv) in zip(base, pairs)]
    return [step_tasks(layout, causal, q, kv, world_size, local_len, cu_seqlens, ulysses_size=ulysses_size,
                       window=window, native_window=native_window, spans=spans) for q, kv in pairs]


def within(rows: RowSet, held: RowSet) -> RowSet:
    """``rows`` of a shard counted in a message of its rows ``held`` (every range of ``rows`` lies
    inside one of ``held``'s): where a holder finds them in what it holds."""
    starts, at = [], 0
    for a, b in held:
        starts.append(at)
        at += b - a
    moved = []
    for a, b in rows:
        k = bisect.bisect_right(held, (a, float("inf"))) - 1
        c, d = held[k]
        assert c <= a and b <= d, (rows, held)
        moved.append((starts[k] + a - c, starts[k] + b - c))
    merged: list[tuple[int, int]] = []
    for a, b in moved:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return tuple(merged)
