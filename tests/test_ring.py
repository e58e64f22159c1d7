"""C5/C8/C9: ring attention against the float64 oracle on 1-4 gloo ranks."""

from __future__ import annotations

import itertools
import random

import pytest

from dist_cases import AttnCase, check_attention_cases

LAYOUTS = ("contiguous", "zigzag", "striped")


def _matrix(world_size: int) -> list[AttnCase]:
    """Full product over the axes that change the ring's control flow (layout, causal,
    dtype, head ratio), with the shape axes (batch, head_dim, local length) rotated
    through so every value is hit at every world size."""
    shapes = itertools.cycle([(1, 8, 2), (2, 16, 6), (1, 80, 16), (2, 8, 6), (1, 16, 2)])
    cases = []
    for layout, causal, dtype, (h, h_kv) in itertools.product(LAYOUTS, (True, False), ("fp64", "fp32", "bf16"),
                                                              ((4, 4), (8, 2), (4, 1))):
        b, d, n_local = next(shapes)
        cases.append(AttnCase("ring", layout, causal, b, n_local, h, h_kv, d, dtype, seed=len(cases), ring=world_size))
    return cases


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_equivalence_matrix(pools, world_size: int) -> None:
    cases = _matrix(world_size)
    results = pools.get(world_size).run(check_attention_cases, cases, timeout=600)
    assert len(results) == world_size and all(len(r) == len(cases) for r in results)


@pytest.mark.parametrize("world_size,layout", [(2, "contiguous"), (2, "zigzag"), (2, "striped"),
                                               pytest.param(4, "zigzag", marks=pytest.mark.slow)])  # 4 ranks: ~20 s
def test_cross_rank_float64_gradcheck(pools, world_size: int, layout: str) -> None:
    from dist_cases import gradcheck_case

    for causal in (True, False):
        assert all(pools.get(world_size).run(gradcheck_case, "ring", layout, causal, timeout=300))


def test_bf16_precision_does_not_degrade_with_ring_size(pools) -> None:
    """C9: fp32 dK/dV accumulators keep the bf16 error flat in R (bf16 ones grow ~4x by R=32)."""
    from dist_cases import bf16_norm_errors

    pool = pools.get(4)
    for seed in range(3):
        at_1 = pool.run(bf16_norm_errors, 1, seed)[0]
        at_4 = pool.run(bf16_norm_errors, 4, seed)[0]
        for name in ("dk", "dv"):
            assert at_4[name] <= 1.3 * at_1[name], (seed, name, at_1, at_4)


def test_randomized_sweep(pools) -> None:
    """C10: seeded random cases over every axis; a failure names its case and seed."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for world_size in (2, 3, 4):
        cases = []
        for i in range(40):
            h_kv = rng.choice([1, 2, 4])
            cases.append(AttnCase(
                "ring", rng.choice(LAYOUTS), rng.random() < 0.7, rng.choice([1, 2]), 2 * rng.randint(1, 12),
                h_kv * rng.choice([1, 2, 3]), h_kv, rng.choice([4, 8, 24, 64, 80]), rng.choice(["fp64", "fp32", "bf16"]),
                seed=rng.randrange(10**6), ring=world_size,
            ))
        try:
            pools.get(world_size).run(check_attention_cases, cases, timeout=600)
        except AssertionError as exc:
            raise AssertionError(f"randomized sweep failed; reproduce with seed={seed}\n{exc}") from None
