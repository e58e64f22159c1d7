"""A ring rank's whole pass: the blocks of any step (:func:`step_tasks`, whatever the
options), the work over a pass (:func:`causal_work_per_rank`, the load balance) and which
rows of KV each step receives and sends (:func:`exchange_plan`). Bidirectional spans add
their upper parts' blocks (:mod:`.spans`) to whatever the causal mask gives."""

from __future__ import annotations

from dataclasses import dataclass

from ..layouts import Boundaries
from ..spans import Spans
from .blocks import BlockTask, ring_step_tasks
from .documents import document_zigzag_steps, packed_step_tasks
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


@dataclass(frozen=True)
class ExchangePlan:
    """One ring rank's whole pass: the blocks of each step ``t`` (against the KV of rank
    ``rank - t``, slices in that shard's local order) and, per step, the rows of that KV
    shard it receives (``recv_rows``) and the rows of its own shard it sends to ``rank + t``
    (``send_rows``; None: no message). Without a window every step moves the whole shard
    (the full ring of DESIGN section 5); with one, only the halo partners exchange, and only
    the rows some block of the partner reads (their hull: with spans, also the span keys that
    lie after the partner's window)."""

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
                  native_window: bool = False, *, ulysses_size: int = 1, spans: Spans | None = None) -> ExchangePlan:
    """The :class:`ExchangePlan` of ring rank ``rank`` (pure: every rank can compute any rank's).
    ``spans``: bidirectional spans (:mod:`.spans`); without a window the exchange is the causal one."""

    def tasks(r: int, step: int) -> tuple[BlockTask, ...]:
        return step_tasks(layout, causal, r, (r - step) % world_size, world_size, local_len, cu_seqlens,
                          ulysses_size=ulysses_size, window=window, native_window=native_window, spans=spans)

    if window is None and layout == "document_zigzag" and cu_seqlens is not None:  # all steps in one build
        sources = [(rank - step) % world_size for step in range(world_size)]
        steps = document_zigzag_steps(causal, rank, sources, world_size, local_len, cu_seqlens, ulysses_size)
        schedule = tuple(_with_spans(base, layout, causal, rank, source, world_size, local_len, cu_seqlens, spans,
                                     ulysses_size) for base, source in zip(steps, sources))
    else:
        schedule = tuple(tasks(rank, step) for step in range(world_size))
    if window is None:
        every = ((0, local_len),) * world_size
        return ExchangePlan(schedule, every, every)
    receives = tuple(_kv_hull(t) for t in schedule)
    sends = tuple(_kv_hull(tasks((rank + step) % world_size, step)) for step in range(world_size))
    return ExchangePlan(schedule, receives, sends)
