"""C22: recompute-aware attention (ring_sp.recompute) under every checkpointing path.

A checkpoint's re-run must not run the ring again: ring exchanges and kernel calls per
forward+backward equal the plain run's, gradients are bitwise equal (CPU), a re-run with
other inputs computes afresh (never a stale result), and nothing is kept after backward,
over a soak with evaluation and abandoned forwards. Ulysses re-sends q, k/v and out in
the re-run by design (cheaper than keeping them): its all-to-all counts are checked too.
"""

from __future__ import annotations

import pytest
import torch

import recompute_cases as rc
from ring_sp import recompute
from ring_sp.shapes import FINGERPRINT_BYTES

FORWARD_A2A = ("ulysses_a2a_q", "ulysses_a2a_kv", "ulysses_a2a_out")


def _assert_same_grads(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


def _assert_counts_as_plain(result: dict, plain: dict) -> None:
    """Same ring exchanges and kernel calls as the plain run; each forward all-to-all of
    Ulysses runs twice (first run and re-run), every backward one once."""
    assert result["kernel"] == plain["kernel"]
    for kind, calls in plain["calls"].items():
        assert result["calls"][kind] == (2 * calls if kind in FORWARD_A2A else calls), kind
    assert result["alive_after_backward"] == 0


@pytest.mark.parametrize("mode,world_size,wrappers", [
    ("ring", 2, ("reentrant", "non_reentrant")),
    ("ulysses", 2, ("reentrant", "non_reentrant")),
    ("hybrid", 4, ("reentrant", "non_reentrant", "deepspeed", "deepspeed_non_reentrant")),
])
@pytest.mark.parametrize("order,seeds", [("pipeline", [1, 2]), ("accumulate", [1, 1])])
def test_checkpointed_equals_plain(pools, mode: str, world_size: int, wrappers: tuple[str, ...], order: str,
                                   seeds: list[int]) -> None:
    """Two checkpointed blocks, two micro-batches: all forwards before the backwards
    (pipeline) or gradient accumulation with identical micro-batches."""
    if any(w.startswith("deepspeed") for w in wrappers):
        pytest.importorskip("deepspeed")
    pool = pools.get(world_size)
    plain = pool.run(rc.micro_batches_case, mode, "none", seeds, order, timeout=300)
    for wrapper in wrappers:
        results = pool.run(rc.micro_batches_case, mode, wrapper, seeds, order, timeout=300)
        for got, want in zip(results, plain):
            _assert_same_grads(got["grads"], want["grads"])
            _assert_counts_as_plain(got, want)
            # one entry per block and micro-batch in flight: 2 x 2 (pipeline), 2 (accumulate)
            assert got["alive_after_forward"] == ([4] if order == "pipeline" else [2, 2]), wrapper


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_transformers_gradient_checkpointing(pools, checkpointing: str) -> None:
    """transformers' ``gradient_checkpointing_enable()`` on an ``attn_implementation="ring_sp"``
    Llama: the re-run reuses the ring's result (same exchanges and kernel calls as without
    checkpointing, one kept entry per layer until its backward) and the gradients are bitwise equal."""
    pytest.importorskip("transformers")
    pool = pools.get(4)
    plain = pool.run(rc.transformers_case, "none", timeout=300)
    for got, want in zip(pool.run(rc.transformers_case, checkpointing, timeout=300), plain):
        _assert_same_grads(got["grads"], want["grads"])
        _assert_counts_as_plain(got, want)
        assert got["alive_after_forward"] == 2 and want["alive_after_forward"] == 0  # two layers kept


def test_off_switch_recomputes(pools) -> None:
    pool = pools.get(2)
    plain = pool.run(rc.micro_batches_case, "ring", "none", [1], "accumulate")[0]
    off = pool.run(rc.micro_batches_case, "ring", "reentrant", [1], "accumulate", reuse=False)[0]
    assert off["kernel"]["forward"] == 2 * plain["kernel"]["forward"]
    assert off["calls"]["ring_kv"] == plain["calls"]["ring_kv"] + plain["calls"]["ring_kv"] // 2
    assert off["alive_after_forward"] == [0]
    _assert_same_grads(off["grads"], plain["grads"])


@pytest.mark.parametrize("mode,world_size", [("ring", 2), ("hybrid", 4)])
def test_rerun_with_other_inputs_computes_afresh(pools, mode: str, world_size: int) -> None:
    for result in pools.get(world_size).run(rc.changed_inputs_case, mode, timeout=300):
        rerun, plain = result["reentrant"], result["plain_at_new_scale"]
        assert rerun["kernel"]["forward"] == 2 * plain["kernel"]["forward"]  # first run + fresh re-run
        _assert_same_grads(rerun["grads"], plain["grads"])  # the new inputs' gradients, not stale ones
        assert rerun["alive"] == 0


def test_nothing_kept_over_a_soak(pools) -> None:
    """Both checkpointing kinds, no_grad evaluation (plain and checkpointed) and forwards
    whose graph is dropped without backward: no entry outlives its step."""
    for alive in pools.get(2).run(rc.soak_case, "ring", 8, timeout=300):
        assert alive == [0] * 24


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_megatron_recompute_granularity(pools, granularity: str) -> None:
    """megatron-core GPTModel, CP = 2: ``--recompute-granularity full`` (uniform, 1 layer)
    and ``selective`` with ``core_attn``: counts and gradients as without recompute."""
    pytest.importorskip("megatron.core")
    pool = pools.get(2)
    plain = pool.run(rc.megatron_case, None, timeout=300)
    for got, want in zip(pool.run(rc.megatron_case, granularity, timeout=300), plain):
        assert got["calls"] == want["calls"] and got["kernel"] == want["kernel"]
        assert got["alive_after_forward"] == 2 and got["alive_after_backward"] == 0  # one entry per layer
        assert got["grads"].keys() == want["grads"].keys()
        _assert_same_grads(list(got["grads"].values()), list(want["grads"].values()))


def test_fingerprint_tells_inputs_apart() -> None:
    x = torch.randn(1, 6, 2, 4)
    swapped = x.clone()
    swapped[:, [0, 1]] = x[:, [1, 0]]
    nudged = x.clone()
    nudged[0, 3, 1, 2] += 1e-6
    base = recompute.fingerprint(x, x, x)
    assert base.numel() * base.element_size() == FINGERPRINT_BYTES  # the planner's figure
    assert torch.equal(base, recompute.fingerprint(x.clone(), x, x))
    for other in (swapped, nudged):
        assert not torch.equal(base, recompute.fingerprint(other, x, x))


@pytest.mark.parametrize("value,expected", [("0", False), ("off", False), ("1", True), ("", True)])
def test_env_switch(monkeypatch, value: str, expected: bool) -> None:
    monkeypatch.setenv(recompute.ENV_VAR, value)
    assert recompute.reuse_requested(None) is expected
    assert recompute.reuse_requested(not expected) is (not expected)


def test_bad_switch_values_name_the_argument(monkeypatch) -> None:
    with pytest.raises(TypeError, match="reuse_on_recompute"):
        recompute.reuse_requested("yes")
    monkeypatch.setenv(recompute.ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=recompute.ENV_VAR):
        recompute.reuse_requested(None)
