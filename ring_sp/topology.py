"""The process-group topology of a ``DP x (U x R)`` sequence-parallel job.

``init_sequence_parallel`` builds, on every rank and in the same order, every group a
training job needs, and returns them in one object: nothing is stored in module
globals, so two topologies can coexist (DESIGN.md section 6).

Rank math (pure, see :func:`rank_grid`): the parent group's ranks are split into
``DP`` consecutive blocks of ``SP = U * R`` ranks (DP outermost, as in DeepSpeed and
Megatron). Inside a block, position ``p`` is

* ``ulysses_inner`` (default): ``p = ring_rank * U + ulysses_rank`` - a Ulysses group is
  ``U`` consecutive ranks (one node's fast links carry the all-to-all);
* ``ring_inner``: ``p = ulysses_rank * R + ring_rank`` - a ring is ``R`` consecutive ranks.

Whatever the placement, the sequence layout uses ``sp_rank = ring_rank * U + ulysses_rank``
(:attr:`SequenceParallelTopology.sp_rank`); shard inputs with that, not the group rank.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .data import shard_batch, sharded_together
from .grid import PLACEMENTS, Coordinates, RankGrid, check_sizes, rank_grid
from .nodes import check_node_size, describe_links, grid_links, node_size_from_env, placement_advice
from .sequence_shards import gather_sequence, shard_sequence

@dataclass(frozen=True)
class SequenceParallelTopology:
    """All groups of this rank in a ``DP x (U x R)`` job, and its coordinates.

    ``sp_group``: the ``U*R`` ranks sharing one sample; ``ulysses_group`` / ``ring_group``:
    this rank's Ulysses and ring groups (group rank = ``ulysses_rank`` / ``ring_rank``);
    ``dp_group``: ranks holding the same sequence shard of different samples;
    ``dp_sp_group``: all ``DP x SP`` ranks, over which gradients are averaged.
    ``node_size``: ranks per node (None: unknown); ``links``: the link each kind of group uses,
    ``{"ulysses" | "ring" | "dp": "intra" | "inter" | "-"}`` (:mod:`ring_sp.nodes`; empty when
    the node size is unknown).
    """

    ulysses_size: int
    ring_size: int
    placement: str
    dp_size: int
    rank: int
    dp_rank: int
    ring_rank: int
    ulysses_rank: int
    sp_group: dist.ProcessGroup
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dp_sp_group: dist.ProcessGroup
    sp_group_layout_ranks: tuple[int, ...]  # sp_rank of each sp_group rank
    node_size: int | None = None
    links: Mapping[str, str] = field(default_factory=dict)

    @property
    def sp_size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def sp_rank(self) -> int:
        """The rank the sequence layout uses: ``ring_rank * U + ulysses_rank``."""
        return _layout_rank(Coordinates(self.dp_rank, self.ring_rank, self.ulysses_rank), self.ulysses_size)

    def shard_sequence(self, x: torch.Tensor, *, layout: str = "zigzag", dim: int = 1,
                       cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """This rank's shard of a global sequence tensor (length N along ``dim`` -> N / sp_size)."""
        return shard_sequence(x, rank=self.sp_rank, world_size=self.sp_size, layout=layout, dim=dim, cu_seqlens=cu_seqlens)

    def gather_sequence(self, x: torch.Tensor, *, layout: str = "zigzag", dim: int = 1,
                        cu_seqlens: torch.Tensor | Sequence[int] | None = None, seq_len: int | None = None) -> torch.Tensor:
        """The global sequence from every SP rank's shard, in natural order (differentiable);
        ``seq_len``: keep the first ``seq_len`` tokens (drop the padding ``shard_batch`` added)."""
        return gather_sequence(x, group=self.sp_group, layout=layout, dim=dim, layout_ranks=self.sp_group_layout_ranks,
                               cu_seqlens=cu_seqlens, seq_len=seq_len)

    def shard_batch(self, batch: Mapping[str, torch.Tensor], *, layout: str = "zigzag", shift: bool = True,
                    cu_seqlens: torch.Tensor | Sequence[int] | None = None, pad_id: int = 0,
                    spans: torch.Tensor | Sequence[Sequence[int]] | None = None,
                    validate: bool | None = None) -> dict[str, torch.Tensor]:
        """:func:`ring_sp.shard_batch` for this rank's ``sp_rank``. Every rank of the SP group
        calls it with the same global batch: an error on one rank (a wrong layout, documents or
        spans, a malformed batch) raises that rank's message on every rank of the SP group
        (:func:`ring_sp.data.sharded_together`: one small agreement; none in a DataLoader worker,
        nor with ``validate=False`` / ``RING_SP_VALIDATE=0``)."""
        return sharded_together(
            self.sp_group if self.sp_size > 1 else None, batch, layout,
            lambda: shard_batch(batch, rank=self.sp_rank, world_size=self.sp_size, layout=layout, shift=shift,
                                cu_seqlens=cu_seqlens, pad_id=pad_id, spans=spans),
            validate=validate)

    def __repr__(self) -> str:
        return (
            f"SequenceParallelTopology(dp={self.dp_size} x (ulysses={self.ulysses_size} x "
            f"ring={self.ring_size}), placement={self.placement!r}, rank={self.rank}, "
            f"dp_rank={self.dp_rank}, sp_rank={self.sp_rank}, ring_rank={self.ring_rank}, "
            f"ulysses_rank={self.ulysses_rank}" + (f", {describe_links(self.links, self.node_size)}" if self.node_size else "")
            + ")"
        )


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """The timeout ``group`` (None = default group) was created with, or None if unknown.

    ``new_group`` does NOT inherit the default group's timeout (it falls back to 30
    minutes), so the topology passes this explicitly: a failure in a subgroup then
    surfaces as fast as the user asked for in ``init_process_group``.
    """
    group = group if group is not None else dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:  # private but stable since torch 2.0: Backend.Options._timeout
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _parent_ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def init_sequence_parallel(
    ulysses_size: int,
    ring_size: int,
    *,
    placement: str = "ulysses_inner",
    group: dist.ProcessGroup | None = None,
    timeout: datetime.timedelta | None = None,
    node_size: int | None = None,
) -> SequenceParallelTopology:
    """Create the ``DP x (U x R)`` groups over ``group`` (None = the default group).

    ``node_size``: ranks per node (default: what the launcher exported, ``LOCAL_WORLD_SIZE`` /
    ``LOCAL_SIZE``; None when nothing did). The topology then states which link each group's
    traffic uses (``topology.links``) and warns when the Ulysses all-to-all needlessly crosses
    nodes, naming the placement or size that keeps it inside one (:mod:`ring_sp.nodes`).

    Collective over the DEFAULT group: every rank must call it, each passing its own
    ``group`` when the job splits into several parents (e.g. Megatron's context-parallel
    groups); the parents are exchanged so every rank creates every group in one order.
    ``timeout`` bounds every collective on the new groups (default: the timeout of
    ``group``, i.e. what was given to ``init_process_group``).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call torch.distributed.init_process_group first")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None; got {type(group).__name__} {group!r}")
    mine = _parent_ranks(group)
    if dist.get_rank() not in mine:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the group it passed as group= (ranks {mine}); "
            f"every rank passes the parent group it belongs to"
        )
    if group is None:
        parents = [mine]
    else:  # every rank learns every parent, so all create the same groups in the same order
        gathered: list[list[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        parents = sorted({tuple(p) for p in gathered if p is not None})  # type: ignore[misc]
        parents = [list(p) for p in parents]
        _check_disjoint(parents)
    for parent in parents:  # same check on every rank, so all raise together
        check_sizes(ulysses_size, ring_size, placement, len(parent))
    node_size = node_size if node_size is not None else node_size_from_env()
    if node_size is not None:
        check_node_size(node_size, dist.get_world_size())

    me = dist.get_rank()
    found: dict[str, dist.ProcessGroup] = {}
    separate_whole = group is not None or timeout is not None  # else WORLD serves as DP x SP
    timeout = timeout if timeout is not None else group_timeout(group)
    for parent in parents:
        grid = rank_grid(len(parent), ulysses_size, ring_size, placement)
        for kind, groups in (("sp", grid.sp_groups), ("ulysses", grid.ulysses_groups),
                             ("ring", grid.ring_groups), ("dp", grid.dp_groups)):
            for positions in groups:
                ranks = [parent[p] for p in positions]
                created = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    found[kind] = created
        whole = dist.new_group(parent, timeout=timeout) if separate_whole else dist.group.WORLD
        if me in parent:
            found["dp_sp"] = whole
            coords = grid.coordinates(parent.index(me))
            my_sp_group = [parent[p] for p in grid.sp_groups[coords.dp_rank]]
            sp_layout_ranks = tuple(
                _layout_rank(grid.coordinates(parent.index(rank)), ulysses_size) for rank in sorted(my_sp_group)
            )
            links = grid_links(grid, node_size, parent) if node_size is not None else {}
            advice = placement_advice(parent, ulysses_size, ring_size, placement, node_size) if node_size else None
            if advice and me == parent[0]:  # once per grid
                warnings.warn(f"ring_sp: {advice}", stacklevel=2)
    return SequenceParallelTopology(
        ulysses_size=ulysses_size, ring_size=ring_size, placement=placement, dp_size=len(mine) // (ulysses_size * ring_size),
        rank=me, dp_rank=coords.dp_rank, ring_rank=coords.ring_rank, ulysses_rank=coords.ulysses_rank,
        sp_group=found["sp"], ulysses_group=found["ulysses"], ring_group=found["ring"], dp_group=found["dp"],
        dp_sp_group=found["dp_sp"], sp_group_layout_ranks=sp_layout_ranks, node_size=node_size, links=links,
    )


def _layout_rank(coords: Coordinates, ulysses_size: int) -> int:
    return coords.ring_rank * ulysses_size + coords.ulysses_rank


def _check_disjoint(parents: list[list[int]]) -> None:
    seen: dict[int, list[int]] = {}
    for parent in parents:
        for rank in parent:
            if rank in seen:
                raise ValueError(
                    f"the groups passed as group= overlap: rank {rank} is in both {seen[rank]} and {parent}; "
                    f"pass disjoint groups (one per data/model-parallel replica)"
                )
            seen[rank] = parent


def topology_ranks(topology: SequenceParallelTopology) -> dict[str, list[int]]:
    """Global ranks of each group of ``topology`` (for logs and tests)."""
    return {
        name: dist.get_process_group_ranks(getattr(topology, f"{name}_group"))
        for name in ("sp", "ulysses", "ring", "dp", "dp_sp")
    }


__all__ = ["PLACEMENTS", "RankGrid", "SequenceParallelTopology", "init_sequence_parallel", "rank_grid", "topology_ranks"]
