"""Nodes (issue 45 item 1): the node size the launchers export, the link each group uses, the
advice when the all-to-all needlessly crosses nodes; then a real topology on gloo ranks."""

from __future__ import annotations

import warnings

import pytest

import ring_sp
from ring_sp.grid import rank_grid
from ring_sp.nodes import check_node_size, grid_links, group_link, node_size_from_env, placement_advice


@pytest.mark.parametrize("environ,expected", [
    ({"LOCAL_WORLD_SIZE": "8"}, 8),                       # torchrun, accelerate, Megatron
    ({"LOCAL_SIZE": "4"}, 4),                             # the DeepSpeed launcher
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2),             # mpirun
    ({"LOCAL_WORLD_SIZE": "1", "LOCAL_SIZE": "2"}, 2),    # DeepSpeed's first (accelerate's MULTI_CPU writes 1)
    ({}, None),
])
def test_node_size_comes_from_the_launchers_environment(environ: dict, expected: int | None) -> None:
    assert node_size_from_env(environ) == expected


def test_a_malformed_node_size_is_named() -> None:
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE='two'"):
        node_size_from_env({"LOCAL_WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match=r"node_size=3 does not divide the 8 ranks"):
        check_node_size(3, 8)
    with pytest.raises(ValueError, match=r"node_size=0 must be a positive int"):
        check_node_size(0, 8)
    check_node_size(8, 4)  # a job smaller than one node


@pytest.mark.parametrize("world,u,r,placement,node,expected", [
    (16, 2, 8, "ulysses_inner", 8, {"ulysses": "intra", "ring": "inter", "dp": "-"}),
    (16, 2, 8, "ring_inner", 8, {"ulysses": "inter", "ring": "intra", "dp": "-"}),
    (16, 2, 4, "ulysses_inner", 8, {"ulysses": "intra", "ring": "intra", "dp": "inter"}),
    (16, 16, 1, "ulysses_inner", 8, {"ulysses": "inter", "ring": "-", "dp": "-"}),
    (4, 2, 2, "ulysses_inner", 2, {"ulysses": "intra", "ring": "inter", "dp": "-"}),
    (8, 1, 8, "ulysses_inner", 8, {"ulysses": "-", "ring": "intra", "dp": "-"}),
])
def test_links_of_each_kind_of_group(world, u, r, placement, node, expected) -> None:
    assert grid_links(rank_grid(world, u, r, placement), node) == expected


def test_links_follow_the_parents_global_ranks() -> None:
    # Megatron with TP 2: a context-parallel parent is every other rank; 4 of them span two nodes of 4
    parent = [1, 3, 5, 7]
    grid = rank_grid(4, 2, 2, "ulysses_inner")
    assert grid_links(grid, 4, parent) == {"ulysses": "intra", "ring": "inter", "dp": "-"}
    assert group_link(grid.ulysses_groups, 4) == "intra" and group_link(grid.ring_groups, 2, parent) == "inter"


def test_advice_names_the_placement_that_keeps_the_all_to_all_inside_a_node() -> None:
    advice = placement_advice(list(range(16)), 2, 8, "ring_inner", 8)
    assert "placement='ring_inner' sends the Ulysses all-to-all" in advice and "placement='ulysses_inner'" in advice
    assert placement_advice(list(range(16)), 2, 8, "ulysses_inner", 8) is None
    assert placement_advice(list(range(8)), 2, 4, "ring_inner", 8) is None  # one node: nothing crosses
    straddle = placement_advice(list(range(12)), 4, 3, "ulysses_inner", 6)
    assert "ulysses_size=4 does not divide the node size 6" in straddle and "(e.g. 3)" in straddle
    assert placement_advice(list(range(32)), 16, 2, "ulysses_inner", 8) is None  # U > node: must cross


def _topology(node_size: int | None, placement: str) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        topo = ring_sp.init_sequence_parallel(2, 2, placement=placement, node_size=node_size)
    return topo.node_size, dict(topo.links), [str(w.message) for w in caught if "ring_sp:" in str(w.message)], repr(topo)


def test_topology_states_links_and_warns_on_rank_zero(pools) -> None:
    pool = pools.get(4)
    results = pool.run(_topology, 2, "ulysses_inner")
    assert all(r[:3] == (2, {"ulysses": "intra", "ring": "inter", "dp": "-"}, []) for r in results)
    assert "links {'ulysses': 'intra', 'ring': 'inter', 'dp': '-'} (nodes of 2 ranks))" in results[0][3]
    results = pool.run(_topology, 2, "ring_inner")
    assert results[0][1]["ulysses"] == "inter" and len(results[0][2]) == 1 and "placement='ulysses_inner'" in results[0][2][0]
    assert [r[2] for r in results[1:]] == [[], [], []]  # once per grid
    unknown = pool.run(_topology, None, "ulysses_inner")
    assert unknown[0][:3] == (None, {}, [])  # the pool's ranks have no launcher environment


def _bad_node_size() -> None:
    ring_sp.init_sequence_parallel(2, 2, node_size=3)


def test_a_bad_node_size_raises_on_every_rank_before_any_group(pools) -> None:
    with pytest.raises(Exception, match=r"node_size=3 does not divide the 4 ranks"):
        pools.get(4).run(_bad_node_size)
