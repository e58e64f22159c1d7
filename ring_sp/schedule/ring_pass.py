"""A ring rank's whole pass: the blocks of any step (:func:`step_tasks`, whatever the
options), the work over a pass (:func:`causal_work_per_rank`, the load balance) and which
rows of KV each step receives and sends (:func:`exchange_plan`). Bidirectional spans add
their upper parts' blocks (:mod:`.spans`) to whatever the causal mask gives."""

from __future__ import annotations

from dataclasses import dataclass

from ..layouts import DOCUMENT_LAYOUTS, Boundaries
from ..spans import Spans
from .blocks import BlockTask, ring_step_tasks
from .documents import document_steps, packed_step_tasks
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
    ``rank - t``, slices in that shard's local order) and, per step, the rows of that KV
    shard it receives (``recv_rows``) and the rows of its own shard it sends to ``rank + t``
    (``send_rows``; None: no message): the rows some block of the receiver reads
    (:func:`message_rows`), with or without a window, documents or spans. A step whose
    receiver reads nothing exchanges nothing; a batch of documents that all stay whole on
    their ranks exchanges nothing at all. Step 0 is the own shard (``((0, n),)``)."""

    schedule: tuple[tuple[BlockTask, ...], ...]
    recv_rows: tuple[RowSet | None, ...]
    send_rows: tuple[RowSet | None, ...]

    @property
    def receives(self) -> tuple[bool, ...]:
        return tuple(rows is not None for rows in self.recv_rows)

    @property
    def sends(self) -> tuple[bool, ...]:
        return tuple(rows is not None for rows in self.send_rows)


def exchange_plan(layout: str, causal: bool, rank: int, world_size: int, local_len: int,
                  cu_seqlens: Boundaries | None = None, window: int | None = None,
                  native_window: bool = False, *, ulysses_size: int = 1, spans: Spans | None = None) -> ExchangePlan:
    """The :class:`ExchangePlan` of ring rank ``rank`` (pure: every rank can compute any rank's).
    The rows it sends at step ``t`` are those the blocks of rank ``rank + t`` read of it, so both
    ends of every message compute its size alike. ``spans``: bidirectional spans (:mod:`.spans`)."""
    partners = [(rank + step) % world_size for step in range(1, world_size)]
    pairs = ([(rank, (rank - step) % world_size) for step in range(world_size)]
             + [(partner, rank) for partner in partners])
    if window is None and layout in DOCUMENT_LAYOUTS and cu_seqlens is not None:  # every pair in one build
        base = document_steps(layout, causal, pairs, world_size, local_len, cu_seqlens, ulysses_size)
        steps = [_with_spans(tasks, layout, causal, q, kv, world_size, local_len, cu_seqlens, spans, ulysses_size)
                 for tasks, (q, kv) in zip(base, pairs)]
    else:
        steps = [step_tasks(layout, causal, q, kv, world_size, local_len, cu_seqlens, ulysses_size=ulysses_size,
                            window=window, native_window=native_window, spans=spans) for q, kv in pairs]
    schedule, partner_steps = tuple(steps[:world_size]), steps[world_size:]
    whole: RowSet = ((0, local_len),)
    receives = (whole,) + tuple(message_rows(tasks, local_len) for tasks in schedule[1:])
    sends = (whole,) + tuple(message_rows(tasks, local_len) for tasks in partner_steps)
    return ExchangePlan(schedule, receives, sends)
