"""Ring attention: the one forward loop and the one backward loop (DESIGN.md section 4).

Each ring rank keeps its queries. At step ``t`` rank ``r`` holds the packed ``[k; v]``
shard of rank ``r - t`` (k and v share one flat buffer, so a value head size different
from k's, MLA, travels in the same single message): every rank sends its OWN shard to ``r + t`` and receives from
``r - t`` (the same bytes and calls per step as relaying neighbour to neighbour), posted
before the previous step's compute into a double buffer. The layout (and mask) only enters
through :func:`ring_sp.schedule.step_tasks`, which says what to compute at each step, so
every layout shares these two loops; a pair of ranks with nothing to compute exchanges
nothing, which with a sliding window leaves only the halo partners (one or two).

Backward, ``dq`` stays local and the dK/dV partials take one of two routes, a pure choice
per call (:attr:`RingSpec.relay_dkv`): the full ring relays an fp32 ``[dk; dv]``
accumulator with its shard, home after ``R`` sends (last hop in the input dtype); a sliding
window sends each fp32 partial straight home to ``r - t``, where the owner sums them and
rounds once (it then talks to its halo partners only). Attention sinks fold into the
merged rows once, at the end of the forward (:func:`ring_sp.merge.fold_sinks`).

``kv_exchange="all_gather"`` (:attr:`RingSpec.gather_kv`) runs the SAME two loops over the
same schedule, only the KV of step ``t`` comes from one all-gather of every rank's packed
shard (posted before step 0, so it overlaps the own block's compute; forward and again in
backward) instead of a message, and the dK/dV partials of every source are added into one
fp32 buffer and reduce-scattered home at the end (:class:`_GatheredKV`, :class:`_GatheredGrads`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import PendingExchange, RingComm
from .kernels import AttentionKernel, softmax_stat_dtype
from .merge import fold_sinks, merge_block_
from .layouts import Boundaries
from .schedule import BlockTask, exchange_plan
from .schedule_cache import ScheduleCache


class RingSpec:
    """Everything the loops need besides tensors: the ring, the layout, the mask (causal,
    documents), the kernel."""

    def __init__(self, comm: RingComm | None, layout: str, causal: bool, kernel: AttentionKernel, scale: float,
                 local_len: int, cu_seqlens: Boundaries | None = None, window: int | None = None,
                 ulysses_size: int = 1, schedules: ScheduleCache | None = None,
                 kv_exchange: str = "ring") -> None:
        self.comm = comm
        self.kernel = kernel
        self.scale = scale
        self.world_size = comm.world_size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        # The whole schedule (forward and backward share it): the KV at step t comes from rank
        # (rank - t) mod R. With documents this is the costly part, so it is built once per
        # distinct key and reused by every layer from ``schedules`` (the group's cache). Who
        # exchanges at step t: this rank receives from r - t iff it computes something, and
        # sends to r + t iff that rank does (with a window; without one, every step).
        native = bool(getattr(kernel, "supports_window", False))
        key = (layout, causal, self.rank, self.world_size, local_len, cu_seqlens, window, native, ulysses_size)

        def build() -> tuple:
            return _ring_schedule(layout, causal, self.rank, self.world_size, local_len, cu_seqlens, window, native,
                                  ulysses_size)

        self.schedule, self.recv_rows, self.send_rows = build() if schedules is None else schedules.get(key, build)
        self.relay_dkv = window is None
        # all_gather: the KV of every step is a view of one gathered buffer (module docstring)
        self.gather_kv = kv_exchange == "all_gather" and self.world_size > 1
        # One rank whose blocks never share a query row: nothing to merge, so no fp32
        # accumulators (the Ulysses-only case; documents give one block per document).
        self.local = self.world_size == 1 and _rows_disjoint(self.schedule[0])

    def steps(self):
        """(step, tasks) for every step of the ring."""
        return enumerate(self.schedule)

    def rotate(self, send: torch.Tensor, recv: torch.Tensor, kind: str) -> PendingExchange:
        """Neighbour exchange (the relayed dK/dV accumulator): send -> rank + 1, recv <- rank - 1."""
        assert self.comm is not None  # only called when world_size > 1
        return self.comm.exchange(send, recv, kind)


def _ring_schedule(layout: str, causal: bool, rank: int, world_size: int, local_len: int,
                   cu_seqlens: Boundaries | None, window: int | None, native_window: bool, ulysses_size: int) -> tuple:
    """(schedule, recv_rows, send_rows) of :class:`RingSpec` (see :func:`ring_sp.schedule.exchange_plan`)."""
    plan = exchange_plan(layout, causal, rank, world_size, local_len, cu_seqlens, window, native_window,
                         ulysses_size=ulysses_size)
    # A message holds only rows recv_rows[t] of the sender's shard: key slices relative to them.
    schedule = tuple(
        tasks if step == 0 or not tasks or plan.recv_rows[step][0] == 0
        else tuple(_kv_shifted(t, -plan.recv_rows[step][0]) for t in tasks)
        for step, tasks in enumerate(plan.schedule)
    )
    return schedule, plan.recv_rows, plan.send_rows


def _kv_shifted(task: BlockTask, offset: int) -> BlockTask:
    return BlockTask(task.q, slice(task.kv.start + offset, task.kv.stop + offset), task.causal, task.window)


def _span(rows: tuple[int, int] | None) -> int:
    return 0 if rows is None else rows[1] - rows[0]


@dataclass(frozen=True)
class _KVShape:
    """Batch, KV heads and the k / v head sizes of a packed KV message; its row count varies."""

    batch: int
    heads: int
    d: int
    d_v: int

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor) -> _KVShape:
        return _KVShape(k.shape[0], k.shape[2], k.shape[3], v.shape[3])

    def numel(self, rows: int) -> int:
        return self.batch * rows * self.heads * (self.d + self.d_v)

    def view(self, flat: torch.Tensor, rows: int) -> _PackedKV:
        """The first ``numel(rows)`` elements of ``flat`` as k ``[b, rows, h_kv, d]`` then v."""
        split = self.batch * rows * self.heads * self.d
        return _PackedKV(flat[: self.numel(rows)], flat[:split].view(self.batch, rows, self.heads, self.d),
                         flat[split: self.numel(rows)].view(self.batch, rows, self.heads, self.d_v))

    def allocate(self, rows: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> _PackedKV:
        make = torch.zeros if zero else torch.empty
        return self.view(make(self.numel(rows), dtype=dtype, device=device), rows)


@dataclass(frozen=True)
class _PackedKV:
    """k ``[b, s, h_kv, d]`` and v ``[b, s, h_kv, d_v]`` as contiguous views of ONE flat
    buffer ``buf``, so each message is one send whatever ``d_v`` is."""

    buf: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor) -> _PackedKV:
        packed = _KVShape.of(k, v).allocate(k.shape[1], k.dtype, k.device)
        packed.k.copy_(k)
        packed.v.copy_(v)
        return packed


class _Slots:
    """``count`` flat buffers allocated once per call, each viewed per step as a packed KV
    message of any ``rows`` up to the largest of ``rows_per_step``."""

    def __init__(self, count: int, shape: _KVShape, rows_per_step: list[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = shape
        size = shape.numel(max(rows_per_step, default=0))
        self.flat = [torch.empty(size, dtype=dtype, device=device) for _ in range(count if size else 0)]

    def view(self, step: int, rows: int) -> _PackedKV:
        return self.shape.view(self.flat[step % len(self.flat)], rows)


class _Mail:
    """The messages of one pass in one direction. Step ``t`` receives rows ``recv_rows[t]``
    of rank ``r - t``'s shard into one of two inbox slots (``t % 2``; the other one may still
    be computed with) and sends rows ``send_rows[t]`` of ``own`` to ``r + t``: ``own`` itself
    when whole (the full ring), else a staged copy. ``reverse`` swaps the two directions
    (partials go home to ``r - t``)."""

    def __init__(self, spec: RingSpec, own: _PackedKV | None, kind: str, shape: _KVShape, dtype: torch.dtype,
                 device: torch.device, reverse: bool = False) -> None:
        self.spec, self.own, self.kind, self.reverse = spec, own, kind, reverse
        self.inbound, self.outbound = (spec.send_rows, spec.recv_rows) if reverse else (spec.recv_rows, spec.send_rows)
        arriving = [_span(r) for r in self.inbound[1:]]
        self.inbox = _Slots(min(2, sum(map(bool, arriving))), shape, arriving, dtype, device)
        staged = [_span(r) for r in self.outbound[1:] if r is not None and (own is None or _span(r) != own.rows)]
        self.stage = _Slots(2 if reverse else 1, shape, staged, dtype, device)

    def received(self, step: int) -> _PackedKV | None:
        """Step ``step``'s message (after its exchange was waited on); None if none arrives."""
        return None if self.inbound[step] is None else self.inbox.view(step, _span(self.inbound[step]))

    def outgoing(self, step: int) -> _PackedKV:
        """A buffer for step ``step``'s message that the caller fills (the ``reverse`` direction)."""
        return self.stage.view(step, _span(self.outbound[step]))

    def post(self, step: int, message: _PackedKV | None = None) -> PendingExchange | None:
        """Post step ``step``'s exchange (None when this rank neither sends nor receives)."""
        if step >= self.spec.world_size or (self.inbound[step] is None and self.outbound[step] is None):
            return None
        send = None
        if self.outbound[step] is not None:
            send = message
            if send is None:  # own rows, staged unless whole; the stage's last send was waited on
                assert self.own is not None  # the forward direction always has its own shard
                a, b = self.outbound[step]
                send = self.own if b - a == self.own.rows else self.stage.view(step, b - a)
                if send is not self.own:
                    send.k.copy_(self.own.k[:, a:b])
                    send.v.copy_(self.own.v[:, a:b])
        recv = self.received(step) if self.inbound[step] is not None else None
        assert self.spec.comm is not None  # world_size > 1 here
        return self.spec.comm.exchange(None if send is None else send.buf, None if recv is None else recv.buf,
                                       self.kind, offset=-step if self.reverse else step)


class _GatheredKV:
    """``kv_exchange="all_gather"``: the KV of every step from one all-gather of all ring
    ranks' packed shards (``R`` x one shard, in the input dtype), posted at construction and
    waited at the end of step 0, so the own (diagonal) block's compute overlaps it. Same
    interface as :class:`_Mail` in the forward direction."""

    def __init__(self, spec: RingSpec, own: _PackedKV) -> None:
        assert spec.comm is not None  # world_size > 1 here
        self.spec, self.rows, self.shape = spec, own.rows, _KVShape.of(own.k, own.v)
        self.size = own.buf.numel()
        self.flat = torch.empty(spec.world_size * self.size, dtype=own.buf.dtype, device=own.buf.device)
        self.pending: PendingExchange | None = spec.comm.all_gather(self.flat, own.buf, "allgather_kv")

    def received(self, step: int) -> _PackedKV | None:
        """Rows ``recv_rows[step]`` of rank ``r - step``'s shard (the schedule's key slices are
        relative to them), as views of the gathered buffer; None where the step computes nothing."""
        rows = self.spec.recv_rows[step]
        if rows is None:
            return None
        source = (self.spec.rank - step) % self.spec.world_size
        shard = self.shape.view(self.flat[source * self.size:(source + 1) * self.size], self.rows)
        a, b = rows
        return _PackedKV(shard.buf, shard.k[:, a:b], shard.v[:, a:b])

    def post(self, step: int) -> PendingExchange | None:
        """The gather, handed out once: the loop waits on it at the end of step 0."""
        pending, self.pending = self.pending, None
        return pending


def _kv_mail(spec: RingSpec, own: _PackedKV, shape: _KVShape) -> _Mail | _GatheredKV:
    """Where the loops get each step's KV: ring messages or the gathered buffer."""
    return _GatheredKV(spec, own) if spec.gather_kv else _Mail(spec, own, "ring_kv", shape, own.buf.dtype,
                                                                  own.buf.device)


def _rows_disjoint(tasks: tuple[BlockTask, ...]) -> bool:
    spans = sorted((t.q.start, t.q.stop) for t in tasks)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _covers(task: BlockTask, q: torch.Tensor, k: torch.Tensor) -> bool:
    """The block is the whole local problem (one kernel call does everything)."""
    return task.q == slice(0, q.shape[1]) and task.kv == slice(0, k.shape[1])


def _block_forward(spec: RingSpec, task: BlockTask, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on one block: ``task``'s query rows of ``q`` against its keys of ``k``/``v``."""
    return spec.kernel.forward(q[:, task.q], k[:, task.kv], v[:, task.kv], causal=task.causal, scale=spec.scale,
                               window=task.window)


def _block_backward(spec: RingSpec, task: BlockTask, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel's gradients of one block, given the global ``out`` and ``lse`` rows."""
    return spec.kernel.backward(dout[:, task.q], q[:, task.q], k[:, task.kv], v[:, task.kv], out[:, task.q],
                                lse[:, :, task.q], causal=task.causal, scale=spec.scale, window=task.window)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when stored ``[b, s, h, d]`` or ``[b, h, s, d]`` (Ulysses' head-major
    outputs: copying those would cost a buffer), else a contiguous copy (e.g. an expanded
    gradient), read once per block."""
    return x if x.is_contiguous() or x.transpose(1, 2).is_contiguous() else x.contiguous()


def _finish(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged rows in ``dtype``, the sinks folded in first (once, before the one rounding)."""
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(dtype), lse


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                 sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, n, h, d]``, k ``[b, n, h_kv, d]``, v ``[b, n, h_kv, d_v]`` (this rank's shards)
    -> out ``[b, n, h, d_v]`` in q's dtype and lse ``[b, h, n]`` (float32; float64 for float64
    inputs). ``sinks`` ``[h]``: folded into every row once all blocks are merged (lse then
    includes them; see :func:`ring_sp.merge.fold_sinks`)."""
    if spec.local:
        return _local_forward(q, k, v, spec, sinks)
    b, n, h, _ = q.shape
    acc_dtype = softmax_stat_dtype(q.dtype)
    out = torch.zeros((b, n, h, v.shape[3]), dtype=acc_dtype, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc_dtype, device=q.device)
    own = _PackedKV.of(k, v)
    mail = _kv_mail(spec, own, _KVShape.of(k, v))
    for step, tasks in spec.steps():
        kv = own if step == 0 else mail.received(step)  # arrived: waited at the end of the previous step
        pending = mail.post(step + 1)
        written: list[slice] = []  # rows filled at step 0: a first write is a copy, not a merge
        for task in tasks:
            out_b, lse_b = _block_forward(spec, task, q, kv.k, kv.v)
            if step == 0 and all(task.q.stop <= w.start or task.q.start >= w.stop for w in written):
                out[:, task.q].copy_(out_b)
                lse[:, :, task.q].copy_(lse_b)
                written.append(task.q)
            else:
                merge_block_(out[:, task.q], lse[:, :, task.q], out_b, lse_b)
        if pending is not None:
            pending.wait()
    return _finish(out, lse, sinks, q.dtype)


def _local_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                   sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_forward` on one rank: each block's result goes straight to the output."""
    (tasks,) = spec.schedule
    if len(tasks) == 1 and _covers(tasks[0], q, k):
        out, lse = _block_forward(spec, tasks[0], q, k, v)
        return _finish(out, lse, sinks, q.dtype)
    # rows no block covers (none see a key) stay 0 with lse -inf
    out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=q.dtype if sinks is None else softmax_stat_dtype(q.dtype),
                      device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=softmax_stat_dtype(q.dtype), device=q.device)
    for task in tasks:
        out_b, lse_b = _block_forward(spec, task, q, k, v)
        out[:, task.q] = out_b
        lse[:, :, task.q] = lse_b
    return _finish(out, lse, sinks, q.dtype)


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: RingSpec,
    deliver_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for this rank's shards: dq ``[b, n, h, d]``, dk ``[b, n, h_kv, d]``, dv
    ``[b, n, h_kv, d_v]``, given the global ``out`` and ``lse`` from :func:`ring_forward`
    (with sinks: the folded ones, which is all the blocks' backward needs).

    dK/dV accumulate in float32 (float64) while they travel; their LAST hop home carries
    the finished sum in ``deliver_dtype`` (the input dtype: half the bytes for bf16, and
    the same single rounding the caller would do; float32 when the caller sums them
    further, as Ulysses does for replicated KV heads). dq comes back unrounded (float32,
    or the kernel's dtype on one rank): the caller casts once.
    """
    if spec.local:
        return _local_backward(dout, q, k, v, out, lse, spec)
    acc_dtype = softmax_stat_dtype(q.dtype)
    # Accumulators are allocated explicitly: ``x.to(torch.float32)`` would alias an fp32 x.
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    own = _PackedKV.of(k, v)
    shape = _KVShape.of(k, v)
    mail = _kv_mail(spec, own, shape)
    dout = _dense(dout)
    route = (_GatheredGrads if spec.gather_kv else _RelayedGrads if spec.relay_dkv else _DirectGrads)(
        spec, shape, k.shape[1], acc_dtype, k.device)
    for step, tasks in spec.steps():
        kv = own if step == 0 else mail.received(step)
        kv_pending = mail.post(step + 1)
        route.begin(step)
        for task in tasks:
            _add_block_grads(spec, task, dq, route, dout, q, kv, out, lse)
        route.end(step)
        if kv_pending is not None:
            kv_pending.wait()
    return (dq, *route.finish(deliver_dtype))


def _add_block_grads(spec: RingSpec, task: BlockTask, dq: torch.Tensor,
                     route: _RelayedGrads | _DirectGrads | _GatheredGrads,
                     dout: torch.Tensor, q: torch.Tensor, kv: _PackedKV, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One block's gradients, added as soon as the kernel returns them: its dq into ``dq``,
    its dk/dv (``h_kv`` wide) into the route's accumulator. Their only references are this
    call's locals, so at most one block's gradients are alive at a time (the planner's minimum)."""
    dq_b, dk_b, dv_b = _block_backward(spec, task, dout, q, kv.k, kv.v, out, lse)
    dq[:, task.q] += dq_b
    route.add(task, dk_b, dv_b)


class _RelayedGrads:
    """The full ring's dK/dV route: an fp32 accumulator travels with its KV shard (relayed
    neighbour to neighbour) and goes home after ``R`` sends, the last in ``deliver_dtype``.

    Per step: :meth:`begin`, :meth:`add` for each block as the kernel returns it, :meth:`end`.
    The accumulator of the KV now held (sent by ``r - 1`` at the end of its previous step)
    is awaited at the step's first :meth:`add`, so its transfer overlaps that block's compute."""

    def __init__(self, spec: RingSpec, shape: _KVShape, rows: int, acc_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec, self.shape, self.acc_dtype = spec, shape, acc_dtype
        self.dkv = shape.allocate(rows, acc_dtype, device, zero=True)
        self.dkv_next = shape.allocate(rows, acc_dtype, device)
        self.pending: PendingExchange | None = None

    def begin(self, step: int) -> None:
        pass  # the accumulator is awaited lazily, at the first block's gradients

    def _arrived(self) -> None:
        if self.pending is not None:  # the accumulator of the KV we now hold arrives
            self.pending.wait()
            self.pending = None
            self.dkv, self.dkv_next = self.dkv_next, self.dkv

    def add(self, task: BlockTask, dk_b: torch.Tensor, dv_b: torch.Tensor) -> None:
        self._arrived()
        self.dkv.k[:, task.kv] += dk_b
        self.dkv.v[:, task.kv] += dv_b

    def end(self, step: int) -> None:
        self._arrived()  # a step without blocks still relays the accumulator it received
        if step < self.spec.world_size - 1:  # pass the accumulator on with its KV
            self.pending = self.spec.rotate(self.dkv.buf, self.dkv_next.buf, "ring_dkv")

    def finish(self, deliver_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # After R - 1 hops every accumulator holds all its contributions; one more takes it home.
        home = self.shape.allocate(self.dkv.rows, deliver_dtype, self.dkv.buf.device)
        send = self.dkv.buf if deliver_dtype == self.acc_dtype else self.dkv.buf.to(deliver_dtype)
        self.spec.rotate(send, home.buf, "ring_dkv").wait()
        return home.k, home.v


class _DirectGrads:
    """The sliding window's dK/dV route: the fp32 partial for the rows of rank ``r - t``'s
    KV used at step ``t`` goes straight home (one message per halo partner), and this rank
    adds the partials for its own rows as they arrive from ``r + t``; rounded once, by the owner.
    The previous step's exchange is awaited at the step's first block (or its end), after compute."""

    def __init__(self, spec: RingSpec, shape: _KVShape, rows: int, acc_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec = spec
        self.home = shape.allocate(rows, acc_dtype, device, zero=True)
        self.mail = _Mail(spec, None, "ring_dkv", shape, acc_dtype, device, reverse=True)
        self.pending: tuple[int, PendingExchange] | None = None
        self.target: _PackedKV | None = None

    def _collect(self) -> None:
        if self.pending is not None:
            step, work = self.pending
            work.wait()
            rows = self.spec.send_rows[step]
            if rows is not None:  # rank + step computed with these rows of our KV: their partial arrived
                partial = self.mail.received(step)
                assert partial is not None
                self.home.k[:, rows[0]:rows[1]] += partial.k
                self.home.v[:, rows[0]:rows[1]] += partial.v
            self.pending = None

    def begin(self, step: int) -> None:
        self.target = self.home
        if step:
            # this step's stage slot is free: its step - 2 exchange was awaited during step - 1
            self.target = None
            if self.spec.recv_rows[step] is not None:  # we hold rows of rank - step's KV: a partial goes home
                self.target = self.mail.outgoing(step)
                self.target.buf.zero_()

    def add(self, task: BlockTask, dk_b: torch.Tensor, dv_b: torch.Tensor) -> None:
        self._collect()
        self.target.k[:, task.kv] += dk_b  # type: ignore[union-attr]  # (blocks only where rows arrived)
        self.target.v[:, task.kv] += dv_b  # type: ignore[union-attr]

    def end(self, step: int) -> None:
        if step:
            self._collect()
            work = self.mail.post(step, self.target)
            self.pending = None if work is None else (step, work)

    def finish(self, deliver_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self._collect()
        return self.home.k.to(deliver_dtype), self.home.v.to(deliver_dtype)


class _GatheredGrads:
    """``kv_exchange="all_gather"``'s dK/dV route: every block's partial is added into an fp32
    buffer holding one packed ``[dk; dv]`` per ring rank (the rows of the KV it came from),
    which one reduce-scatter sums home at the end; the owner rounds once."""

    def __init__(self, spec: RingSpec, shape: _KVShape, rows: int, acc_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec, self.shape, self.rows = spec, shape, rows
        self.size = shape.numel(rows)
        self.partials = torch.zeros(spec.world_size * self.size, dtype=acc_dtype, device=device)

    def begin(self, step: int) -> None:
        source = (self.spec.rank - step) % self.spec.world_size
        self.into = self.shape.view(self.partials[source * self.size:(source + 1) * self.size], self.rows)
        rows = self.spec.recv_rows[step]
        self.first = 0 if step == 0 or rows is None else rows[0]  # key slices are relative to the rows used

    def add(self, task: BlockTask, dk_b: torch.Tensor, dv_b: torch.Tensor) -> None:
        kv = slice(task.kv.start + self.first, task.kv.stop + self.first)
        self.into.k[:, kv] += dk_b
        self.into.v[:, kv] += dv_b

    def end(self, step: int) -> None:
        pass  # everything goes home in one reduce-scatter at the end

    def finish(self, deliver_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        home = self.shape.allocate(self.rows, self.partials.dtype, self.partials.device)
        assert self.spec.comm is not None  # world_size > 1 here
        self.spec.comm.reduce_scatter(home.buf, self.partials, "reduce_scatter_dkv")
        del self.partials
        return home.k.to(deliver_dtype), home.v.to(deliver_dtype)


def _local_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, spec: RingSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ring_backward` on one rank: the kernel's gradients as they come for a single
    block, else summed per block (documents: one block per document)."""
    (tasks,) = spec.schedule
    if len(tasks) == 1 and _covers(tasks[0], q, k):
        return _block_backward(spec, tasks[0], dout, q, k, v, out, lse)
    acc_dtype = softmax_stat_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    dout = _dense(dout)
    for task in tasks:
        dq_b, dk_b, dv_b = _block_backward(spec, task, dout, q, k, v, out, lse)
        dq[:, task.q] += dq_b
        dk[:, task.kv] += dk_b
        dv[:, task.kv] += dv_b
    return dq, dk, dv


def ring_comm_for(group: dist.ProcessGroup | None) -> RingComm | None:
    """The ring over ``group`` (None = default group), or None for a ring of one rank."""
    comm = RingComm(group)
    return comm if comm.world_size > 1 else None
