"""Ring schedules built once per distinct problem and reused by every layer (issue 24).

A :class:`~ring_sp.ring.RingSpec`'s schedule (which blocks each step computes, which rows
each step exchanges) depends only on its arguments; with packed documents
(``document_zigzag``, ``cu_seqlens``) building it is the costly part of a call, and every
layer of a step, and each layer's backward (which keeps its forward's spec), asks for the
same one. :class:`ScheduleCache` keeps the last few, keyed by every argument the schedule
depends on (the CONTENT of ``cu_seqlens``, the layout, mask, window, ring rank and size,
shard length, Ulysses size, whether the kernel takes windows), so a hit is exact and any
difference is a miss. One cache belongs to one process group (:func:`schedule_cache`):
it lives and dies with the group the user holds and never serves another topology.
An entry is its rank's blocks and rows: O(R) for the plain layouts, O(R x documents) at most
for packed ones, never one per token (``tests/test_per_rank_bytes.py`` weighs them).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class ScheduleCache(Generic[T]):
    """A bounded LRU of schedules: ``get(key, build)`` returns the entry of ``key``, calling
    ``build()`` (and counting it in ``builds``) only on a miss; the least recently used
    entry goes once more than ``maxsize`` are kept (a new packing can come every step)."""

    def __init__(self, maxsize: int = 8) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize={maxsize} must be at least 1")
        self.maxsize = maxsize
        self.builds = 0
        self._entries: OrderedDict[Hashable, T] = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        value = build()
        self.builds += 1
        self._entries[key] = value
        if len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list[T]:
        """The kept schedules, least recently used first (read-only)."""
        return list(self._entries.values())


# group -> its cache; an entry goes when its group is garbage collected (weak keys)
_by_group: weakref.WeakKeyDictionary[dist.ProcessGroup, ScheduleCache] = weakref.WeakKeyDictionary()


def schedule_cache(group: dist.ProcessGroup) -> ScheduleCache:
    """The schedule cache of ``group`` (the ring group; the Ulysses group when there is no ring)."""
    cache = _by_group.get(group)
    if cache is None:
        cache = _by_group[group] = ScheduleCache()
    return cache
