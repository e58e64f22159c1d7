"""Issue 33, part 2: both Hugging Face trainers under FSDP2 (no DeepSpeed), against one rank with sdpa.

FSDP2 is asked for as ``accelerate launch --config_file examples/trl/fsdp2.yaml`` asks for it:
the environment below, in each rank. accelerate 1.15 sets no FSDP up on CPU ranks, so there the
trainer shards the model itself with accelerate's own ``fsdp2_prepare_model``
(``ring_sp.integrations.transformers.fsdp``); the cases check that it did (accelerate's FSDP
units) and that every step's loss and grad norm equal the plain trainer's on ONE rank with
sdpa, the same model, seed and global batch (packed documents in both: TRL's BFD rows and
``DataCollatorWithFlattening``), with gradient accumulation and grad-norm clipping, and the
exact eval loss after training. ``SequenceParallelTrainer`` also runs the tiled MLP + loss at
DP 2 and saves the gathered model. Default suite: about 22 s (the SFT case 19 s with its pool
starts, the Trainer case 3 s, the refusals < 1 s); slow: a sweep of TRL settings (50 s) and
the example's launch (21 s).
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from example_scripts import load_script, run_launcher
from test_transformers_trainer import _rel, _token_mean  # the one-rank eval oracle, shared

REPO = Path(__file__).resolve().parents[1]
DS_ENV = {"DS_ACCELERATOR": "cpu"}  # the pools of tests/test_trl.py: one pool start for both files
HAVE_STACK = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate", "trl", "deepspeed"))
pytestmark = pytest.mark.skipif(not HAVE_STACK, reason="needs transformers, accelerate, trl (and deepspeed for the "
                                "shared pools): pip install --no-build-isolation 'ring-sp[trl]'")
# what `accelerate launch --config_file examples/trl/fsdp2.yaml` puts in each rank's environment (the part read here)
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_RESHARD_AFTER_FORWARD": "true", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
             "FSDP_OFFLOAD_PARAMS": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
             "FSDP_ACTIVATION_CHECKPOINTING": "false"}
# accelerate leaves ACCELERATE_USE_DEEPSPEED=true in a process once an Accelerator had a DeepSpeed plugin (a pool rank
# that ran a DeepSpeed case); a later Trainer without deepspeed= would then get a DeepSpeed plugin from it
NOT_DEEPSPEED = {"ACCELERATE_USE_DEEPSPEED": "false"}


def cpu_ddp_env() -> dict[str, str]:
    """What ``torchrun`` and ``TrainingArguments(use_cpu=True)`` give this pool rank (accelerate's MULTI_CPU: DDP)."""
    import torch.distributed as dist

    world = str(dist.get_world_size())
    return {**NOT_DEEPSPEED, "ACCELERATE_USE_CPU": "true", "RANK": str(dist.get_rank()), "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # accelerate sets the last, and reads nothing of it


# TRL: 3 SGD steps of BFD-packed rows of 128 tokens (the GLOBAL length), 2 micro-batches each, clipped at 1.0
SFT = ["--max-length", "128", "--documents", "48", "--eval-documents", "8", "--d-model", "32", "--layers", "2",
       "--steps", "3", "--optim", "sgd", "--lr", "0.5", "--warmup", "0", "--max-grad-norm", "1.0", "--grad-accum", "2",
       "--fsdp2"]


@contextmanager
def _environment(values: dict[str, str]):
    """``values`` set in os.environ for the block (the pool's ranks outlive the case)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _prepare_rank() -> None:
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # accelerate requires it; one host


def _sharded(model: torch.nn.Module) -> list[str]:
    """The modules FSDP2 manages (``fully_shard`` applied): their names, the root as ''."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def _logged(trainer: Any) -> dict[str, list[float]]:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {key: [entry[key] for entry in logs] for key in ("step", "loss", "grad_norm")}


def sft_case(argv: list[str], output_dir: str, fsdp2: bool) -> dict[str, Any]:
    """examples/trl/sft.py's trainer under FSDP2 (or, fsdp2=False, the one-rank reference); trains, evaluates."""
    _prepare_rank()
    with _environment({**NOT_DEEPSPEED, **(FSDP2_ENV if fsdp2 else {})}):
        trainer = load_script("ring_sp_trl_sft", REPO / "examples" / "trl" / "sft.py").build_trainer(
            [*argv, "--output-dir", output_dir])
        trainer.train()
        out = {**_logged(trainer), "eval": trainer.evaluate()["eval_loss"], "sharded": _sharded(trainer.model),
               "shards_itself": trainer.ring_sp_shards_itself, "fsdp": trainer.ring_sp_fsdp,
               "accuracy": [e["mean_token_accuracy"] for e in trainer.state.log_history if "loss" in e],
               "num_tokens": [e["num_tokens"] for e in trainer.state.log_history if "loss" in e]}
    return out


def trainer_case(grid: tuple[int, int] | None, output_dir: str, micro: int, engine: str = "fsdp2",
                 kv_heads: int = 2) -> dict[str, Any]:
    """SequenceParallelTrainer on packed documents (DataCollatorWithFlattening) under FSDP2 (or
    ``engine="ddp"``: DDP, use_cpu) at ``grid`` with the tiled MLP + loss, or (grid None) the plain
    Trainer on one rank with sdpa; a Llama of 4 query and ``kv_heads`` KV heads."""
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, TrainingArguments

    from ring_sp.integrations.transformers.trainer import SequenceParallelTrainer, prepare_sequence_parallel

    _prepare_rank()
    ex = load_script("ring_sp_transformers_train_llama_trainer", REPO / "examples" / "transformers" / "train_llama_trainer.py")
    opts = ex.parse_args(["--seq-len", "64", "--d-model", "32", "--layers", "2", "--heads", "4",
                          "--kv-heads", str(kv_heads)])
    documents = ex.corpus_documents(100_000)
    with _environment(NOT_DEEPSPEED if grid is None else {**NOT_DEEPSPEED, **FSDP2_ENV} if engine == "fsdp2" else
                      cpu_ddp_env()):
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=micro, gradient_accumulation_steps=2,
                                 use_cpu=grid is not None and engine == "ddp",
                                 max_steps=3, learning_rate=0.5, warmup_steps=0, optim="sgd", max_grad_norm=1.0, seed=0,
                                 data_seed=0, logging_steps=1, save_strategy="no", report_to="none",
                                 dataloader_drop_last=True, per_device_eval_batch_size=micro)
        if grid:
            prepare_sequence_parallel(args, ulysses_size=grid[0], ring_size=grid[1], tiled_mlp=True, tiled_loss=True,
                                      tile_tokens=5)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(ex.llama_config(opts), attn_implementation="ring_sp" if grid else "sdpa",
                                                 dtype=torch.float32)
        trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=ex.Documents(documents[:64], 64),
                                          eval_dataset=ex.Documents(documents[64:72], 64),
                                          data_collator=DataCollatorWithFlattening())
        trainer.train()
        out = {**_logged(trainer), "eval": trainer.evaluate()["eval_loss"], "sharded": _sharded(trainer.model),
               "tiled": getattr(trainer.model, "ring_sp_long_sequence", None) is not None,
               "engine": None if trainer.ring_sp_engine is None else trainer.ring_sp_engine.kind,
               "wrapped": type(trainer.model_wrapped).__name__}
        trainer.save_model(os.path.join(output_dir, "final"))  # FSDP2 on CPU: the full state dict, written by rank 0
        if grid is None:
            out["token_mean"] = _token_mean(trainer)
    return out


def _compare(results: list[dict[str, Any]], ref: dict[str, Any], *, keys: tuple[str, ...] = ("loss", "grad_norm"),
             max_grad_norm: float = 1.0, sharded: bool = True) -> None:
    assert ref["step"] == [1, 2, 3] and ref["loss"][-1] < ref["loss"][0], ref  # it trains
    assert max(ref["grad_norm"]) > max_grad_norm, ref["grad_norm"]  # so the clipping ran, on the norm over all ranks
    for res in results:
        # accelerate's units: the root, each decoder layer, the embeddings, [final norm, LM head]
        units = {name.rsplit("model.", 1)[-1] for name in res["sharded"]}  # PEFT prefixes base_model.model.
        assert not sharded or {"", "layers.0", "layers.1", "embed_tokens"} <= units, res["sharded"]
        assert res["step"] == ref["step"], res
        for key in keys:
            assert max(_rel(g, w) for g, w in zip(res[key], ref[key])) < 1e-5, (key, res[key], ref[key])


def _run_sft(pools, tmp_path: Path, grid: tuple[int, int], extra: list[str]) -> tuple[list[dict], dict]:
    """The SFT case at ``grid`` on 4 ranks under FSDP2, and plain TRL on one rank with the same global batch."""
    sp = pools.get(4, env=DS_ENV).run(sft_case, [*SFT, *extra, "--ulysses-size", str(grid[0]), "--ring-size",
                                                 str(grid[1])], str(tmp_path / "sp"), True, timeout=300)
    assert all(res["fsdp"] and res["shards_itself"] for res in sp)  # CPU: accelerate left it to the trainer
    dp = 4 // (grid[0] * grid[1])
    (ref,) = pools.get(1, env=DS_ENV).run(sft_case, [*SFT, *extra, "--no-ring-sp", "--micro-batch", str(2 * dp)],
                                          str(tmp_path / "ref"), False, timeout=300)
    assert ref["sharded"] == [] and not ref["fsdp"]  # the reference: one rank, plain TRL
    return sp, ref


def test_sft_trainer_fsdp2_equals_one_rank(pools, tmp_path: Path) -> None:
    """SequenceParallelSFTTrainer, FSDP2 at U2xR2 on 4 ranks, BFD packing, GA 2: every step's loss, grad norm,
    mean token accuracy and token count equal plain TRL's on one rank with sdpa; so does evaluate() after
    training (one packed eval batch, so TRL's batch-mean eval loss is the token mean here)."""
    sp, ref = _run_sft(pools, tmp_path, (2, 2), [])
    _compare(sp, ref, keys=("loss", "grad_norm", "accuracy"))
    assert all(res["num_tokens"] == ref["num_tokens"] for res in sp), ([r["num_tokens"] for r in sp], ref["num_tokens"])
    assert all(_rel(res["eval"], ref["eval"]) < 1e-5 for res in sp), ([r["eval"] for r in sp], ref["eval"])


@pytest.mark.slow
@pytest.mark.parametrize("grid,extra", [
    # PEFT LoRA with the completion-only loss, DP 2 x R2 (gradients under the clipping threshold)
    pytest.param((1, 2), ["--lora", "--data", "prompt-completion", "--max-grad-norm", "0.2"], id="DP2xR2-lora-completion"),
    pytest.param((2, 2), ["--gradient-checkpointing", "--model", "mistral"], id="U2xR2-checkpointing-mistral-window"),
    pytest.param((1, 4), ["--kv-heads", "1", "--optim", "adamw_torch", "--lr", "1e-3", "--max-grad-norm", "0.5"],
                 id="U1xR4-1kv-adamw"),
])
def test_sft_fsdp2_sweep(pools, tmp_path: Path, grid: tuple[int, int], extra: list[str]) -> None:
    """More TRL settings under FSDP2 on 4 ranks against plain TRL on one rank with sdpa (loss, grad norm, accuracy)."""
    sp, ref = _run_sft(pools, tmp_path, grid, extra)
    clip = float(extra[extra.index("--max-grad-norm") + 1]) if "--max-grad-norm" in extra else 1.0
    _compare(sp, ref, keys=("loss", "grad_norm", "accuracy"), max_grad_norm=clip)


_REFERENCES: dict[tuple, tuple[dict[str, Any], Path]] = {}  # one-rank reference runs, shared by the tests (test_engines.py)


def trainer_reference(pools, tmp_path: Path, micro: int, kv_heads: int = 2) -> tuple[dict[str, Any], Path]:
    """The plain Trainer's run of :func:`trainer_case` on one rank with sdpa (micro-batch ``micro``) and its
    output folder; run once per session."""
    key = (micro, kv_heads)
    if key not in _REFERENCES:
        (ref,) = pools.get(1, env=DS_ENV).run(trainer_case, None, str(tmp_path / "ref"), micro, "fsdp2", kv_heads,
                                              timeout=300)
        _REFERENCES[key] = ref, tmp_path / "ref"
    return _REFERENCES[key]


def compare_trainer_case(sp: list[dict[str, Any]], ref: dict[str, Any], sp_dir: Path, ref_dir: Path,
                         sharded: bool = True) -> None:
    """:func:`trainer_case`'s runs against the reference: every step, the exact eval loss, save_model()'s weights."""
    assert all(res["tiled"] for res in sp)
    _compare(sp, ref, sharded=sharded)
    assert all(_rel(res["eval"], ref["token_mean"]) < 1e-5 for res in sp), ([r["eval"] for r in sp], ref["token_mean"])
    # save_model(): the whole trained model (gathered from the shards under FSDP2) equals the reference's
    got, want = (load_file(str(folder / "final" / "model.safetensors")) for folder in (sp_dir, ref_dir))
    assert want.keys() <= got.keys() and torch.equal(got.get("lm_head.weight", got["model.embed_tokens.weight"]),
                                                     got["model.embed_tokens.weight"])  # tied embeddings
    worst = max(((got[name] - w).norm() / w.norm()).item() for name, w in want.items())
    assert worst < 1e-5, worst


def test_trainer_fsdp2_equals_one_rank(pools, tmp_path: Path) -> None:
    """SequenceParallelTrainer, FSDP2 at DP2 x R2 on 4 ranks with the tiled MLP + loss, packed documents of
    unequal length, GA 2: every step's loss and grad norm equal the plain Trainer's on one rank with sdpa (the
    replicas' global batch on it); evaluate() after training gives the exact token mean of the held-out set."""
    sp = pools.get(4, env=DS_ENV).run(trainer_case, (1, 2), str(tmp_path / "sp"), 2, timeout=300)
    assert all(res["engine"] == "FSDP2" for res in sp)
    ref, ref_dir = trainer_reference(pools, tmp_path, 4)
    compare_trainer_case(sp, ref, tmp_path / "sp", ref_dir)


def refusals_case(output_dir: str) -> dict[str, str]:
    """What FSDP2 with ring_sp refuses, on one rank, each before any communication or training."""
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from ring_sp.integrations.transformers.trainer import SequenceParallelTrainer, prepare_sequence_parallel

    _prepare_rank()
    errors: dict[str, str] = {}

    def refused(name: str, env: dict[str, str], call: Any) -> None:
        with _environment(env):
            try:
                call()
            except ValueError as exc:
                errors[name] = str(exc)

    plain = dict(output_dir=output_dir, report_to="none", save_strategy="no")
    deepspeed = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                 "ring_sp": {"ulysses_size": 1, "ring_size": 1}}
    refused("deepspeed_and_keywords", FSDP2_ENV, lambda: prepare_sequence_parallel(
        TrainingArguments(**plain, deepspeed=deepspeed), ulysses_size=1, ring_size=1))
    refused("fsdp1", {**FSDP2_ENV, "FSDP_VERSION": "1"},
            lambda: prepare_sequence_parallel(TrainingArguments(**plain), ulysses_size=1, ring_size=1))
    refused("unknown_key", FSDP2_ENV, lambda: prepare_sequence_parallel(TrainingArguments(**plain), ulysses_sise=1))
    refused("bad_value", FSDP2_ENV, lambda: prepare_sequence_parallel(TrainingArguments(**plain), ring_size=0))

    def checkpoints_on_cpu() -> None:  # the trainer shards the model itself on CPU: FSDP2 checkpoints are refused
        args = TrainingArguments(**{**plain, "save_strategy": "steps"})
        prepare_sequence_parallel(args, ulysses_size=1, ring_size=1)
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_sp")
        SequenceParallelTrainer(model=model, args=args, train_dataset=[{"input_ids": [1, 2, 3, 4]}] * 4)

    refused("checkpoints_on_cpu", FSDP2_ENV, checkpoints_on_cpu)
    return errors


def test_unsupported_setups_raise(pools, tmp_path: Path) -> None:
    """Keywords beside a DeepSpeed section, FSDP1, bad keywords (named as the section's keys), and FSDP2
    checkpoints where the trainer shards the model itself: each a clear error with the fix (keywords without
    FSDP are DDP: tests/test_engines.py)."""
    (errors,) = pools.get(1, env=DS_ENV).run(refusals_case, str(tmp_path), timeout=120)
    assert "keyword settings {'ulysses_size': 1, 'ring_size': 1} AND TrainingArguments.deepspeed" in \
        errors["deepspeed_and_keywords"] and '"ring_sp" section' in errors["deepspeed_and_keywords"]
    assert "FSDP version 1" in errors["fsdp1"] and "fsdp_version: 2" in errors["fsdp1"]
    assert "ring_sp.ulysses_sise is not a known key; did you mean 'ulysses_size'?" in errors["unknown_key"]
    assert "ring_sp.ring_size=0 must be >= 1" in errors["bad_value"]
    assert "does not support save_strategy='steps' on CPU ranks" in errors["checkpoints_on_cpu"] \
        and "save_strategy='no'" in errors["checkpoints_on_cpu"]


@pytest.mark.slow  # a 4-rank launch of the script through accelerate launch (about 25 s)
def test_example_runs(tmp_path: Path) -> None:
    """examples/trl/sft.sh --cpu --fsdp2 as README prints it: accelerate launch with examples/trl/fsdp2.yaml,
    JSON lines with loss, grad norm and TRL's metrics on stdout."""
    lines = run_launcher(REPO / "examples" / "trl" / "sft.sh", "--fsdp2", "--steps", "3", "--log-json",
                         "--max-length", "128", "--documents", "64", "--output-dir", str(tmp_path), timeout=600)
    assert [r["step"] for r in lines] == [1, 2, 3], lines
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and 0 <= r["mean_token_accuracy"] <= 1
               for r in lines), lines
