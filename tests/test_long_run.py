"""Issue 31 (4): a long run. 1,000 steps of the DeepSpeed GPT example at U2 x R2 on 4 CPU ranks
against the same 1,000 steps on one rank (the same global batch, no sequence parallelism).

Every rank's resident memory grows by at most 2% from step 100 to step 1,000, no loss is NaN,
and the loss equals one rank's within 1e-4 (relative) at steps 1, 10 and 100 and within 1e-3 at
step 1,000. ``-m slow`` only: a few minutes on 2 cores (figures in docs/robustness.md).
"""

from __future__ import annotations

import math

import pytest

from test_resume import GPT, assert_ok, launch, needs_deepspeed

STEPS = 1000
MODEL = ["--seq-len", "256", "--d-model", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--micro-batch", "4",
         "--steps", str(STEPS), "--log-json"]


@pytest.mark.slow
@needs_deepspeed
def test_thousand_steps_u2xr2_memory_flat_and_loss_equals_one_rank() -> None:
    sp = assert_ok(launch(GPT, *MODEL, "--ulysses-size", "2", "--ring-size", "2", "--log-memory", ranks=4, timeout=3000))
    one = assert_ok(launch(GPT, *MODEL, "--ulysses-size", "1", "--ring-size", "1", ranks=1, timeout=3000))
    sp_loss = {r["step"]: r["loss"] for r in sp.lines}
    one_loss = {r["step"]: r["loss"] for r in one.lines}
    assert sorted(sp_loss) == sorted(one_loss) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in [*sp_loss.values(), *one_loss.values()])
    rss = {r["step"]: r["rss_mib"] for r in sp.lines}
    growth = [after / before - 1 for before, after in zip(rss[100], rss[STEPS])]
    errors = {step: abs(sp_loss[step] - one_loss[step]) / abs(one_loss[step]) for step in (1, 10, 100, STEPS)}
    print(f"RSS MiB per rank at step 100 {rss[100]}, at {STEPS} {rss[STEPS]} (growth {[f'{g:.2%}' for g in growth]}); "
          f"losses U2xR2 vs one rank: {[(s, sp_loss[s], one_loss[s], f'{e:.1e}') for s, e in errors.items()]}")
    assert max(growth) <= 0.02, (rss[100], rss[STEPS])
    for step, error in errors.items():
        assert error <= (1e-3 if step == STEPS else 1e-4), (step, sp_loss[step], one_loss[step])
