"""Which node each rank is on, and which link each group of a grid uses (pure, no collectives).

Every launcher numbers ranks node by node: node ``n`` of ``node_size`` ranks holds global ranks
``n * node_size .. (n + 1) * node_size - 1`` (torchrun, the DeepSpeed launcher, accelerate,
Megatron's scripts, ``srun`` starting one torchrun per node). So a node size is all the grid
needs to know where its all-to-alls and ring messages travel:

* ``'intra'``: every group of that kind lies inside one node (NVLink / NVSwitch);
* ``'inter'``: some group spans nodes (InfiniBand / Ethernet: ~10x slower per GPU);
* ``'-'``: groups of one rank (nothing travels).

:func:`node_size_from_env` reads the size the launchers export; :func:`placement_advice` says
when a grid sends Ulysses' all-to-all across nodes although another placement or size would not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from .grid import PLACEMENTS, RankGrid, rank_grid
from .shapes import divisors

# Ranks per node as the launchers export them: the DeepSpeed launcher (LOCAL_SIZE), torchrun / accelerate /
# Megatron (LOCAL_WORLD_SIZE), Open MPI and MPICH (mpirun, DeepSpeed's MPI runners). DeepSpeed's first:
# accelerate on CPU ranks (MULTI_CPU) writes LOCAL_WORLD_SIZE=1 when it finds none of its own variables,
# which under DeepSpeed's launcher would turn every rank into a node.
NODE_SIZE_ENV = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
LINKS = ("intra", "inter", "-")


def node_size_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """Ranks per node from the first of :data:`NODE_SIZE_ENV` that is set, or None (unknown)."""
    environ = os.environ if environ is None else environ
    for name in NODE_SIZE_ENV:
        value = environ.get(name)
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{name}={value!r} (ranks per node, set by the launcher) must be a positive int")
            return int(value)
    return None


def check_node_size(node_size: object, world_size: int) -> None:
    """Raise naming ``node_size`` when it is not a positive int dividing ``world_size``."""
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size={node_size!r} must be a positive int (ranks per node) or None (from the launcher's "
                         f"environment: {', '.join(NODE_SIZE_ENV)})")
    if world_size > node_size and world_size % node_size:
        raise ValueError(f"node_size={node_size} does not divide the {world_size} ranks of the job: every node runs "
                         f"the same number of ranks (pass node_size= or fix the launcher's ranks per node)")


def group_link(groups: Sequence[Sequence[int]], node_size: int, ranks: Sequence[int] | None = None) -> str:
    """The link the groups' traffic uses (``LINKS``). ``groups`` hold positions in ``ranks`` (the
    parent group's global ranks; None: positions are global ranks)."""
    if len(groups[0]) == 1:
        return "-"
    spans = any(len({(ranks[p] if ranks is not None else p) // node_size for p in group}) > 1 for group in groups)
    return "inter" if spans else "intra"


def grid_links(grid: RankGrid, node_size: int, ranks: Sequence[int] | None = None) -> dict[str, str]:
    """The link of each kind of group of ``grid`` (``ulysses``, ``ring``, ``dp``) on nodes of ``node_size``."""
    return {"ulysses": group_link(grid.ulysses_groups, node_size, ranks),
            "ring": group_link(grid.ring_groups, node_size, ranks),
            "dp": group_link(grid.dp_groups, node_size, ranks)}


def describe_links(links: Mapping[str, str], node_size: int | None) -> str:
    """``links {...} (nodes of N ranks)`` for logs; empty when the node size is unknown."""
    return f"links {dict(links)} (nodes of {node_size} ranks)" if node_size else ""


def placement_advice(ranks: Sequence[int], ulysses_size: int, ring_size: int, placement: str,
                     node_size: int) -> str | None:
    """Why a grid over ``ranks`` (global ranks) sends its all-to-all needlessly across nodes, and
    what keeps it inside one; None when it does not.

    Needless: another placement keeps every Ulysses group inside a node (``ring_inner`` strides
    a Ulysses group over R ranks), or ``ulysses_size`` does not divide ``node_size`` so some
    groups straddle two nodes. ``U > node_size`` must cross nodes: no advice.
    """
    if ulysses_size == 1 or ulysses_size > node_size:
        return None
    links = {p: group_link(rank_grid(len(ranks), ulysses_size, ring_size, p).ulysses_groups, node_size, ranks)
             for p in PLACEMENTS}
    if links[placement] == "intra":
        return None
    better = [p for p in PLACEMENTS if links[p] == "intra"]
    if better:
        return (f"placement={placement!r} sends the Ulysses all-to-all (ulysses_size={ulysses_size}) across nodes of "
                f"{node_size} ranks; placement={better[0]!r} keeps every Ulysses group inside one node (NVLink) and "
                f"puts the ring's point-to-point messages on the inter-node links instead")
    return (f"ulysses_size={ulysses_size} does not divide the node size {node_size}: some Ulysses groups straddle two "
            f"nodes, so their all-to-all crosses the inter-node links; choose a ulysses_size that divides {node_size} "
            f"(e.g. {max(u for u in divisors(node_size) if u <= ulysses_size)})")


def ring_inner_size(ranks: Sequence[int], node_size: int | None) -> int:
    """Ring ranks per node of a ring over global ``ranks`` (in ring order) on nodes of ``node_size``:
    what a double ring's inner rings hold (``kv_exchange="double_ring"``, :mod:`ring_sp.schedule.ring_order`).
    Raises, naming the fix, when the node size is unknown or a node's ring ranks are not consecutive
    in the ring or not as many as every other node's."""
    if node_size is None:
        raise ValueError(f"kv_exchange='double_ring' needs the node size: launch with a launcher that exports one of "
                         f"{', '.join(NODE_SIZE_ENV)}, or pass node_size= to ring_sp.init_sequence_parallel")
    nodes = [rank // node_size for rank in ranks]
    inner = next((i for i, node in enumerate(nodes) if node != nodes[0]), len(nodes))
    blocks = [nodes[i:i + inner] for i in range(0, len(nodes), inner)]
    if len(nodes) % inner or any(len(set(block)) != 1 for block in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ValueError(f"kv_exchange='double_ring': the ring's ranks {list(ranks)} lie on nodes {nodes} (nodes of "
                         f"{node_size} ranks): a double ring needs each node's ring ranks consecutive in the ring and "
                         f"as many on every node (placement='ulysses_inner' with a ulysses_size dividing {node_size}); "
                         f"use kv_exchange='ring'")
    return inner


__all__ = ["LINKS", "NODE_SIZE_ENV", "check_node_size", "describe_links", "grid_links", "group_link", "node_size_from_env",
           "placement_advice", "ring_inner_size"]
