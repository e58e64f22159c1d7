"""Issue 11: the HF Trainer path (``SequenceParallelTrainer`` with DeepSpeed's ``"ring_sp"`` section).

The rank cases build the Trainer of ``examples/transformers/train_llama_trainer.py`` (a
small Llama, GQA, from a config) on gloo ranks with DeepSpeed's CPU accelerator and train
a few SGD steps with gradient accumulation; the reference is the plain ``Trainer`` with
``attn_implementation="sdpa"`` on ONE rank, same seed, same global batch. Per-step loss,
DeepSpeed's gradient norm (after its reduction) and the final parameters must agree.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from example_scripts import load_script, run_launcher

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "transformers"
DS_ENV = {"DS_ACCELERATOR": "cpu"}  # the same pools as tests/test_deepspeed.py
HAVE_STACK = all(importlib.util.find_spec(m) is not None for m in ("deepspeed", "transformers", "accelerate"))
pytestmark = pytest.mark.skipif(not HAVE_STACK, reason="needs deepspeed, transformers and accelerate "
                                "(pip install --no-build-isolation 'ring-sp[transformers]')")

# tiny model; the run: 3 SGD steps of 2 micro-batches (gradient accumulation) of 64 tokens
MODEL = ["--seq-len", "64", "--d-model", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--corpus-bytes", "100000"]
TINY = [*MODEL, "--steps", "3", "--grad-accum", "2", "--optim", "sgd", "--lr", "0.5", "--warmup", "0",
        "--max-grad-norm", "1.0"]

_EXAMPLE_MODULE = "ring_sp_transformers_train_llama_trainer"


def _example():
    """The example script as a module (its Trainer set-up)."""
    return load_script(_EXAMPLE_MODULE, EXAMPLE / "train_llama_trainer.py")


def _prepare_rank() -> None:
    import torch.distributed as dist
    from deepspeed.utils import groups

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # DeepSpeed and accelerate require it; one host
    groups.mpu = None  # DeepSpeed keeps the last engine's mpu process-wide; a fresh process has none


def _step_counter() -> Any:
    """A Trainer callback counting the optimizer steps this run itself takes (``.steps``)."""
    from transformers import TrainerCallback

    class StepCounter(TrainerCallback):
        steps = 0

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.steps += 1

    return StepCounter()


def _generation_callback() -> Any:
    """rsp_hf.GenerationCallback sampling 8 tokens after 2 prompts every 2 steps (and after the last), noting
    whether each call left the random state and the model's mode as they were (``.untouched``)."""
    import ring_sp.integrations.transformers as rsp_hf

    class Checked(rsp_hf.GenerationCallback):
        untouched: list[bool] = []

        def generate(self, model: torch.nn.Module, step: int) -> torch.Tensor:
            state, mode = torch.get_rng_state(), model.training
            tokens = super().generate(model, step)
            self.untouched = [*self.untouched, torch.equal(state, torch.get_rng_state()) and model.training == mode]
            return tokens

    prompts = torch.randint(1, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    return Checked(prompts, every=2, seed=7, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)


def train_case(argv: list[str], output_dir: str, resume: str | None = None, generate: bool = False) -> dict[str, Any]:
    """Build the example's Trainer, train; per-step loss and grad norm, final full fp32 parameters.
    ``generate``: with :func:`_generation_callback` (its tokens per call, and whether it left training alone)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    _prepare_rank()
    original = deepspeed.initialize
    trainer = _example().build_trainer([*argv, "--output-dir", output_dir])
    trained = _step_counter()
    trainer.add_callback(trained)
    sampler = _generation_callback() if generate else None
    if sampler is not None:
        trainer.add_callback(sampler)
    trainer.train(resume_from_checkpoint=resume)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    evals = [(entry["step"], entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]
    params = {}
    for name, p in trainer.model_wrapped.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        params[name] = (p if full is None else full).detach().clone()
    topology = trainer.ring_sp_topology
    final = {}
    if trainer.eval_dataset is not None:
        final["final_eval"] = trainer.evaluate()["eval_loss"]
        if topology is None:
            final["token_mean"] = _token_mean(trainer)
    if sampler is not None:
        final["generations"] = [(g["step"], g["tokens"].tolist()) for g in sampler.generations]
        final["generation_left_training_alone"] = sampler.untouched
    return {**final,
        "steps": [entry["step"] for entry in logs], "loss": [entry["loss"] for entry in logs], "trained": trained.steps,
        "grad_norm": [entry["grad_norm"] for entry in logs], "params": params, "evals": evals,
        "dp_size": None if topology is None else topology.dp_size,
        "zero_stage": trainer.model_wrapped.zero_optimization_stage(),
        "engine_topology_is_registered": topology is not None and trainer.model_wrapped.ring_sp_topology is topology,
        "tiled": _tiled(trainer.model_wrapped.module),
        "deepspeed_initialize_restored": deepspeed.initialize is original,
    }


def _tiled(model: torch.nn.Module) -> tuple[bool, bool]:
    """(tiled MLP, tiled loss) as ``enable_long_sequence`` recorded them on the model."""
    config = getattr(model, "ring_sp_long_sequence", None)
    return (False, False) if config is None else (config.tiled_mlp, config.tiled_loss)


def _token_mean(trainer: Any) -> float:
    """The held-out set's next-token loss as one token mean, computed here without SP (the oracle of evaluate())."""
    total, count = 0.0, 0
    model = trainer.model.eval()
    with torch.no_grad():
        for batch in trainer.get_eval_dataloader():
            labels = batch.pop("labels")[:, 1:]  # HF: the collator marks each packed document's first token -100
            logits = model(**{k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}).logits[:, :-1]
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(),
                                                       reduction="sum").item()
            count += int((labels != -100).sum())
    return total / count


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def _compare(results: list[dict[str, Any]], ref: dict[str, Any], *, evals: bool = True) -> None:
    assert ref["steps"] == [1, 2, 3], ref["steps"]
    assert ref["loss"][-1] < ref["loss"][0] - 0.1, ref["loss"]  # it trains
    assert max(ref["grad_norm"]) > 1.0  # so DeepSpeed's clipping ran, on the norm over all DP x SP ranks
    for res in results:
        assert res["engine_topology_is_registered"] and res["deepspeed_initialize_restored"]
        assert res["steps"] == ref["steps"]
        for name in ("loss", "grad_norm"):
            errors = [_rel(g, w) for g, w in zip(res[name], ref[name])]
            assert max(errors) < 1e-5, (name, res[name], ref[name])
        assert res["params"].keys() == ref["params"].keys()
        worst = max(((res["params"][n] - w).norm() / w.norm()).item() for n, w in ref["params"].items())
        assert worst < 1e-5, worst
        # the eval loss after every step (eval_strategy="steps"): the exact token mean over the held-out set
        assert [step for step, _ in res["evals"]] == [step for step, _ in ref["evals"]]
        assert not evals or all(_rel(got, want) < 1e-5 for (_, got), (_, want) in zip(res["evals"], ref["evals"])), \
            (res["evals"], ref["evals"])


@pytest.mark.parametrize("stage,grid,micro,pack,tiled", [
    (1, ("2", "2"), 2, False, False),  # with rsp_hf.GenerationCallback sampling during training
    (1, ("2", "2"), 2, True, True),  # the long-sequence step: the section's tiled_mlp / tiled_loss
    pytest.param(3, ("1", "2"), 1, False, False, marks=pytest.mark.slow),  # ZeRO-3 x DP2 (also: test_transformers.py)
    pytest.param(2, ("2", "2"), 2, True, False, marks=pytest.mark.slow),
])
def test_trainer_sp_equals_one_rank(pools, tmp_path: Path, stage: int, grid: tuple[str, str], micro: int,
                                    pack: bool, tiled: bool) -> None:
    """U2xR2 (ZeRO-1), DP2 x R2 (ZeRO-3) and packed documents at U2xR2 (ZeRO-2) on 4 ranks
    vs the plain Trainer with sdpa on 1 rank; tiled: the DeepSpeed section's ``tiled_mlp`` and
    ``tiled_loss`` (5-token tiles) on packed documents, against the same untiled reference.

    ZeRO 1/2 sum gradients over the SP ranks and ZeRO-3 averages them (two loss scalings);
    DP = 2 checks that the replicas split the samples and that the token count spans them;
    packed: DataCollatorWithFlattening rows (documents of unequal length, so the SP ranks
    hold unequal numbers of valid tokens) against sdpa's own packed-sequence masking.
    Unpacked runs (U2xR2 ZeRO-1; DP2 x R2 ZeRO-3, whose weights each forward gathers, under -m slow)
    run GenerationCallback too (both runs): the tokens it samples after steps 2 and 3 over the SP
    ranks equal the reference's, and it leaves the training's random state and the model's mode as
    they were.
    """
    _example()  # the rank functions import it by module name
    # held-out windows hold equal numbers of tokens, so the plain Trainer's eval_loss (a mean of batch means) is the
    # token mean too; packed batches do not, so there only the final evaluate() is compared (with the token mean)
    evaluate = ["--eval-steps", "1", "--eval-samples", "8"]
    common = [*TINY, "--zero-stage", str(stage), *(["--pack-documents"] if pack else []), *evaluate]
    long_sequence = ["--tiled-mlp", "--tiled-loss", "--tile-tokens", "5"] if tiled else []
    generate = not pack  # ZeRO-1 in the default suite, ZeRO-3 (generate()'s synced_gpus) under -m slow
    sp = pools.get(4, env=DS_ENV).run(
        train_case, [*common, *long_sequence, "--ulysses-size", grid[0], "--ring-size", grid[1], "--micro-batch",
                     str(micro)], str(tmp_path / "sp"), generate=generate, timeout=300)
    assert all(res["tiled"] == (tiled, tiled) for res in sp)
    dp = sp[0]["dp_size"]
    assert [res["dp_size"] for res in sp] == [4 // (int(grid[0]) * int(grid[1]))] * 4
    assert all(res["zero_stage"] == stage for res in sp)
    (ref,) = pools.get(1, env=DS_ENV).run(
        train_case, [*common, "--no-ring-sp", "--micro-batch", str(micro * dp)], str(tmp_path / "ref"),
        generate=generate, timeout=300)
    _compare(sp, ref, evals=not pack)
    if generate:
        assert [step for step, _ in ref["generations"]] == [2, 3] and all(ref["generation_left_training_alone"])
        for res in sp:
            assert res["generations"] == ref["generations"], (res["generations"], ref["generations"])
            assert all(res["generation_left_training_alone"])
    assert [step for step, _ in ref["evals"]] == [1, 2, 3]
    for res in sp:  # the final evaluate(): the exact token mean of the held-out set, packed or not
        assert _rel(res["final_eval"], ref["token_mean"]) < 1e-5, (res["final_eval"], ref["token_mean"])


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": torch.zeros(64, dtype=torch.long)}


def test_trainer_checkpoint_resumes(pools, tmp_path: Path) -> None:
    """U2xR2: a Trainer checkpoint at step 2 (DeepSpeed state, data position, RNG) resumed gives step 3 again."""
    _example()
    args = [*TINY, "--ulysses-size", "2", "--ring-size", "2", "--micro-batch", "2", "--save-steps", "2"]
    pool = pools.get(4, env=DS_ENV)
    continuous = pool.run(train_case, args, str(tmp_path), timeout=300)
    resumed = pool.run(train_case, args, str(tmp_path / "again"), str(tmp_path / "checkpoint-2"), timeout=300)
    for full, rest in zip(continuous, resumed):
        # the resumed state's log holds steps 1-2 from the checkpoint; only step 3 is trained again
        assert full["steps"] == rest["steps"] == [1, 2, 3], (full["steps"], rest["steps"])
        assert (full["trained"], rest["trained"]) == (3, 1)
        assert _rel(rest["loss"][2], full["loss"][2]) < 1e-6, (rest["loss"], full["loss"])
        worst = max(((rest["params"][n] - w).norm() / w.norm()).item() for n, w in full["params"].items())
        assert worst < 1e-6, worst


def errors_case() -> dict[str, str]:
    """What SequenceParallelTrainer refuses, on one rank (U1 x R1), before any training."""
    from transformers import AutoModelForCausalLM

    from ring_sp.integrations.transformers.trainer import SequenceParallelTrainer

    _prepare_rank()
    ex = _example()
    trainer = ex.build_trainer([*TINY, "--ulysses-size", "1", "--ring-size", "1", "--micro-batch", "1",
                                "--output-dir", "unused"])
    model, args, data = trainer.model, trainer.args, trainer.train_dataset
    errors = {}

    def refused(name: str, **kwargs: Any) -> None:
        # fresh TrainingArguments: accelerate allows one Accelerator with a DeepSpeed plugin per state
        options = {"train_sampling_strategy": kwargs.pop("train_sampling_strategy", "random")}
        try:
            SequenceParallelTrainer(**{"model": model, "args": dataclasses.replace(args, **options),
                                       "train_dataset": data, **kwargs})
        except ValueError as exc:
            errors[name] = str(exc)

    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa")
    refused("attention", model=sdpa)
    refused("metrics", compute_metrics=lambda pred: {})
    refused("sampling", train_sampling_strategy="group_by_length")
    refused("iterable", train_dataset=_Stream())
    try:
        trainer.predict(torch.utils.data.Subset(data, range(2)))
    except ValueError as exc:
        errors["predict"] = str(exc)
    return errors


def test_unsupported_setups_raise(pools) -> None:
    _example()
    (errors,) = pools.get(1, env=DS_ENV).run(errors_case, timeout=300)
    assert "the model's attn_implementation is 'sdpa'; build it with attn_implementation=\"ring_sp\"" in errors["attention"]
    assert "does not support compute_metrics" in errors["metrics"] and "evaluate() gives the exact eval loss" in errors["metrics"]
    assert "does not support train_sampling_strategy='group_by_length'" in errors["sampling"]
    assert "does not support an IterableDataset" in errors["iterable"]
    assert "SequenceParallelTrainer.predict without prediction_loss_only" in errors["predict"]
    assert "save the model (trainer.save_model) and predict with it on one rank" in errors["predict"]


@pytest.mark.slow  # a 4-rank launch of the script (the default suite launches one example: test_deepspeed.py)
def test_example_runs_and_saves_a_plain_transformers_model(tmp_path: Path) -> None:
    """train_llama_trainer.sh --cpu: the launcher, JSON lines on stdout, save_model loading without ring_sp.

    Two ranks (U1 x R2) keep it cheap: the 4-rank grids are checked above on the pools.
    """
    from transformers import AutoModelForCausalLM

    args = [*MODEL, "--steps", "2", "--micro-batch", "2", "--ulysses-size", "1", "--ring-size", "2", "--log-json",
            "--save", "--output-dir", str(tmp_path)]
    lines = run_launcher(EXAMPLE / "train_llama_trainer.sh", *args, ranks=2, timeout=400)
    assert [r["step"] for r in lines] == [1, 2] and all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in lines), lines
    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # plain transformers: nothing registered here
    assert model.config.num_key_value_heads == 2 and model.config._attn_implementation != "ring_sp"
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(64).unsqueeze(0)).logits).all()
