"""A ring_sp topology over Megatron's context-parallel (CP) group.

The SP group IS Megatron's CP group (per tensor/pipeline-parallel rank), split into
``U x R``. Megatron shards every batch, and its RoPE, by CP rank; ring_sp's layout rank is
``ring_rank * U + ulysses_rank``. With ``placement="ulysses_inner"`` (a Ulysses group is
``U`` consecutive CP ranks) the two are the same number, which is why the config rejects
``ring_inner`` for a true grid.

Megatron's hierarchical CP groups (``initialize_model_parallel(...,
hierarchical_context_parallel_sizes=[U, R])``) are exactly these groups: level 0 is ``U``
consecutive CP ranks (our Ulysses group), level 1 the ranks ``U`` apart (our ring). When
Megatron built them with those sizes they are reused; otherwise
:func:`ring_sp.init_sequence_parallel` creates them over the CP group. The data-parallel
fields of the topology are Megatron's own (DP, and DP x CP over which DDP reduces).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.distributed as dist

import ring_sp
from ring_sp import SequenceParallelTopology
from ring_sp.nodes import node_size_from_env

from .config import RingSPConfig

# One topology per (CP group, U, placement): every attention layer of a model shares it, and
# init_sequence_parallel (collective over the default group) runs once per rank.
_TOPOLOGIES: dict[tuple, SequenceParallelTopology] = {}


def topology_from_parallel_state(
    config: RingSPConfig,
    *,
    cp_group: dist.ProcessGroup | None = None,
    hcp_groups: Sequence[dist.ProcessGroup] | None = None,
    dp_group: dist.ProcessGroup | None = None,
    dp_cp_group: dist.ProcessGroup | None = None,
) -> SequenceParallelTopology:
    """The :class:`ring_sp.SequenceParallelTopology` of this rank's CP group, cached.

    Groups left as None come from ``megatron.core.parallel_state`` (initialised by
    ``initialize_model_parallel``); ``hcp_groups`` only with the CP group it belongs to.
    The first call for a CP group may create process groups, which is collective over the
    default group: every rank must make it (model construction does, since every rank
    builds its attention layers).
    """
    from megatron.core import parallel_state

    if cp_group is None:
        cp_group = parallel_state.get_context_parallel_group()
        if hcp_groups is None:
            hcp_groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group()
    if dp_cp_group is None:
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for stale in [key for key, topology in _TOPOLOGIES.items() if not _registered(topology)]:
        del _TOPOLOGIES[stale]  # its groups were destroyed: let them go (their threads end with them)
    key = (cp_group, config.ulysses_size, config.placement)
    if key not in _TOPOLOGIES:
        _TOPOLOGIES[key] = _build(config, cp_group, hcp_groups, dp_group, dp_cp_group)
    return _TOPOLOGIES[key]


def _registered(topology: SequenceParallelTopology) -> bool:
    """Whether every group of ``topology`` still exists (``destroy_process_group`` ends one; Megatron's
    ``destroy_model_parallel`` and a new ``initialize_model_parallel`` then make new ones)."""
    try:
        for group in (topology.sp_group, topology.ulysses_group, topology.ring_group, topology.dp_sp_group):
            if group is not None:
                dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # (torch raises KeyError or ValueError for an unknown group)
        return False
    return True


def _inside(groups: Sequence[dist.ProcessGroup], cp_group: dist.ProcessGroup) -> bool:
    """``groups`` exist and hold ranks of ``cp_group`` only. Megatron-core 0.16's
    ``destroy_model_parallel`` leaves its hierarchical CP groups behind: a later
    ``initialize_model_parallel`` without them still hands out the old (maybe destroyed) ones."""
    try:
        members = set(dist.get_process_group_ranks(cp_group))
        return all(set(dist.get_process_group_ranks(g)) <= members for g in groups)
    except (KeyError, ValueError, RuntimeError):
        return False


def _build(
    config: RingSPConfig,
    cp_group: dist.ProcessGroup,
    hcp_groups: Sequence[dist.ProcessGroup] | None,
    dp_group: dist.ProcessGroup,
    dp_cp_group: dist.ProcessGroup,
) -> SequenceParallelTopology:
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    u = config.ulysses_size
    if cp_size % u != 0:
        raise ValueError(
            f"--ring-sp-ulysses-size (ulysses_size)={u} must divide the context-parallel size {cp_size}"
        )
    r = cp_size // u
    dp = {"dp_size": dp_group.size(), "dp_rank": dp_group.rank(), "dp_group": dp_group, "dp_sp_group": dp_cp_group}
    if hcp_groups is not None and [g.size() for g in hcp_groups] == [u, r] and _inside(hcp_groups, cp_group):
        ulysses_group, ring_group = hcp_groups
        topology = SequenceParallelTopology(
            ulysses_size=u, ring_size=r, placement=config.placement, rank=dist.get_rank(),
            ring_rank=ring_group.rank(), ulysses_rank=ulysses_group.rank(), sp_group=cp_group,
            ulysses_group=ulysses_group, ring_group=ring_group, sp_group_layout_ranks=tuple(range(cp_size)),
            node_size=node_size_from_env(), **dp,  # (the launcher's ranks per node: a double ring's inner rings)
        )
    else:
        topology = dataclasses.replace(ring_sp.init_sequence_parallel(u, r, placement=config.placement, group=cp_group), **dp)
    if topology.sp_rank != cp_rank:  # Megatron's batch and RoPE shards would not be ours
        raise RuntimeError(
            f"ring_sp layout rank {topology.sp_rank} differs from Megatron's context-parallel rank {cp_rank} "
            f"({topology!r}); use placement='ulysses_inner'"
        )
    return topology
