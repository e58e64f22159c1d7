"""Which kernel calls compute a ring step's blocks: a pure function of the blocks and of what
the kernel takes (:class:`KernelCaps`), kept apart from the schedule, which knows no kernel.

A kernel without varlen support gets one call per block. A kernel that takes many blocks in
one call (flash-attention's ``cu_seqlens``: segment ``i`` is queries ``cu_q[i]:cu_q[i+1]``
against keys ``cu_k[i]:cu_k[i+1]``, each with the same window, aligned to its own bottom-right
corner) gets the blocks of a step grouped: blocks with the same window
(:func:`~.blocks.bottom_right_window`; a side no row of a block meets fits any) whose query
rows AND keys both increase (a chain: the
segments of one call are consecutive slices of the ONE q and the ONE k tensor, read in place)
become one call. Gaps between a chain's blocks become filler segments that compute nothing:
keys and no queries, or queries and no keys (those rows come back with out 0 and lse +inf,
which the kernel turns into -inf). Chains are found greedily in (query, key) order, each
block going to the chain whose last keys end latest before its own (fewest chains for this
two-sided order). Blocks come back in calls unchanged, so any block kind a schedule issues
(plain, causal, bands, the bidirectional spans) flows through.
"""

from __future__ import annotations

from typing import NamedTuple

from .blocks import BlockTask, bottom_right_window

# the windows a varlen kernel without window arguments still takes: full blocks and causal squares
_PLAIN_WINDOWS = ((-1, -1), (-1, 0))


class KernelCaps(NamedTuple):
    """What a kernel takes, as far as the schedule's blocks are concerned."""

    bands: bool = False  # any band whole, by window arguments (else squares, edge blocks flipped)
    varlen: bool = False  # many blocks in one call (cu_seqlens)
    explicit_masks: bool = False  # applies a mask as a dense tensor: computes every masked block's rectangle


class KernelCall(NamedTuple):
    """One kernel launch of a ring step.

    ``blocks``: what it computes. ``q`` / ``kv``: the local rows it reads and writes and the
    visiting keys it reads (the blocks' hull). ``segments``: for a varlen call, (queries, keys)
    of each segment in order, fillers included, starting at ``q.start`` / ``kv.start``;
    empty for a dense call of its one block. ``window``: the varlen call's bottom-right
    ``(left, right)`` (-1: unbounded); a dense call's block carries its own mask."""

    blocks: tuple[BlockTask, ...]
    q: slice
    kv: slice
    segments: tuple[tuple[int, int], ...] = ()
    window: tuple[int, int] = (-1, -1)

    @property
    def fills_rows(self) -> bool:
        """Some segment has queries and no keys (its rows come back lse +inf from the op)."""
        return any(nq and not nk for nq, nk in self.segments)

    def offsets(self) -> tuple[list[int], list[int]]:
        """Cumulative segment starts ``(cu_q, cu_k)``, each ``len(segments) + 1`` long, from 0."""
        cu_q, cu_k = [0], [0]
        for nq, nk in self.segments:
            cu_q.append(cu_q[-1] + nq)
            cu_k.append(cu_k[-1] + nk)
        return cu_q, cu_k

    def max_lengths(self) -> tuple[int, int]:
        """Longest segment in queries and in keys, fillers included (the op's grid covers them)."""
        return max(nq for nq, _ in self.segments), max(nk for _, nk in self.segments)


def dense_call(task: BlockTask) -> KernelCall:
    return KernelCall((task,), task.q, task.kv)


def step_calls(tasks: tuple[BlockTask, ...], caps: KernelCaps) -> tuple[KernelCall, ...]:
    """The kernel calls of one ring step's ``tasks`` (see the module docstring), in the order
    of each call's first block among ``tasks``."""
    if not caps.varlen or len(tasks) < 2:
        return tuple(dense_call(t) for t in tasks)
    groups: dict[tuple[int, int], list[int]] = {}
    alone: list[int] = []
    windows = [_window_of(task) for task in tasks]
    # blocks with fewer free sides first: a free side (-1: no row meets that bound) fits any group's
    for index in sorted(range(len(tasks)), key=lambda i: -1 if windows[i] is None else windows[i].count(-1)):
        window = windows[index]
        if window is None:  # no window states it exactly (the kernel cuts it itself)
            alone.append(index)
            continue
        if window in groups:
            groups[window].append(index)
            continue
        fits = next((w for w in groups if _fits(tasks[index], window, w)), None)
        if fits is not None:
            groups[fits].append(index)
        elif caps.bands or window in _PLAIN_WINDOWS:
            groups[window] = [index]
        else:  # a window the kernel takes no argument for (it flips edge blocks itself)
            alone.append(index)
    calls: list[tuple[int, KernelCall]] = [(i, dense_call(tasks[i])) for i in alone]
    for window, members in groups.items():
        for chain in _chains([tasks[i] for i in members], members):
            first = min(i for i, _ in chain)
            blocks = tuple(t for _, t in chain)
            calls.append((first, dense_call(blocks[0]) if len(blocks) == 1 else _varlen_call(blocks, window)))
    return tuple(call for _, call in sorted(calls, key=lambda c: c[0]))


def _window_of(task: BlockTask) -> tuple[int, int] | None:
    try:
        return bottom_right_window(task.q.stop - task.q.start, task.kv.stop - task.kv.start, task.causal,
                                   task.window, task.diagonal)
    except ValueError:
        return None


def _fits(task: BlockTask, own: tuple[int, int], group: tuple[int, int]) -> bool:
    """Whether the group's window states ``task`` (its own window ``own``) exactly: each side
    equal, or free for the block (-1) and unbounded or out of its reach in the group."""
    nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
    left = own[0] == group[0] or (own[0] == -1 and (group[0] == -1 or group[0] >= nk - 1))
    right = own[1] == group[1] or (own[1] == -1 and (group[1] == -1 or group[1] >= nq - 1))
    return left and right


def _chains(tasks: list[BlockTask], ids: list[int]) -> list[list[tuple[int, BlockTask]]]:
    """Cover the blocks with chains increasing in both rows and keys, greedily (module docstring)."""
    chains: list[list[tuple[int, BlockTask]]] = []
    for index, task in sorted(zip(ids, tasks), key=lambda it: (it[1].q.start, it[1].kv.start)):
        best = None
        for chain in chains:
            last = chain[-1][1]
            if last.q.stop <= task.q.start and last.kv.stop <= task.kv.start and (
                    best is None or last.kv.stop > best[-1][1].kv.stop):
                best = chain
        if best is None:
            chains.append([(index, task)])
        else:
            best.append((index, task))
    return chains


def _varlen_call(blocks: tuple[BlockTask, ...], window: tuple[int, int]) -> KernelCall:
    segments: list[tuple[int, int]] = []
    q_at, kv_at = blocks[0].q.start, blocks[0].kv.start
    for task in blocks:
        if task.kv.start > kv_at:  # keys no block of the chain reads: a segment without queries
            segments.append((0, task.kv.start - kv_at))
        if task.q.start > q_at:  # rows no block of the chain writes: a segment without keys
            segments.append((task.q.start - q_at, 0))
        segments.append((task.q.stop - task.q.start, task.kv.stop - task.kv.start))
        q_at, kv_at = task.q.stop, task.kv.stop
    return KernelCall(blocks, slice(blocks[0].q.start, q_at), slice(blocks[0].kv.start, kv_at), tuple(segments),
                      window)
