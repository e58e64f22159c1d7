"""The DP x (U x R) topology: pure rank math, then the real groups on gloo ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import ring_sp
from ring_sp.topology import rank_grid, topology_ranks


def test_ulysses_inner_puts_ulysses_groups_on_consecutive_ranks() -> None:
    grid = rank_grid(16, 2, 4, "ulysses_inner")
    assert grid.dp_size == 2
    assert grid.sp_groups == [list(range(8)), list(range(8, 16))]
    assert grid.ulysses_groups[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.ring_groups[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.dp_groups[:3] == [[0, 8], [1, 9], [2, 10]]


def test_ring_inner_puts_rings_on_consecutive_ranks() -> None:
    grid = rank_grid(8, 2, 4, "ring_inner")
    assert grid.ring_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.ulysses_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("num_ranks,u,r", [(4, 1, 4), (4, 4, 1), (8, 2, 2), (12, 2, 3), (12, 3, 2), (32, 4, 8)])
@pytest.mark.parametrize("placement", ["ulysses_inner", "ring_inner"])
def test_groups_partition_the_ranks_and_coordinates_round_trip(num_ranks: int, u: int, r: int, placement: str) -> None:
    grid = rank_grid(num_ranks, u, r, placement)
    for groups, size in ((grid.sp_groups, u * r), (grid.ulysses_groups, u), (grid.ring_groups, r), (grid.dp_groups, grid.dp_size)):
        assert all(len(g) == size for g in groups)
        assert sorted(x for g in groups for x in g) == list(range(num_ranks))
    for position in range(num_ranks):
        c = grid.coordinates(position)
        assert grid.position(c.dp_rank, c.ring_rank, c.ulysses_rank) == position
    for group in grid.ulysses_groups:  # a Ulysses group: one DP replica, one ring rank
        coords = [grid.coordinates(p) for p in group]
        assert [c.ulysses_rank for c in coords] == list(range(u))
        assert len({(c.dp_rank, c.ring_rank) for c in coords}) == 1


@pytest.mark.parametrize("sizes,match", [
    ((3, 2), r"not divisible by ulysses_size x ring_size = 3 x 2 = 6 \(8 % 6 = 2\)"),
    ((0, 2), r"ulysses_size=0 must be >= 1"),
    ((2.0, 2), r"ulysses_size must be an int; got float 2.0"),
])
def test_bad_sizes_are_refused_with_the_equation(sizes, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        rank_grid(8, *sizes)
    with pytest.raises(ValueError, match=r"placement='inner' is not one of"):
        rank_grid(8, 2, 2, "inner")


def _describe(u: int, r: int, placement: str) -> dict:
    topo = ring_sp.init_sequence_parallel(u, r, placement=placement)
    return {"ranks": topology_ranks(topo), "sp_rank": topo.sp_rank, "dp_rank": topo.dp_rank,
            "ring_rank": topo.ring_rank, "ulysses_rank": topo.ulysses_rank,
            "group_ranks": (dist.get_rank(topo.ulysses_group), dist.get_rank(topo.ring_group)),
            "layout_ranks": topo.sp_group_layout_ranks}


@pytest.mark.parametrize("u,r,placement", [(2, 1, "ulysses_inner"), (1, 2, "ulysses_inner"), (2, 2, "ring_inner")])
def test_real_groups_match_the_rank_math(pools, u: int, r: int, placement: str) -> None:
    world = 4
    results = pools.get(world).run(_describe, u, r, placement)
    grid = rank_grid(world, u, r, placement)
    for rank, got in enumerate(results):
        c = grid.coordinates(rank)
        assert (got["dp_rank"], got["ring_rank"], got["ulysses_rank"]) == (c.dp_rank, c.ring_rank, c.ulysses_rank)
        assert got["sp_rank"] == c.ring_rank * u + c.ulysses_rank
        assert got["group_ranks"] == (c.ulysses_rank, c.ring_rank)  # group rank IS the grid coordinate
        assert rank in got["ranks"]["ulysses"] and got["ranks"]["ulysses"] in grid.ulysses_groups
        assert got["ranks"]["ring"] in grid.ring_groups and got["ranks"]["dp"] in grid.dp_groups
        assert got["ranks"]["sp"] in grid.sp_groups and got["ranks"]["dp_sp"] == list(range(world))
        assert sorted(got["layout_ranks"]) == list(range(u * r))


def _two_topologies() -> tuple[int, int]:
    """Two topologies on the same ranks must not share state or groups."""
    a = ring_sp.init_sequence_parallel(2, 2)
    b = ring_sp.init_sequence_parallel(1, 4)
    assert a.ring_group is not b.ring_group
    return dist.get_world_size(a.ring_group), dist.get_world_size(b.ring_group)


def test_two_topologies_coexist(pools) -> None:
    assert pools.get(4).run(_two_topologies) == [(2, 4)] * 4


def _subgroup_parents() -> dict:
    """Megatron-style: the world splits into two parents of 4; each is split U2 x R2."""
    parents = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    mine = parents[dist.get_rank() // 4]
    topo = ring_sp.init_sequence_parallel(2, 2, group=mine)
    return topology_ranks(topo)


def test_topology_over_subgroups(pools) -> None:
    results = pools.get(8).run(_subgroup_parents)
    assert results[5]["ulysses"] == [4, 5] and results[5]["ring"] == [5, 7] and results[5]["dp_sp"] == [4, 5, 6, 7]
    assert results[2]["ring"] == [0, 2] and results[2]["dp"] == [2]
