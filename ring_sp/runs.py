"""Runs of positions: the compact form of a rank's shard and of a token permutation.

A shard of every layout is a few runs of global positions (:class:`ShardRuns`: one or two for
the plain layouts, two per document for ``document_zigzag``), and the Ulysses-to-ring reorder
moves a few runs (:class:`Reorder`), so a rank keeps O(runs), never a word per global token;
token positions are expanded only for the rank's own shard (O(N/P)). :func:`memoised` is the
cache every such structure lives in, listed in :data:`MEMOS` so tests can weigh what a rank
keeps. Pure (no process groups); :mod:`ring_sp.layouts` says which runs each layout holds.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Document boundaries of the global packed sequence, as a hashable tuple (0, ..., N).
Boundaries = tuple[int, ...]


class _Memo:
    """A bounded LRU of one function's results in two pools: plain layouts in a roomy one, entries
    keyed by document boundaries (a new packing can arrive every step) in a small one. Every
    entry is one rank's (its O(N/P) positions, or O(runs) metadata), never one per global token
    (:func:`layout_positions` and :func:`ring_positions`, the all-ranks views, excepted);
    :data:`MEMOS` lists them all so tests can weigh what a rank keeps."""

    def __init__(self, fn: Callable, plain: int, documents: int) -> None:
        self.fn, self.maxsizes = fn, (plain, documents)
        self.pools: tuple[OrderedDict, OrderedDict] = (OrderedDict(), OrderedDict())
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        key = args + tuple(sorted(kwargs.items()))
        which = int(any(isinstance(a, tuple) for a in (*args, *kwargs.values())))
        pool = self.pools[which]
        if key in pool:
            pool.move_to_end(key)
            return pool[key]
        value = pool[key] = self.fn(*args, **kwargs)
        if len(pool) > self.maxsizes[which]:
            pool.popitem(last=False)
        return value

    def values(self) -> list:
        """Every kept result (read-only)."""
        return [value for pool in self.pools for value in pool.values()]

    def cache_clear(self) -> None:
        for pool in self.pools:
            pool.clear()


MEMOS: list[_Memo] = []


def memoised(plain: int = 256, documents: int = 8) -> Callable[[Callable], _Memo]:
    """Decorator: memoise a pure function in a :class:`_Memo` listed in :data:`MEMOS`."""
    def wrap(fn: Callable) -> _Memo:
        MEMOS.append(_Memo(fn, plain, documents))
        return MEMOS[-1]
    return wrap


@dataclass(frozen=True)
class ShardRuns:
    """A shard as runs of global positions, in its local order: run j holds ``start[j] + stride * k``
    for ``k < length[j]`` (LongTensors ``[runs]``, empty runs allowed). A plain layout's shard is
    one or two runs, a packed one two per document: O(runs), no word per token until
    :meth:`positions` is asked for."""

    start: torch.Tensor
    length: torch.Tensor
    stride: int = 1

    def positions(self) -> torch.Tensor:
        """The global positions, LongTensor ``[n]`` in local order (O(n) to build, nothing more)."""
        total = int(self.length.sum())
        local = self.length.cumsum(0) - self.length
        offset = torch.repeat_interleave(self.start - self.stride * local, self.length, output_size=total)
        return offset + self.stride * torch.arange(total)


def document_slot_starts(cu_seqlens: Boundaries, world_size: int, slots: Sequence[int]) -> list[torch.Tensor]:
    """document_zigzag: the global start of slot ``j`` (chunk j of a document's 2P, slot 2P its
    end) of every document, for each ``j`` in ``slots``: O(documents), whatever N.

    A document of ``L = 2P*c + e`` tokens has ``e`` chunks of ``c + 1``. The k-th extra token of
    the whole sequence goes to cycle index ``k % 2P`` (0..P-1: the first chunks of ranks
    0..P-1, slot k; P..2P-1: their second chunks, slot ``3P-1-k``); so the extras before slot
    ``j`` are a document's cycle indices in ``[0, j)`` (``j <= P``) or ``[0, P) + [3P-j, 2P)``."""
    p, p2 = world_size, 2 * world_size
    bounds = torch.tensor(cu_seqlens)
    lengths = bounds.diff()
    base, extra = lengths // p2, lengths % p2
    first = (extra.cumsum(0) - extra) % p2  # cycle index of each document's first extra token
    end, wrapped = (first + extra).clamp(max=p2), (first + extra - p2).clamp(min=0)  # its window, cut at 2P

    def extras_in(a: int, b: int) -> torch.Tensor:  # a document's extras on cycle indices [a, b)
        return (end.clamp(max=b) - first.clamp(min=a)).clamp(min=0) + (wrapped.clamp(max=b) - a).clamp(min=0)

    def before(j: int) -> torch.Tensor:
        return extras_in(0, j) if j <= p else extras_in(0, p) + extras_in(3 * p - j, p2)

    return [bounds[:-1] + j * base + before(j) for j in slots]


@dataclass(frozen=True)
class Reorder:
    """A token permutation along the sequence dim, kept as runs, never as an index per token.

    * ``chunk > 0`` (plain layouts): ``index`` / ``inverse`` ``[tokens // chunk]``: ``apply``
      puts run ``index[j]`` of ``chunk`` tokens at run j, ``undo`` reverses it.
    * ``sizes`` (packed documents, runs of any length; ``chunk == 0``): ``index[j]`` is the
      source run put at run j and ``sizes[i]`` the length of source run i (``inverse`` is
      ``index``'s inverse); a call expands them into a token index for that call only, as long
      as the tensor it reorders, and frees it.
    * ``interleave = U > 1`` (``striped`` under Ulysses alone; ``index`` empty): the source is
      U blocks of every U-th token, the result the tokens in order: a transpose.

    An index of every token and its inverse, cached per length and device, cost 16 bytes per
    token of the ring shard on every rank (every global token at U8xR1); the runs cost O(U)
    for the plain layouts and O(U x documents) for the packed one.
    """

    chunk: int
    index: torch.Tensor
    inverse: torch.Tensor
    sizes: torch.Tensor | None = None
    interleave: int = 1

    def _token_index(self, undo: bool, total: int) -> torch.Tensor:
        """The ``sizes`` runs as a token index: output run j is input run ``order[j]``."""
        assert self.sizes is not None
        sizes, order = (self.sizes[self.index], self.inverse) if undo else (self.sizes, self.index)
        taken = sizes[order]
        shift = (sizes.cumsum(0) - sizes)[order] - (taken.cumsum(0) - taken)
        return torch.repeat_interleave(shift, taken, output_size=total) + torch.arange(total, device=shift.device)

    def _select(self, x: torch.Tensor, dim: int, undo: bool) -> torch.Tensor:
        dim = dim % x.dim()
        if self.interleave > 1:
            groups = (self.interleave, x.shape[dim] // self.interleave)
            split = x.unflatten(dim, groups[::-1] if undo else groups)
            return split.transpose(dim, dim + 1).clone(memory_format=torch.contiguous_format).flatten(dim, dim + 1)
        if self.sizes is not None:
            return x.index_select(dim, self._token_index(undo, x.shape[dim]))
        runs = self.inverse if undo else self.index
        if self.chunk == 1:
            return x.index_select(dim, runs)
        return x.unflatten(dim, (-1, self.chunk)).index_select(dim, runs).flatten(dim, dim + 1)

    def apply(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` in the permuted order along ``dim`` (a new tensor)."""
        return self._select(x, dim, undo=False)

    def undo(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The inverse of :meth:`apply`."""
        return self._select(x, dim, undo=True)


def sorted_reorder(start: torch.Tensor, length: torch.Tensor, few: int, device: torch.device) -> Reorder | None:
    """The :class:`Reorder` that sorts a tensor made of runs of distinct, disjoint positions (run i:
    ``length[i]`` consecutive positions from ``start[i]``, in the tensor's order) into increasing
    positions; None for the identity. Equal aligned chunks (at most ``max(few, runs)`` of them,
    the plain layouts) use the chunk form, other runs the ``sizes`` form: O(runs) either way."""
    source = length.cumsum(0) - length  # where each run sits in the tensor
    keep = length > 0
    start, length, source = start[keep], length[keep], source[keep]
    order = start.argsort()  # the sorted order: increasing positions (runs are disjoint)
    start, length, source = start[order], length[order], source[order]
    joins = (start[:-1] + length[:-1] == start[1:]) & (source[:-1] + length[:-1] == source[1:])  # one run in both
    first = torch.cat((torch.ones(1, dtype=torch.bool), ~joins)).nonzero().flatten()
    ends = torch.cat((torch.zeros(1, dtype=torch.long), length.cumsum(0)))
    length = ends[torch.cat((first[1:], torch.tensor([length.numel()])))] - ends[first]
    source = source[first]
    if bool((source[1:] > source[:-1]).all()):
        return None  # the identity: the runs already lie in increasing order
    chunk = math.gcd(*length.tolist(), *source.tolist())
    if int(length.sum()) // chunk <= max(few, length.numel()):  # equal aligned chunks: few entries
        index = ShardRuns(source // chunk, length // chunk).positions()
        return Reorder(chunk, index.to(device), index.argsort().to(device))
    by_source = source.argsort()  # the runs in the tensor's order
    return Reorder(0, by_source.argsort().to(device), by_source.to(device), length[by_source].to(device))
