"""The KV side of the ring loops: where each step's packed ``[k; v]`` comes from.

k and v share one flat buffer (:class:`KVShape`, :class:`PackedKV`), so a value head size
different from k's (MLA) travels in the same single message. With ``kv_exchange="ring"``
(:class:`Mail`), at step ``t`` every rank sends to ``r + t`` the rows of its OWN shard that
``r + t`` reads and receives those of rank ``r - t`` it reads (:func:`ring_sp.schedule.message_rows`:
the whole shard, sent as it is, or its needed ranges, staged by :class:`~.rows.MessageRows`),
posted before the previous step's compute into a double buffer; a pair of ranks with
nothing to compute exchanges nothing (a sliding window leaves only the halo partners, whole
documents no partner at all). Direct point-to-point at offset ``t`` rather than a relay
neighbour to neighbour: a row only some ranks read then crosses one link once, where a relay
would carry it through every rank between (``benchmarks/packed.py`` counts both). The same
mail, reversed, takes the dK/dV partials home (:class:`~.grad_exchange.DirectGrads`).

``kv_exchange="all_gather"`` (:attr:`RingSpec.gather_kv`): the KV of step ``t`` comes from
one all-gather of every rank's packed shard instead (:class:`GatheredKV`), posted before
step 0, so it overlaps the own block's compute (forward and again in backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import PendingExchange
from .rows import MessageRows, row_span
from .spec import RingSpec


@dataclass(frozen=True)
class KVShape:
    """Batch, KV heads and the k / v head sizes of a packed KV message; its row count varies."""

    batch: int
    heads: int
    d: int
    d_v: int

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor) -> KVShape:
        return KVShape(k.shape[0], k.shape[2], k.shape[3], v.shape[3])

    def numel(self, rows: int) -> int:
        return self.batch * rows * self.heads * (self.d + self.d_v)

    def view(self, flat: torch.Tensor, rows: int) -> PackedKV:
        """The first ``numel(rows)`` elements of ``flat`` as k ``[b, rows, h_kv, d]`` then v."""
        split = self.batch * rows * self.heads * self.d
        return PackedKV(flat[: self.numel(rows)], flat[:split].view(self.batch, rows, self.heads, self.d),
                        flat[split: self.numel(rows)].view(self.batch, rows, self.heads, self.d_v))

    def allocate(self, rows: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> PackedKV:
        make = torch.zeros if zero else torch.empty
        return self.view(make(self.numel(rows), dtype=dtype, device=device), rows)


@dataclass(frozen=True)
class PackedKV:
    """k ``[b, s, h_kv, d]`` and v ``[b, s, h_kv, d_v]`` as contiguous views of ONE flat
    buffer ``buf``, so each message is one send whatever ``d_v`` is."""

    buf: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor) -> PackedKV:
        packed = KVShape.of(k, v).allocate(k.shape[1], k.dtype, k.device)
        packed.k.copy_(k)
        packed.v.copy_(v)
        return packed


class Slots:
    """``count`` flat buffers allocated once per call, each viewed per step as a packed KV
    message of any ``rows`` up to the largest of ``rows_per_step``."""

    def __init__(self, count: int, shape: KVShape, rows_per_step: list[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.shape = shape
        size = shape.numel(max(rows_per_step, default=0))
        self.flat = [torch.empty(size, dtype=dtype, device=device) for _ in range(count if size else 0)]

    def view(self, step: int, rows: int) -> PackedKV:
        return self.shape.view(self.flat[step % len(self.flat)], rows)


def _message(rows: MessageRows, holding: PackedKV, slots: Slots, slot: int) -> PackedKV:
    """Rows ``rows`` of ``holding`` as a message: ``holding`` itself when whole, else gathered into
    ``slots``' slot ``slot`` (whose last send was waited on)."""
    if rows.whole:
        return holding
    message = slots.view(slot, rows.count)
    rows.gather(holding.k, message.k)
    rows.gather(holding.v, message.v)
    return message


class Mail:
    """The messages of one pass in one direction. Step ``t`` receives rows ``recv_rows[t]`` of the
    shard it reads from its sender (``spec.order.sender``: the flat ring's ``r - t``) into one of
    two inbox slots (``t % 2``; the other one may still be computed with) and sends rows
    ``send_rows[t]`` of what it holds to its reader (the flat ring's ``r + t``): ``own`` (or a
    double ring's held message) itself when whole, else staged (:class:`~.rows.MessageRows`).
    ``reverse`` swaps the two directions (partials go home to the sender).

    A double ring (forward): the first step of each outer step ``o >= 1`` reads the held message,
    the rows of its peer's shard that this node reads, sent by that peer once over the inter-node
    link (``inter_send``) into one of two held slots, posted with the first inner step of the
    outer step before (a whole inner pass to arrive) and awaited when it is first needed."""

    def __init__(self, spec: RingSpec, own: PackedKV | None, kind: str, shape: KVShape, dtype: torch.dtype,
                 device: torch.device, reverse: bool = False) -> None:
        self.spec, self.own, self.kind, self.reverse = spec, own, kind, reverse
        self.order = order = spec.order
        self.inbound, self.outbound = (spec.send_rows, spec.recv_rows) if reverse else (spec.recv_rows, spec.send_rows)
        inner = [t for t in range(1, spec.world_size) if not order.reads_held(t)]  # steps messaged inside the node
        arriving = [row_span(self.inbound[t]) for t in inner]
        self.inbox = Slots(min(2, sum(map(bool, arriving))), shape, arriving, dtype, device)
        staged = [row_span(self.outbound[t]) for t in inner
                  if self.outbound[t] is not None and (own is None or not self.outbound[t].whole)]
        self.stage = Slots(2 if reverse else 1, shape, staged, dtype, device)
        self.double = order.double and not reverse
        outer_steps = range(order.inner_size, spec.world_size, order.inner_size) if self.double else ()
        self.held = Slots(2, shape, [row_span(self.inbound[t]) for t in outer_steps], dtype, device)
        self.inter_stage = Slots(1, shape, [row_span(r) for r in spec.inter_send if r is not None and not r.whole],
                                  dtype, device)
        self.inter_pending: dict[int, PendingExchange] = {}

    def received(self, step: int) -> PackedKV | None:
        """Step ``step``'s message (after its exchange was waited on); None if none arrives."""
        if self.inbound[step] is None:
            return None
        if self.order.reads_held(step):
            return self._held(step // self.order.inner_size)
        return self.inbox.view(step, row_span(self.inbound[step]))

    def outgoing(self, step: int) -> PackedKV:
        """A buffer for step ``step``'s message that the caller fills (the ``reverse`` direction)."""
        return self.stage.view(step, row_span(self.outbound[step]))

    def _held(self, outer: int) -> PackedKV:
        """The held message of outer step ``outer`` (its inter-node message awaited)."""
        pending = self.inter_pending.pop(outer, None)
        if pending is not None:
            pending.wait()
        return self.held.view(outer, row_span(self.inbound[outer * self.order.inner_size]))

    def _post_inter(self, outer: int) -> None:
        """Post outer step ``outer``'s inter-node message: this rank's rows for its peer in node
        ``n + outer``, and the rows of node ``n - outer``'s peer that this node reads."""
        if outer >= self.order.outer_size:
            return
        rows, first = self.spec.inter_send[outer], outer * self.order.inner_size
        send = None
        if rows is not None:
            assert self.own is not None  # the forward direction
            send = _message(rows, self.own, self.inter_stage, 0)
        recv = None if self.inbound[first] is None else self.held.view(outer, row_span(self.inbound[first]))
        if send is None and recv is None:
            return
        assert self.spec.comm is not None  # world_size > 1 here
        self.inter_pending[outer] = self.spec.comm.exchange_with(
            None if send is None else send.buf, self.order.inter_peer(self.spec.rank, outer),
            None if recv is None else recv.buf, self.order.sender(self.spec.rank, first), f"{self.kind}_inter")

    def post(self, step: int, message: PackedKV | None = None) -> PendingExchange | None:
        """Post step ``step``'s exchange (None when this rank neither sends nor receives); a double
        ring also posts the next outer step's inter-node message with the first inner step."""
        if step >= self.spec.world_size:  # the pass's last step: inter-node sends nobody here waited for (their
            for pending in self.inter_pending.values():  # receivers read, this node did not) are done by now
                pending.wait()
            self.inter_pending.clear()
            return None
        if self.double and self.order.inner_step(step) == 1:
            self._post_inter(step // self.order.inner_size + 1)
        if self.order.reads_held(step):
            return None  # its KV is the held message, posted an outer step ahead
        if self.inbound[step] is None and self.outbound[step] is None:
            return None
        send = None
        rows = self.outbound[step]
        if rows is not None:
            send = message
            if send is None:  # rows of what this rank holds (its own shard, or the outer step's held message)
                holding = self.own if step < self.order.inner_size or not self.double else self._held(
                    step // self.order.inner_size)
                assert holding is not None  # the forward direction always has its own shard
                send = _message(rows, holding, self.stage, step)
        recv = self.received(step) if self.inbound[step] is not None else None
        assert self.spec.comm is not None  # world_size > 1 here
        rank = self.spec.rank
        to, source = self.order.reader(rank, step), self.order.sender(rank, step)
        if self.reverse:
            to, source = source, to
        return self.spec.comm.exchange_with(None if send is None else send.buf, to,
                                            None if recv is None else recv.buf, source, self.kind)


class GatheredKV:
    """``kv_exchange="all_gather"``: the KV of every step from one all-gather of all ring
    ranks' packed shards (``R`` x one shard, in the input dtype), posted at construction and
    waited at the end of step 0, so the own (diagonal) block's compute overlaps it. Same
    interface as :class:`Mail` in the forward direction."""

    def __init__(self, spec: RingSpec, own: PackedKV) -> None:
        assert spec.comm is not None  # world_size > 1 here
        self.spec, self.rows, self.shape = spec, own.rows, KVShape.of(own.k, own.v)
        self.size = own.buf.numel()
        self.flat = torch.empty(spec.world_size * self.size, dtype=own.buf.dtype, device=own.buf.device)
        self.pending: PendingExchange | None = spec.comm.all_gather(self.flat, own.buf, "allgather_kv")

    def received(self, step: int) -> PackedKV | None:
        """Rank ``r - step``'s whole shard, a view of the gathered buffer (the schedule of gathered
        KV reads it where it is); None where the step computes nothing."""
        if self.spec.recv_rows[step] is None:
            return None
        source = (self.spec.rank - step) % self.spec.world_size
        return self.shape.view(self.flat[source * self.size:(source + 1) * self.size], self.rows)

    def post(self, step: int) -> PendingExchange | None:
        """The gather, handed out once: the loop waits on it at the end of step 0."""
        pending, self.pending = self.pending, None
        return pending


def kv_mail(spec: RingSpec, own: PackedKV, shape: KVShape) -> Mail | GatheredKV:
    """Where the loops get each step's KV: ring messages or the gathered buffer."""
    return GatheredKV(spec, own) if spec.gather_kv else Mail(spec, own, "ring_kv", shape, own.buf.dtype,
                                                             own.buf.device)
