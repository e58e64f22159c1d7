"""What the ring loops need besides tensors: :class:`RingSpec` (the ring, the layout, the
mask, the kernel and the schedule of the whole pass) and :func:`ring_comm_for`.

The layout (and mask) only enters through the schedule, :func:`ring_sp.schedule.exchange_plan`:
which blocks each step computes and which rows of KV each step receives and sends, and the
kernel calls that compute them (:class:`~.calls.CallPlan`). With documents building it is the
costly part of a call, so it is built once per distinct problem and reused from the group's
:class:`~ring_sp.schedule_cache.ScheduleCache`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist

from ..comm import PendingExchange, RingComm
from ..kernels import AttentionKernel
from ..layouts import Boundaries
from ..schedule import BlockTask, ExchangePlan, KernelCaps, RingOrder, RowSet, exchange_plan, row_count
from ..schedule_cache import ScheduleCache
from ..spans import Spans
from .calls import CallPlan, Launch, kernel_caps
from .rows import MessageRows, messages


class RingSpec:
    """Everything the loops need besides tensors: the ring, the layout, the mask (causal,
    documents, window, bidirectional spans), the kernel."""

    # The function that plans each rank's pass, with :func:`ring_sp.schedule.exchange_plan`'s
    # signature. A seam for benchmarks, not a user option: ``benchmarks/window.py`` sets it
    # (:func:`staticmethod`) to a planner that moves every shard at every step, its
    # full-rotation baseline, and restores it. It is part of the schedule cache key, so the
    # schedules of two planners never mix.
    exchange_planner: ClassVar[Callable[..., ExchangePlan]] = staticmethod(exchange_plan)

    def __init__(self, comm: RingComm | None, layout: str, causal: bool, kernel: AttentionKernel, scale: float,
                 local_len: int, cu_seqlens: Boundaries | None = None, window: int | None = None,
                 ulysses_size: int = 1, schedules: ScheduleCache | None = None,
                 kv_exchange: str = "ring", spans: Spans | None = None, inner_size: int | None = None) -> None:
        self.comm = comm
        self.kernel = kernel
        self.scale = scale
        self.world_size = comm.world_size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        # The whole schedule (forward and backward share it): the KV at step t comes from rank
        # (rank - t) mod R. With documents this is the costly part, so it is built once per
        # distinct key and reused by every layer from ``schedules`` (the group's cache). Who
        # exchanges at step t: this rank receives from r - t iff it computes something, and
        # sends to r + t iff that rank does (with a window; without one, every step). The
        # kernel's capabilities decide how bands are cut and how blocks group into calls.
        caps = kernel_caps(kernel)
        planner = self.exchange_planner
        # all_gather: the KV of every step is a view of one gathered buffer (ring_sp.ring.kv_exchange)
        self.gather_kv = kv_exchange == "all_gather" and self.world_size > 1
        # a double ring (ring_sp.schedule.ring_order): inner_size ring ranks per node; the flat ring otherwise
        inner_size = inner_size if inner_size is not None and RingOrder(self.world_size, inner_size).double else None
        key = (layout, causal, self.rank, self.world_size, local_len, cu_seqlens, window, caps, ulysses_size,
               planner, spans, self.gather_kv, inner_size)

        def build() -> tuple:
            return _ring_schedule(planner, layout, causal, self.rank, self.world_size, local_len, cu_seqlens, window,
                                  caps, ulysses_size, spans, self.gather_kv, inner_size)

        (self.schedule, self.recv_rows, self.send_rows, self.calls, self.order,
         self.inter_send) = build() if schedules is None else schedules.get(key, build)
        # The dK/dV route (ring_sp.ring.grad_exchange), alike on every rank: partials straight
        # home along the KV's rows where documents or a window leave most rows unread, else
        # one accumulator relayed around the ring (whole shards, two fp32 buffers).
        # (the relay follows the flat ring's order: a double ring's partials go home directly)
        self.relay_dkv = window is None and cu_seqlens is None and not self.order.double
        # One rank whose calls never share a query row: nothing to merge, so no fp32
        # accumulators (the Ulysses-only case; documents give one call, or one block per document).
        self.local = self.world_size == 1 and self.calls.rows_disjoint(0)

    def rotate(self, send: torch.Tensor, recv: torch.Tensor, kind: str) -> PendingExchange:
        """Neighbour exchange (the relayed dK/dV accumulator): send -> rank + 1, recv <- rank - 1."""
        assert self.comm is not None  # only called when world_size > 1
        return self.comm.exchange(send, recv, kind)

    def steps(self, device: torch.device) -> enumerate[tuple[Launch, ...]]:
        """(step, its kernel calls on ``device``) for every step of the ring."""
        return enumerate(self.calls.launches(device))



def _ring_schedule(planner: Callable[..., ExchangePlan], layout: str, causal: bool, rank: int, world_size: int,
                   local_len: int, cu_seqlens: Boundaries | None, window: int | None, caps: KernelCaps,
                   ulysses_size: int, spans: Spans | None, gather_kv: bool, inner_size: int | None) -> tuple:
    """(schedule, recv_rows, send_rows, calls, order, inter_send) of :class:`RingSpec` (see
    :func:`ring_sp.schedule.exchange_plan`). A message holds only rows ``recv_rows[t]`` of the
    sender's shard, one range after the other: the blocks' key slices are moved into the message's
    rows. Gathered KV holds every shard whole: its steps read the rows where they are. A double
    ring's ``send_rows`` are rows of the message held during the step's outer step."""
    plan = planner(layout, causal, rank, world_size, local_len, cu_seqlens, window, caps.bands,
                   ulysses_size=ulysses_size, spans=spans, **({} if inner_size is None else {"inner_size": inner_size}))
    order = plan.order if plan.order is not None else RingOrder.flat(world_size)
    recv_rows, send_rows = plan.recv_rows, plan.send_rows
    if gather_kv:
        whole = ((0, local_len),)
        recv_rows = tuple(None if rows is None else whole for rows in recv_rows)
        send_rows = tuple(None if rows is None else whole for rows in send_rows)
    schedule = tuple(tasks if step == 0 or not tasks else _in_message(tasks, recv_rows[step])
                     for step, tasks in enumerate(plan.schedule))
    # the length of what each step's sends are cut from: the own shard, or the outer step's held message
    held = [local_len if not order.double or t < order.inner_size else row_count(recv_rows[t - order.inner_step(t)])
            for t in range(world_size)]
    sends = tuple(None if rows is None else MessageRows(rows, held[t]) for t, rows in enumerate(send_rows))
    return (schedule, messages(recv_rows, local_len), sends, CallPlan(schedule, caps), order,
            messages(plan.inter_send, local_len))


def _in_message(tasks: tuple[BlockTask, ...], rows: RowSet) -> tuple[BlockTask, ...]:
    """``tasks`` with their key slices moved from the shard's rows to a message of ``rows``
    (each block's keys lie inside one range: the ranges are the blocks' keys, merged)."""
    if rows[0] == (0, rows[0][1]) and len(rows) == 1:
        return tasks
    starts = [a for a, _ in rows]
    shifts, at = [], 0
    for a, b in rows:
        shifts.append(at - a)
        at += b - a
    moved = []
    for task in tasks:
        shift = shifts[bisect.bisect_right(starts, task.kv.start) - 1]
        moved.append(task._replace(kv=slice(task.kv.start + shift, task.kv.stop + shift)))
    return tuple(moved)


def ring_comm_for(group: dist.ProcessGroup | None) -> RingComm | None:
    """The ring over ``group`` (None = default group), or None for a ring of one rank."""
    comm = RingComm.of(group)
    return comm if comm.world_size > 1 else None
