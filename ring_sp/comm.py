"""Every collective ring_sp issues goes through this module.

One place means one place to count bytes (``count_communication``), to reason about
overlap, and to change transport. On CUDA, ProcessGroupNCCL runs point-to-point and
all-to-all on its own internal stream and ``Work.wait()`` makes the *current stream* wait
on an event (no host or device-wide sync), which is the overlap DESIGN.md section 4 asks
for: we post the next exchange before computing and wait only when the data is needed.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommRecord:
    """Bytes this rank sent to OTHER ranks, per kind of call, and how many calls."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())


_active_record: contextvars.ContextVar[CommRecord | None] = contextvars.ContextVar("ring_sp_comm_record", default=None)


@contextlib.contextmanager
def count_communication() -> Iterator[CommRecord]:
    """Count the bytes this rank sends through ring_sp's collectives inside the block.

    >>> with count_communication() as rec:
    ...     out = ring_attention(q, k, v, causal=True)
    >>> rec.bytes_sent  # {"ring_kv": ..., "ring_dkv": ..., "ulysses_a2a_q": ..., ...}
    """
    record = CommRecord()
    token = _active_record.set(record)
    try:
        yield record
    finally:
        _active_record.reset(token)


def _record(kind: str, nbytes: int) -> None:
    record = _active_record.get()
    if record is not None:
        record.add(kind, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PendingExchange:
    """Handles of posted sends/receives; ``wait()`` before touching the receive buffer."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


class RingComm:
    """Exchange on a ring: send to rank + offset, receive from rank - offset (group ranks;
    offset 1 is the neighbour exchange). :meth:`of` hands out one per group."""

    @staticmethod
    def of(group: dist.ProcessGroup | None) -> RingComm:
        """The ring over ``group`` (None: the default group), made once per group: every attention
        call and every decoded token would otherwise look up the group's global ranks again."""
        whole = group if group is not None else dist.group.WORLD
        comm = _comms.get(whole)
        if comm is None:
            comm = _comms[whole] = RingComm(group)
        return comm

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # P2POp wants global ranks (torch >= 2.4 compatible; group_peer is newer).
        whole = group if group is not None else dist.group.WORLD
        self._global = [dist.get_global_rank(whole, i) for i in range(self.world_size)]

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, kind: str = "ring_p2p",
                 offset: int = 1) -> PendingExchange:
        """Post ``send`` -> rank + ``offset`` and ``recv`` <- rank - ``offset``; returns at once.
        Either may be None (a one-sided step of a sliding-window halo), not both."""
        return self.exchange_with(send, (self.rank + offset) % self.world_size, recv,
                                  (self.rank - offset) % self.world_size, kind)

    def exchange_with(self, send: torch.Tensor | None, to: int, recv: torch.Tensor | None, source: int,
                      kind: str = "ring_p2p") -> PendingExchange:
        """Post ``send`` -> group rank ``to`` and ``recv`` <- group rank ``source``; returns at once.
        Either may be None, not both."""
        ops = []
        if send is not None:
            _record(kind, _nbytes(send))
            ops.append(dist.P2POp(dist.isend, send, self._global[to], self.group))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, self._global[source], self.group))
        return PendingExchange(dist.batch_isend_irecv(ops))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, kind: str) -> PendingExchange:
        """Post ``output[i * input.numel():][:input.numel()] = rank i's input`` for every rank
        (flat, contiguous); returns at once. Records the ``R - 1`` copies of ``input`` that
        must leave this rank (any algorithm: every peer needs it)."""
        _record(kind, _nbytes(input) * (self.world_size - 1))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the name before torch 2.13)
        return PendingExchange([gather(output, input, group=self.group, async_op=True)])

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, kind: str) -> None:
        """``output`` = the sum over ranks of their ``input``'s chunk ``rank`` (flat, ``R``
        equal chunks). Records the ``R - 1`` chunks that leave this rank."""
        _record(kind, _nbytes(input) * (self.world_size - 1) // self.world_size)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (the name before 2.13)
        scatter(output, input, group=self.group)


# group -> its RingComm; an entry goes when its group is garbage collected (weak keys)
_comms: weakref.WeakKeyDictionary[dist.ProcessGroup, RingComm] = weakref.WeakKeyDictionary()


def all_to_all_equal(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, kind: str) -> None:
    """``all_to_all_single`` of equal splits along dim 0 (``input.shape[0] == group size``)."""
    world_size = dist.get_world_size(group)
    _record(kind, _nbytes(input) * (world_size - 1) // world_size)
    dist.all_to_all_single(output, input, group=group)
