"""Issue 39: every engine of the sequence-parallel trainers is exact or refused (docs/engines.md).

Plain DDP, as accelerate 1.15 runs it on CPU ranks with ``TrainingArguments(use_cpu=True)`` /
``ACCELERATE_USE_CPU=true`` (``DistributedType.MULTI_CPU``: the model in
``DistributedDataParallel`` over all ranks), reached two ways: ``prepare_sequence_parallel``'s
keywords without FSDP, and a DeepSpeed config with a ``"ring_sp"`` section that accelerate drops
because of ``use_cpu``. Against ONE rank with sdpa (the reference runs of tests/test_trl.py and
tests/test_fsdp2.py, shared: same model, seed and global batch), every step's loss and grad norm
(clipping active) within 1e-5 relative, TRL's metrics, ``evaluate()`` and ``save_model()``.
Refused on every rank before the first step, naming the engine found, the one configured and
the fix: a model partitioned by ZeRO-3's ``zero.Init`` with no ZeRO-3 engine (the dropped ZeRO-3
config), and DDP where accelerate wraps nothing (CPU ranks without ``use_cpu``). And in the
trainers' step a collator's ``shard_batch`` error on ONE rank raises on every rank.

Default suite: one 4-rank launch for the SFT case (the refusals, the dropped ZeRO-1 config at U2 x R2,
the one-rank collator errors) and the Trainer at DP 2 x R2 under DDP, then their one-rank references
(shared with tests/test_trl.py and tests/test_fsdp2.py); the keywords' refusals on one rank; a unit test
of the loss-scaling table and the prepared-model check. Slow: the issue's other grids, both trainers.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest

import test_trl
from test_fsdp2 import (FSDP2_ENV, NOT_DEEPSPEED, _environment, compare_trainer_case, cpu_ddp_env, trainer_case,
                        trainer_reference)

DS_ENV = {"DS_ACCELERATOR": "cpu"}  # the pools of tests/test_trl.py and tests/test_fsdp2.py
HAVE_STACK = all(importlib.util.find_spec(m) is not None for m in ("deepspeed", "transformers", "accelerate", "trl"))
pytestmark = pytest.mark.skipif(not HAVE_STACK, reason="needs deepspeed, transformers, accelerate and trl "
                                "(pip install --no-build-isolation 'ring-sp[trl]')")
# test_trl's default U2 x R2 case (its one-rank reference is shared): ZeRO-1, GA 2, Mistral's sliding window
SFT_U2R2 = [*test_trl.TINY, "--grad-accum", "2", "--model", "mistral", "--sliding-window", "24"]


def _error_on_every_rank(call: Any) -> tuple[str, float]:
    """(``call()``'s ValueError message, seconds until it was raised); fails if it returns."""
    start = time.perf_counter()
    try:
        call()
    except ValueError as exc:
        return str(exc), time.perf_counter() - start
    raise AssertionError(f"{call} did not raise")


def sft_dropped_config_case(output_dir: str) -> dict[str, Any]:
    """On every rank, in one launch: the two refusals, then the ZeRO-1 config accelerate drops (DDP, trained
    and evaluated), then a wrong ``layout`` in rank 1's collator when the trainer fetches a step's batches and
    an evaluation batch."""
    import torch.distributed as dist
    from transformers import TrainingArguments

    from ring_sp.integrations.transformers.trainer import prepare_sequence_parallel

    test_trl._prepare_rank()
    example, out = test_trl._example(), {}
    with _environment(NOT_DEEPSPEED):
        out["wraps_nothing"] = _error_on_every_rank(lambda: prepare_sequence_parallel(
            TrainingArguments(output_dir=output_dir, report_to="none"), ulysses_size=2, ring_size=2))
    with _environment(cpu_ddp_env()):
        zero3 = [*test_trl.TINY, "--zero-stage", "3", "--ulysses-size", "1", "--ring-size", "4", "--kv-heads", "1"]
        out["zero3"] = _error_on_every_rank(lambda: example.build_trainer([*zero3, "--output-dir", output_dir]))
        trainer = example.build_trainer([*SFT_U2R2, "--zero-stage", "1", "--ulysses-size", "2", "--ring-size", "2",
                                         "--output-dir", output_dir])
        trainer.train()
        out.update(test_trl.results_of(trainer, evaluate=True), wrapped=type(trainer.model_wrapped).__name__)
        collator = trainer.data_collator
        if dist.get_rank() == 1:
            collator.layout = "contiguous"  # not register()'s
        loader = trainer.get_train_dataloader()
        out["step_batches"] = _error_on_every_rank(
            lambda: trainer.get_batch_samples(iter(loader), 2, trainer.args.device))
        out["eval_batch"] = _error_on_every_rank(trainer.evaluate)
    return out


@pytest.fixture(scope="module")
def ddp_runs(pools, tmp_path_factory) -> dict[str, Any]:
    """Both default 4-rank runs, before either one-rank reference: one pool switch for the two tests."""
    root = tmp_path_factory.mktemp("ddp")
    test_trl._example()  # the rank functions import it by module name
    pool = pools.get(4, env=DS_ENV)
    return {"sft": pool.run(sft_dropped_config_case, str(root / "sft"), timeout=400),
            "trainer": pool.run(trainer_case, (1, 2), str(root / "trainer"), 2, "ddp", timeout=300),
            "trainer_dir": root / "trainer"}


def test_sft_under_ddp_exact_or_refused(pools, ddp_runs: dict[str, Any], tmp_path: Path) -> None:
    """SequenceParallelSFTTrainer with a DeepSpeed config and ACCELERATE_USE_CPU=true (accelerate drops the
    config): ZeRO-1 at U2 x R2 trains under DDP and equals plain TRL on one rank (loss, grad norm, accuracy,
    entropy, tokens, evaluate()); ZeRO-3 at U1 x R4 (the model partitioned by zero.Init) and DDP without use_cpu
    are refused on every rank; rank 1's wrong layout fails every rank at the step's fetch and at evaluation."""
    results = ddp_runs["sft"]
    ref = test_trl._run_ref(pools, tmp_path, "ref", [*SFT_U2R2, "--zero-stage", "1", "--no-ring-sp",
                                                     "--micro-batch", "2"], evaluate=True)
    assert [(res["engine"], res["wrapped"], res["grid"]) for res in results] == \
        [("DDP", "DistributedDataParallel", (2, 2, 1))] * 4
    test_trl._compare(results, ref)
    for res in results:
        assert test_trl._rel(res["eval"]["eval_loss"], ref["token_mean"]) < 1e-5, (res["eval"], ref["token_mean"])
    for rank, res in enumerate(results):
        message, _ = res["zero3"]
        assert "partitioned by DeepSpeed ZeRO-3" in message and "found: DistributedDataParallel" in message, message
        assert "configured: DeepSpeed ZeRO-3" in message and "unset ACCELERATE_USE_CPU" in message, message
        message, _ = res["wraps_nothing"]
        assert "accelerate wraps the model in no engine" in message and "use_cpu=True" in message, message
        for where in ("step_batches", "eval_batch"):
            message, seconds = res[where]
            assert "argument check failed on rank(s) [1] of the group [0, 1, 2, 3]" in message, (rank, where, message)
            assert "layout='contiguous' but register() was given layout='zigzag'" in message, (rank, where, message)
            assert seconds < 10, (rank, where, seconds)


def test_trainer_under_ddp_equals_one_rank(pools, ddp_runs: dict[str, Any], tmp_path: Path) -> None:
    """SequenceParallelTrainer with prepare_sequence_parallel's keywords and use_cpu (DDP, no FSDP) at DP 2 x R2,
    tiled MLP + loss, packed documents: every step, evaluate() and save_model() equal the plain Trainer on one
    rank (the FSDP2 test's reference)."""
    sp = ddp_runs["trainer"]
    assert [(res["engine"], res["wrapped"]) for res in sp] == [("DDP", "DistributedDataParallel")] * 4
    ref, ref_dir = trainer_reference(pools, tmp_path, 4)
    compare_trainer_case(sp, ref, ddp_runs["trainer_dir"], ref_dir, sharded=False)


def keyword_refusals_case(output_dir: str) -> dict[str, str]:
    """prepare_sequence_parallel's keywords where no engine can be exact, on one rank: each message."""
    from transformers import TrainingArguments

    from ring_sp.integrations.transformers.trainer import prepare_sequence_parallel

    test_trl._prepare_rank()
    plain = dict(output_dir=output_dir, report_to="none", save_strategy="no")
    cases = {
        "use_cpu with FSDP2": ({**cpu_ddp_env(), **FSDP2_ENV}, {}),
        "an accelerate DeepSpeed launch": ({"ACCELERATE_USE_DEEPSPEED": "true"}, {}),
        "offload_checkpoints": (cpu_ddp_env(), {"offload_checkpoints": True}),
    }
    errors = {}
    for name, (env, extra) in cases.items():
        with _environment({**NOT_DEEPSPEED, **env}):
            errors[name] = _error_on_every_rank(lambda: prepare_sequence_parallel(  # noqa: B023 -- called at once
                TrainingArguments(**plain), ulysses_size=1, ring_size=1, **extra))[0]
    return errors


def test_keyword_refusals(pools, tmp_path: Path) -> None:
    """The keywords refused with the fix: use_cpu beside FSDP2 (accelerate would wrap in DDP), an accelerate
    DeepSpeed launch (the settings belong in its config), offload_checkpoints (DeepSpeed's engine set-up only)."""
    (errors,) = pools.get(1, env=DS_ENV).run(keyword_refusals_case, str(tmp_path), timeout=120)
    assert "with FSDP2: accelerate 1.15 then wraps the model in DistributedDataParallel" in errors["use_cpu with FSDP2"]
    assert "accelerate runs DeepSpeed" in errors["an accelerate DeepSpeed launch"] and \
        '"ring_sp" section' in errors["an accelerate DeepSpeed launch"]
    assert "offload_checkpoints=True is not supported without DeepSpeed" in errors["offload_checkpoints"]


@pytest.mark.slow
@pytest.mark.parametrize("grid,extra", [
    pytest.param((2, 2), [], id="U2xR2"),
    pytest.param((1, 2), [], id="DP2xR2"),
    pytest.param((1, 4), ["--kv-heads", "1"], id="U1xR4-1kv"),
])
def test_sft_keywords_ddp_equals_one_rank(pools, tmp_path: Path, grid: tuple[int, int], extra: list[str]) -> None:
    """SequenceParallelSFTTrainer with the keywords under DDP (examples/trl/sft.py --ddp), GA 2, at the issue's
    grids, against plain TRL on one rank."""
    test_trl._example()
    args = [*test_trl.TINY, "--grad-accum", "2", *extra]
    sp = pools.get(4, env=DS_ENV).run(ddp_sft_case, [*args, "--ddp", "--ulysses-size", str(grid[0]), "--ring-size",
                                                     str(grid[1])], str(tmp_path / "sp"), timeout=400)
    assert all(res["engine"] == "DDP" for res in sp)
    dp = 4 // (grid[0] * grid[1])
    test_trl._compare(sp, test_trl._run_ref(pools, tmp_path, "ref", [*args, "--no-ring-sp", "--micro-batch",
                                                                     str(2 * dp)]))


def ddp_sft_case(argv: list[str], output_dir: str) -> dict[str, Any]:
    """test_trl's train case in the environment torchrun + use_cpu give a rank."""
    with _environment(cpu_ddp_env()):
        return test_trl.train_case(argv, output_dir)


@pytest.mark.slow
@pytest.mark.parametrize("grid,micro,kv_heads", [
    pytest.param((2, 2), 4, 2, id="U2xR2"),
    pytest.param((1, 4), 4, 1, id="U1xR4-1kv"),
])
def test_trainer_ddp_grids(pools, tmp_path: Path, grid: tuple[int, int], micro: int, kv_heads: int) -> None:
    """SequenceParallelTrainer under DDP at the issue's other grids against the plain Trainer on one rank."""
    sp = pools.get(4, env=DS_ENV).run(trainer_case, grid, str(tmp_path / "sp"), micro, "ddp", kv_heads, timeout=300)
    ref, ref_dir = trainer_reference(pools, tmp_path, micro, kv_heads)
    compare_trainer_case(sp, ref, tmp_path / "sp", ref_dir, sharded=False)


def trainer_dropped_config_case(argv: list[str], output_dir: str) -> dict[str, Any]:
    """examples/transformers/train_llama_trainer.py with ACCELERATE_USE_CPU=true: the ZeRO-3 config refused,
    then ``argv``'s (ZeRO-1) trained under DDP."""
    import test_transformers_trainer as hf

    hf._prepare_rank()
    with _environment(cpu_ddp_env()):
        zero3 = [*hf.TINY, "--zero-stage", "3", "--ulysses-size", "1", "--ring-size", "4", "--micro-batch", "1"]
        refused = _error_on_every_rank(lambda: hf._example().build_trainer([*zero3, "--output-dir", output_dir]))
        trainer = hf._example().build_trainer([*argv, "--output-dir", output_dir])
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        return {"refused": refused[0], "engine": trainer.ring_sp_engine.kind,
                "loss": [entry["loss"] for entry in logs], "grad_norm": [entry["grad_norm"] for entry in logs]}


@pytest.mark.slow
def test_trainer_dropped_deepspeed_config(pools, tmp_path: Path) -> None:
    """SequenceParallelTrainer (the example) with ACCELERATE_USE_CPU=true: ZeRO-3 at U1 x R4 refused, ZeRO-1 at
    U2 x R2 exact under DDP against the plain Trainer on one rank."""
    import test_transformers_trainer as hf

    hf._example()
    common = [*hf.TINY, "--zero-stage", "1"]
    sp = pools.get(4, env=DS_ENV).run(trainer_dropped_config_case, [*common, "--ulysses-size", "2", "--ring-size", "2",
                                                                    "--micro-batch", "2"], str(tmp_path / "sp"),
                                      timeout=400)
    (ref,) = pools.get(1, env=DS_ENV).run(hf.train_case, [*common, "--no-ring-sp", "--micro-batch", "2"],
                                          str(tmp_path / "ref"), timeout=300)
    for res in sp:
        assert "partitioned by DeepSpeed ZeRO-3" in res["refused"] and res["engine"] == "DDP", res
        for name in ("loss", "grad_norm"):
            assert max(hf._rel(g, w) for g, w in zip(res[name], ref[name])) < 1e-5, (name, res[name], ref[name])
    assert max(ref["grad_norm"]) > 1.0  # the clipping ran



def test_loss_scaling_and_prepared_model_checks(single_rank) -> None:
    """The table the loss reads (DDP and FSDP2 average over SP, ZeRO 0-2 sum, ZeRO-3 averages), and the check of
    the model accelerate prepared: another engine than the one the loss was set up for is refused, naming both."""
    import torch

    from ring_sp.integrations.transformers import engines

    def engine_like(stage: int) -> torch.nn.Module:  # answers like a DeepSpeed engine of ZeRO ``stage``
        module = torch.nn.Linear(2, 2)
        module.zero_optimization_stage = lambda: stage
        return module

    assert engines.Engine(engines.DDP, "x").gradients_averaged_over_sp() is True
    assert engines.Engine(engines.FSDP2, "x").gradients_averaged_over_sp() is True
    assert [engines.Engine(engines.DEEPSPEED, "x").gradients_averaged_over_sp(engine_like(s)) for s in range(4)] == \
        [False, False, False, True]
    plain = torch.nn.Linear(2, 2)
    engines.check_prepared(engines.Engine(engines.DDP, "x"), plain)  # one process: nothing to reduce
    with pytest.raises(ValueError, match=r"set its loss up for DeepSpeed over all 1 ranks but accelerate prepared the "
                                         r"model as Linear \(no engine\).*configured: DeepSpeed ZeRO-1"):
        engines.check_prepared(engines.Engine(engines.DEEPSPEED, "DeepSpeed ZeRO-1"), plain)
    with pytest.raises(ValueError, match=r"set its loss up for DDP .* as DeepSpeed ZeRO-3"):
        engines.check_prepared(engines.Engine(engines.DDP, "DDP"), engine_like(3))
