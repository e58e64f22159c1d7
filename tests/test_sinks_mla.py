"""C20 (sinks and value head size): attention sinks and a value head size different from
the q/k head size (MLA), in every mode, against the float64 oracle.

The oracle adds one sink column per head to the score matrix and drops its probabilities
(gpt-oss's formulation); ring_sp folds the sinks into the merged log-sum-exp once. Each
rank's ``sinks.grad`` is its rows' share, so the SUM over the SP ranks is compared with
the oracle's gradient. Value head sizes 8 and 24 with q/k head size 16.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_cases import AttnCase, check_attention_cases

LAYOUTS = ("contiguous", "zigzag", "striped")
DTYPES = ("fp64", "fp32", "bf16")


def _cases(mode: str, size: int, *, u: int = 1, r: int = 1, layouts=LAYOUTS, dtypes=DTYPES,
           packed: tuple[bool, ...] = (False,)) -> list[AttnCase]:
    """sinks on/off x d_v (16 = d, 8, 24) x layout x causal x dtype, shapes rotated."""
    heads = itertools.cycle([(4, 4), (8, 2), (4, 1)] if u == 1 else [(2 * u, u), (2 * u, 1), (4 * u, 2 * u)])
    cases = []
    for sinks, d_v, layout, causal, dtype, docs in itertools.product(
            (True, False), (None, 8, 24), layouts, (True, False), dtypes, packed):
        if not sinks and d_v is None:
            continue  # the plain case is the other test files' job
        h, h_kv = next(heads)
        cases.append(AttnCase(mode, layout, causal, 1 + len(cases) % 2, 4, h, h_kv, 16, dtype, seed=len(cases),
                              ulysses=u if mode != "ring" else 1, ring=r if mode != "ulysses" else 1,
                              packed=docs, sinks=sinks, d_v=d_v))
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_sinks_and_value_head_size(pools, world_size: int) -> None:
    cases = _cases("ring", world_size, r=world_size, dtypes=("fp64", "bf16") if world_size == 3 else DTYPES)
    pools.get(world_size).run(check_attention_cases, cases, timeout=600)


def test_ulysses_sinks_and_value_head_size(pools) -> None:
    cases = _cases("ulysses", 4, u=4)
    pools.get(4).run(check_attention_cases, cases, timeout=600)


def test_grid_sinks_and_value_head_size(pools) -> None:
    cases = _cases("hybrid", 4, u=2, r=2, layouts=("zigzag", "contiguous"))
    pools.get(4).run(check_attention_cases, cases, timeout=600)


@pytest.mark.parametrize("mode,world_size,u,r,layout", [
    ("ring", 2, 1, 1, "zigzag"), ("ring", 3, 1, 1, "striped"), ("ulysses", 4, 1, 1, "contiguous"),
    ("hybrid", 4, 2, 2, "zigzag"),
])
def test_float64_gradcheck_with_sinks_and_value_head_size(pools, mode: str, world_size: int, u: int, r: int,
                                                         layout: str) -> None:
    """Every input's gradient, the sinks' included (summed over ranks), by finite differences."""
    from dist_cases import gradcheck_case

    pool = pools.get(world_size)
    for causal, d_v in ((True, 6), (False, None)):
        assert all(pool.run(gradcheck_case, mode, layout, causal, u, r, sinks=True, d_v=d_v, timeout=300))
