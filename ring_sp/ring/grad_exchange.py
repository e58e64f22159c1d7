"""The gradient side of the ring backward: where the dK/dV partials of each block go.

``dq`` stays local (:mod:`.loops`); the dK/dV partials take one of three routes, a pure
choice per call that every rank makes alike. Packed documents or a sliding window: each
step's fp32 partial, for the rows of ``r - t``'s KV the step read, goes straight home to
``r - t`` (the KV message reversed: same rows, same partners, nothing where nothing was
read), where the owner sums them and rounds once (:class:`DirectGrads`). Otherwise every
rank reads most of every shard, and one fp32 ``[dk; dv]`` accumulator is relayed with its
shard, home after ``R`` sends, the last hop in the input dtype (:class:`RelayedGrads`,
:attr:`RingSpec.relay_dkv`): two fp32 buffers, where the direct route would hold the
owner's sum, two staged partials and an inbox. With ``kv_exchange="all_gather"`` the
partials of every source are added into one fp32 buffer and reduce-scattered home at the
end (:class:`GatheredGrads`).

Each route takes, per step, :meth:`begin`, :meth:`add` for each kernel call as the kernel returns
its gradients, :meth:`end`; :meth:`finish` hands the owner its dk and dv.
"""

from __future__ import annotations

import torch

from ..comm import PendingExchange
from .kv_exchange import KVShape, Mail, PackedKV, Slots
from .rows import row_span
from .spec import RingSpec


class RelayedGrads:
    """The full ring's dK/dV route: an fp32 accumulator travels with its KV shard (relayed
    neighbour to neighbour) and goes home after ``R`` sends, the last in ``deliver_dtype``.

    Per step: :meth:`begin`, :meth:`add` for each block as the kernel returns it, :meth:`end`.
    The accumulator of the KV now held (sent by ``r - 1`` at the end of its previous step)
    is awaited at the step's first :meth:`add`, so its transfer overlaps that block's compute."""

    def __init__(self, spec: RingSpec, shape: KVShape, rows: int, acc_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec, self.shape, self.acc_dtype = spec, shape, acc_dtype
        self.dkv = shape.allocate(rows, acc_dtype, device, zero=True)
        self.dkv_next = shape.allocate(rows, acc_dtype, device)
        self.pending: PendingExchange | None = None

    def begin(self, step: int) -> None:
        # the accumulator is awaited lazily, at the first block's gradients; their keys are rows
        # of this step's message, which holds the rows recv_rows[step] of the shard
        self.rows = self.spec.recv_rows[step]

    def _arrived(self) -> None:
        if self.pending is not None:  # the accumulator of the KV we now hold arrives
            self.pending.wait()
            self.pending = None
            self.dkv, self.dkv_next = self.dkv_next, self.dkv

    def add(self, keys: slice, dk_b: torch.Tensor, dv_b: torch.Tensor) -> None:
        """A call's dk/dv partials for ``keys`` of the KV now held (rows of its message)."""
        self._arrived()
        assert self.rows is not None  # blocks only where rows arrived
        self.rows.add_to(self.dkv.k, dk_b, keys)
        self.rows.add_to(self.dkv.v, dv_b, keys)

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


class DirectGrads:
    """The dK/dV route of ring messages: the fp32 partial for the rows of the KV read at step ``t``
    goes back the way the KV came, to its sender (one message per partner that read something:
    the flat ring's ``r - t``), and this rank adds the partials for the rows it sent as they arrive;
    rounded once, by the owner. The previous step's exchange is awaited at the step's first block
    (or its end), after compute.

    A double ring: the holder of a shard during an outer step sums its node's partials of it (its
    own, then those its readers send back) into a held accumulator (two, fp32, alternating by
    outer step) and sends the sum home over the inter-node link once the outer step's last partial
    is in; the owner adds what its peers send back. One inter-node message per outer step, as
    the KV's."""

    def __init__(self, spec: RingSpec, shape: KVShape, rows: int, acc_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec, self.order = spec, spec.order
        self.home = shape.allocate(rows, acc_dtype, device, zero=True)
        self.mail = Mail(spec, None, "ring_dkv", shape, acc_dtype, device, reverse=True)
        self.pending: tuple[int, PendingExchange] | None = None
        self.target: PackedKV | None = None
        inner, size = self.order.inner_size, spec.world_size
        held = [row_span(spec.recv_rows[t]) for t in range(inner, size, inner)] if self.order.double else []
        # the held sums (what this node read of a held shard) and what comes back of the own shard, by outer step
        self.sums = Slots(2, shape, held, acc_dtype, device)
        self.back = Slots(2, shape, [row_span(r) for r in spec.inter_send], acc_dtype, device)
        self.inter_pending: dict[int, PendingExchange] = {}

    def _sum(self, outer: int) -> PackedKV:
        """Where the partials of the shard held during ``outer`` add up (the own shard's home for 0)."""
        if outer == 0:
            return self.home
        return self.sums.view(outer, row_span(self.spec.recv_rows[outer * self.order.inner_size]))

    def _collect(self) -> None:
        if self.pending is not None:
            step, work = self.pending
            work.wait()
            rows = self.spec.send_rows[step]
            if rows is not None:  # our reader computed with these rows of what we hold: their partial arrived
                partial = self.mail.received(step)
                assert partial is not None
                into = self._sum(step // self.order.inner_size if self.order.double else 0)
                rows.add_to(into.k, partial.k)
                rows.add_to(into.v, partial.v)
            self.pending = None

    def _send_home(self, outer: int) -> None:
        """Post the held sum of ``outer`` home, and receive what this rank's peer in node ``n + outer``
        summed of its shard."""
        first, rank = outer * self.order.inner_size, self.spec.rank
        held, back = self.spec.recv_rows[first], self.spec.inter_send[outer]
        send = None if held is None else self._sum(outer)
        recv = None if back is None else self._back(outer)
        if send is None and recv is None:
            return
        assert self.spec.comm is not None  # world_size > 1 here
        self.inter_pending[outer] = self.spec.comm.exchange_with(
            None if send is None else send.buf, self.order.sender(rank, first),
            None if recv is None else recv.buf, self.order.inter_peer(rank, outer), "ring_dkv_inter")

    def _back(self, outer: int) -> PackedKV:
        return self.back.view(outer, row_span(self.spec.inter_send[outer]))

    def _arrived_home(self, outer: int) -> None:
        """Await ``outer``'s inter-node partials and add what came back into the home rows."""
        pending = self.inter_pending.pop(outer, None)
        if pending is None:
            return
        pending.wait()
        rows = self.spec.inter_send[outer]
        if rows is not None:
            back = self._back(outer)
            rows.add_to(self.home.k, back.k)
            rows.add_to(self.home.v, back.v)

    def begin(self, step: int) -> None:
        self.target = self.home
        if not step:
            return
        if self.order.reads_held(step):  # an outer step begins: the last one's sum goes home
            outer = step // self.order.inner_size
            self._collect()
            if outer > 1:
                self._send_home(outer - 1)
            self._arrived_home(outer - 2)  # its buffers are this outer step's
            self.target = None
            if self.spec.recv_rows[step] is not None:
                self.target = self._sum(outer)
                self.target.buf.zero_()
            return
        # this step's stage slot is free: its step - 2 exchange was awaited during step - 1
        self.target = None
        if self.spec.recv_rows[step] is not None:  # we hold rows of the sender's KV: a partial goes back
            self.target = self.mail.outgoing(step)
            self.target.buf.zero_()

    def add(self, keys: slice, dk_b: torch.Tensor, dv_b: torch.Tensor) -> None:
        self._collect()
        self.target.k[:, keys] += dk_b  # type: ignore[union-attr]  # (blocks only where rows arrived)
        self.target.v[:, keys] += dv_b  # type: ignore[union-attr]

    def end(self, step: int) -> None:
        if step and not self.order.reads_held(step):
            self._collect()
            work = self.mail.post(step, self.target)
            self.pending = None if work is None else (step, work)

    def finish(self, deliver_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self._collect()
        if self.order.double:
            last = self.order.outer_size - 1
            if last >= 1:
                self._send_home(last)
            for outer in range(max(1, last - 1), last + 1):
                self._arrived_home(outer)
        return self.home.k.to(deliver_dtype), self.home.v.to(deliver_dtype)


class GatheredGrads:
    """``kv_exchange="all_gather"``'s dK/dV route: every block's partial is added into an fp32
    buffer holding one packed ``[dk; dv]`` per ring rank (the rows of the KV it came from),
    which one reduce-scatter sums home at the end; the owner rounds once."""

    def __init__(self, spec: RingSpec, shape: KVShape, rows: int, acc_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.spec, self.shape, self.rows = spec, shape, rows
        self.size = shape.numel(rows)
        self.partials = torch.zeros(spec.world_size * self.size, dtype=acc_dtype, device=device)

    def begin(self, step: int) -> None:
        source = (self.spec.rank - step) % self.spec.world_size
        self.into = self.shape.view(self.partials[source * self.size:(source + 1) * self.size], self.rows)

    def add(self, keys: slice, dk_b: torch.Tensor, dv_b: torch.Tensor) -> None:
        self.into.k[:, keys] += dk_b  # gathered KV: the schedule reads each shard where it is
        self.into.v[:, keys] += dv_b

    def end(self, step: int) -> None:
        pass  # everything goes home in one reduce-scatter at the end

    def finish(self, deliver_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        home = self.shape.allocate(self.rows, self.partials.dtype, self.partials.device)
        assert self.spec.comm is not None  # world_size > 1 here
        self.spec.comm.reduce_scatter(home.buf, self.partials, "reduce_scatter_dkv")
        del self.partials
        return home.k.to(deliver_dtype), home.v.to(deliver_dtype)
