"""C6/C7: Ulysses and the ring x Ulysses grid against the float64 oracle."""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_cases import AttnCase, check_attention_cases, global_outputs, gradcheck_case


def _heads_for(u: int) -> list[tuple[int, int]]:
    """(q heads, kv heads) with h_kv < U, = U and > U where the head count allows."""
    h = 2 * u if u > 1 else 4
    return sorted({(h, 1), (h, u), (2 * h, 2 * u)} | ({(h, 2)} if u % 2 == 0 else set()))


def _grid_cases(u: int, r: int, placement: str, dtypes: tuple[str, ...]) -> list[AttnCase]:
    layouts = ["zigzag", "contiguous"] + (["striped"] if u == 1 or r == 1 else [])
    shapes = itertools.cycle([(1, 8, 2), (2, 16, 6), (1, 80, 4)])
    cases = []
    for layout, causal, dtype, (h, h_kv) in itertools.product(layouts, (True, False), dtypes, _heads_for(u)):
        b, d, n = next(shapes)
        cases.append(AttnCase("hybrid", layout, causal, b, n, h, h_kv, d, dtype, seed=len(cases),
                              ulysses=u, ring=r, placement=placement))
    return cases


@pytest.mark.parametrize("world_size,u,r", [(4, 1, 4), (4, 4, 1), (4, 2, 2), (6, 2, 3), (6, 3, 2), (8, 2, 4)])
@pytest.mark.parametrize("placement", ["ulysses_inner", "ring_inner"])
def test_grid_equivalence(pools, world_size: int, u: int, r: int, placement: str) -> None:
    dtypes = ("fp64", "fp32", "bf16") if placement == "ulysses_inner" else ("fp32",)
    pools.get(world_size).run(check_attention_cases, _grid_cases(u, r, placement, dtypes), timeout=600)


@pytest.mark.parametrize("u,r", [(2, 1), (1, 2)])
def test_data_parallel_replicas_each_get_their_own_exact_result(pools, u: int, r: int) -> None:
    """DP=2 x SP=2: each DP replica attends over its own sample (seeded by dp_rank)."""
    pools.get(4).run(check_attention_cases, _grid_cases(u, r, "ulysses_inner", ("fp64",)), timeout=600)


def test_ulysses_functional_api(pools) -> None:
    """``ulysses_attention`` over the default group, every layout, GQA replication included."""
    cases = [AttnCase("ulysses", layout, causal, 2, 4, h, h_kv, 16, dtype, seed=i)
             for i, (layout, causal, dtype, (h, h_kv)) in enumerate(itertools.product(
                 ("zigzag", "contiguous", "striped"), (True, False), ("fp64", "bf16"), ((4, 4), (8, 2), (4, 1), (8, 8))))]
    pools.get(4).run(check_attention_cases, cases, timeout=600)


def test_two_heads_on_eight_ranks(pools) -> None:
    """The head-count point: 2 heads cannot use 8 Ulysses ranks, but U=2 x R=4 is exact."""
    cases = [AttnCase("hybrid", layout, True, 1, 4, 2, h_kv, 16, dtype, seed=3, ulysses=2, ring=4)
             for layout in ("zigzag", "contiguous") for h_kv in (1, 2) for dtype in ("fp64", "fp32", "bf16")]
    results = pools.get(8).run(check_attention_cases, cases, timeout=600)
    assert len(results) == 8


def test_results_do_not_depend_on_how_p_is_factored(pools) -> None:
    """Same global problem at P=4 as 1x4, 2x2 and 4x1: identical gathered results."""
    pool = pools.get(4)
    for dtype, atol in (("fp64", 1e-12), ("fp32", 2e-6)):
        base = AttnCase("hybrid", "zigzag", True, 2, 4, 8, 4, 16, dtype, seed=11)
        runs = {(u, r): pool.run(global_outputs, AttnCase(**{**base.__dict__, "ulysses": u, "ring": r}))[0]
                for u, r in ((1, 4), (2, 2), (4, 1))}
        reference = runs[(1, 4)]
        for shape, got in runs.items():
            for name in reference:
                torch.testing.assert_close(got[name], reference[name], atol=atol, rtol=0, msg=f"{dtype} {shape} {name}")


@pytest.mark.parametrize("mode,u,r", [pytest.param("ulysses", 1, 1, marks=pytest.mark.slow), ("hybrid", 2, 2)])
def test_cross_rank_float64_gradcheck(pools, mode: str, u: int, r: int) -> None:
    assert all(pools.get(4).run(gradcheck_case, mode, "zigzag", True, u, r, timeout=300))
