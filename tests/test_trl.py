"""Issue 33: TRL's ``SFTTrainer`` on the grid (``SequenceParallelSFTTrainer``), against plain TRL on one rank.

The rank cases build the trainer of ``examples/trl/sft.py`` (a small Llama from a config, a
byte-level tokenizer and a dataset built locally from the stdlib's docstrings) on gloo ranks
with DeepSpeed's CPU accelerator and train a few SGD steps; the reference is plain
``trl.SFTTrainer`` with ``attn_implementation="sdpa"`` on ONE rank, the same DeepSpeed config
with the ``"ring_sp"`` section disabled, the same seed and global batch. Every step's loss and
DeepSpeed grad norm must agree within 1e-5 relative (the target is 1e-4), and TRL's logged
metrics (mean token accuracy, entropy, tokens) too.

The path's known failures, each against one rank with sdpa (transformers isolates packed
documents for sdpa only without a KV cache, so every reference runs with ``use_cache=False``):
packed documents (document 2 must not see document 1: a probe shows the reference itself would
leak with a cache), a sliding-window model (Mistral), the eval loss at SP 1, 2 and 4, gradient
accumulation x SP, and fewer KV heads than the SP degree.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from example_scripts import load_script, run_launcher

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "trl"
DS_ENV = {"DS_ACCELERATOR": "cpu"}  # the same pools as tests/test_deepspeed.py
HAVE_STACK = all(importlib.util.find_spec(m) is not None for m in ("deepspeed", "transformers", "accelerate", "trl"))
pytestmark = pytest.mark.skipif(not HAVE_STACK, reason="needs deepspeed, transformers, accelerate and trl "
                                "(pip install --no-build-isolation 'ring-sp[trl]')")

# tiny model and data; 3 SGD steps of packed rows of 128 tokens (the GLOBAL length)
TINY = ["--max-length", "128", "--documents", "48", "--eval-documents", "8", "--d-model", "32", "--layers", "2",
        "--steps", "3", "--optim", "sgd", "--lr", "0.5", "--warmup", "0", "--max-grad-norm", "1.0"]
_MODULE = "ring_sp_trl_sft"


def _example():
    return load_script(_MODULE, EXAMPLE / "sft.py")


def _prepare_rank() -> None:
    import torch.distributed as dist
    from deepspeed.utils import groups

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # DeepSpeed and accelerate require it; one host
    groups.mpu = None  # DeepSpeed keeps the last engine's mpu process-wide


def train_case(argv: list[str], output_dir: str, evaluate: bool = False) -> dict[str, Any]:
    """Build the example's trainer, train; every step's logged values (and evaluate()'s, if asked)."""
    _prepare_rank()
    trainer = _example().build_trainer([*argv, "--output-dir", output_dir])
    trainer.train()
    return results_of(trainer, evaluate)


def results_of(trainer: Any, evaluate: bool = False) -> dict[str, Any]:
    """A trained trainer's logged values per step, its grid and engine (and evaluate()'s, if asked)."""
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    out = {key: [entry[key] for entry in logs] for key in ("step", "loss", "grad_norm", "mean_token_accuracy",
                                                             "entropy", "num_tokens")}
    topology = trainer.ring_sp_topology
    out["grid"] = None if topology is None else (topology.ulysses_size, topology.ring_size, topology.dp_size)
    out["zero_stage"] = getattr(trainer.model_wrapped, "zero_optimization_stage", lambda: None)()  # None: not DeepSpeed
    out["engine"] = None if trainer.ring_sp_engine is None else trainer.ring_sp_engine.kind
    out["trainable"] = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters() if p.requires_grad)
    if evaluate:
        out["eval"] = trainer.evaluate()
        if topology is None:
            out["token_mean"] = _token_mean(trainer)
    return out


def eval_case(argv: list[str], output_dir: str) -> dict[str, float]:
    """evaluate() of an untrained model (the example's held-out set, packed), and this rank's oracle token mean."""
    _prepare_rank()
    trainer = _example().build_trainer([*argv, "--eval-steps", "1", "--output-dir", output_dir])
    return {**trainer.evaluate(), "token_mean": _token_mean(trainer)}


def _token_mean(trainer: Any) -> float:
    """The oracle: the WHOLE eval set on this rank, one packed row at a time through TRL's own collator, with
    sdpa and no KV cache; the next-token loss as one token mean over every sequence."""
    import copy

    from ring_sp.integrations.transformers import uses_ring_sp

    collator = getattr(trainer.data_collator, "collator", trainer.data_collator)  # TRL's, inside SFTShardCollator
    model = trainer.model
    if uses_ring_sp(model):
        model = copy.deepcopy(model)
        model.set_attn_implementation("sdpa")
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in trainer.eval_dataset:
            batch = collator([row])
            labels = batch["labels"][:, 1:]  # TRL's padding-free collator marks every document's first label -100
            # the class's forward: TRL's fused-head patch of the instance still calls the ORIGINAL model's forward
            logits = type(model).forward(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                         use_cache=False).logits
            total += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels.flatten(),
                                                       reduction="sum", ignore_index=-100).item()
            count += int((labels != -100).sum())
    return total / count


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def _compare(results: list[dict[str, Any]], ref: dict[str, Any], tol: float = 1e-5, trains: bool = True) -> None:
    assert ref["step"] == [1, 2, 3], ref["step"]
    assert not trains or ref["loss"][-1] < ref["loss"][0], ref["loss"]  # it trains
    for res in results:
        assert res["step"] == ref["step"] and res["trainable"] == ref["trainable"]
        for name in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            errors = [_rel(g, w) for g, w in zip(res[name], ref[name])]
            assert max(errors) < tol, (name, res[name], ref[name])
        assert res["num_tokens"] == ref["num_tokens"], (res["num_tokens"], ref["num_tokens"])


def _run_sp(pools, tmp_path: Path, name: str, grid: tuple[int, int], stage: int, extra: list[str],
            evaluate: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """4 ranks at ``grid``: every rank's results, and the reference's arguments (one rank, the same global batch)."""
    args = [*TINY, "--zero-stage", str(stage), *extra]
    sp = pools.get(4, env=DS_ENV).run(train_case, [*args, "--ulysses-size", str(grid[0]), "--ring-size", str(grid[1])],
                                      str(tmp_path / name / "sp"), evaluate, timeout=400)
    dp = 4 // (grid[0] * grid[1])
    assert [res["grid"] for res in sp] == [(grid[0], grid[1], dp)] * 4
    assert all(res["zero_stage"] == stage for res in sp)
    micro = int(args[args.index("--micro-batch") + 1]) if "--micro-batch" in args else 2
    return sp, [*args, "--no-ring-sp", "--micro-batch", str(micro * dp)]


_REFERENCES: dict[tuple, dict[str, Any]] = {}  # one-rank reference runs by arguments, shared (tests/test_engines.py)


def _run_ref(pools, tmp_path: Path, name: str, ref_args: list[str], evaluate: bool = False) -> dict[str, Any]:
    """Plain TRL on one rank with sdpa (``--no-ring-sp``), run once per session for the same arguments."""
    key = (*ref_args, evaluate)
    if key not in _REFERENCES:
        (_REFERENCES[key],) = pools.get(1, env=DS_ENV).run(train_case, ref_args, str(tmp_path / name / "ref"), evaluate,
                                                           timeout=400)
    ref = _REFERENCES[key]
    assert ref["grid"] is None
    return ref


# the two target grids, TRL's BFD packing (padding-free rows, positions restarting per document, labels
# masked at document starts), ZeRO-1 and ZeRO-3; with them: gradient accumulation x SP, a sliding-window model
# (Mistral, window 24 < most documents) with the eval loss after training, and ONE KV head on 4 SP ranks
DEFAULT_CASES = {
    "U2xR2-zero1-GA2-mistral-window": ((2, 2), 1, ["--grad-accum", "2", "--model", "mistral", "--sliding-window", "24"]),
    "U1xR4-zero3-1kv": ((1, 4), 3, ["--kv-heads", "1"]),
}


def test_sft_sp_equals_one_rank(pools, tmp_path: Path) -> None:
    """Every step's loss, DeepSpeed grad norm, mean token accuracy, entropy and token count on 4 ranks
    (U2xR2 ZeRO-1, U1xR4 ZeRO-3) equal plain TRL's on one rank with sdpa; so does evaluate() after training
    (the exact token mean, against one rank's token mean over the packed eval set)."""
    _example()  # the rank functions import it by module name
    sp = {name: _run_sp(pools, tmp_path, name, *case, evaluate=name.startswith("U2xR2"))
          for name, case in DEFAULT_CASES.items()}  # both 4-rank runs first: one pool start each way
    for name, (results, ref_args) in sp.items():
        ref = _run_ref(pools, tmp_path, name, ref_args, evaluate=name.startswith("U2xR2"))
        _compare(results, ref)
        if "token_mean" in ref:
            for res in results:
                assert _rel(res["eval"]["eval_loss"], ref["token_mean"]) < 1e-5, (res["eval"], ref["token_mean"])


@pytest.mark.slow
@pytest.mark.parametrize("grid,stage,extra", [
    pytest.param((2, 2), 1, [], id="U2xR2-zero1-llama"),
    # PEFT LoRA with the completion-only loss (prompt-completion data), DP 2 x R2
    pytest.param((1, 2), 1, ["--lora", "--data", "prompt-completion"], id="DP2xR2-zero1-lora-completion"),
    pytest.param((2, 2), 1, ["--lora", "--data", "prompt-completion", "--model", "mistral"],
                 id="U2xR2-zero1-lora-completion-mistral"),
    # padded rows (packing=False: ring_sp drops the padding), DFT loss, ZeRO-2
    pytest.param((2, 2), 2, ["--packing", "none", "--loss-type", "dft"], id="U2xR2-zero2-padded-dft"),
    # bfd_split packing (long documents split), a sliding window
    pytest.param((2, 2), 1, ["--packing", "bfd_split", "--model", "mistral"], id="U2xR2-zero1-bfd_split-mistral"),
    # activation checkpointing (TRL's default) and AdamW, ZeRO-3
    pytest.param((1, 4), 3, ["--gradient-checkpointing", "--optim", "adamw_torch", "--lr", "1e-3"],
                 id="U1xR4-zero3-checkpointing-adamw"),
])
def test_sft_sweep(pools, tmp_path: Path, grid: tuple[int, int], stage: int, extra: list[str]) -> None:
    """The sweep: more TRL settings at 4 ranks against plain TRL with sdpa on one rank."""
    _example()
    results, ref_args = _run_sp(pools, tmp_path, "case", grid, stage, extra)
    _compare(results, _run_ref(pools, tmp_path, "case", ref_args),
             trains="dft" not in extra)  # DFT's loss (probability-weighted) need not fall in 3 steps


def test_eval_loss_equal_at_sp_1_2_4(pools, tmp_path: Path) -> None:
    """evaluate() at SP 1 (DP 4), SP 2 (DP 2) and SP 4 (DP 1) on 4 ranks: the exact token mean of the packed
    eval set (each rank also computes it alone, with sdpa), and the same eval metrics at every SP degree."""
    _example()
    args = [*TINY, "--eval-documents", "48"]
    pool = pools.get(4, env=DS_ENV)
    got = {sp: pool.run(eval_case, [*args, "--ulysses-size", str(u), "--ring-size", str(r)], str(tmp_path / str(sp)),
                        timeout=400)
           for sp, (u, r) in {1: (1, 1), 2: (1, 2), 4: (2, 2)}.items()}
    oracle = got[1][0]["token_mean"]
    for sp, results in got.items():
        for res in results:
            assert _rel(res["token_mean"], oracle) < 1e-9, (sp, res["token_mean"], oracle)
            assert _rel(res["eval_loss"], oracle) < 1e-5, (sp, res["eval_loss"], oracle)
            for key in ("eval_entropy", "eval_mean_token_accuracy"):
                assert _rel(res[key], got[1][0][key]) < 1e-5, (sp, key, res[key], got[1][0][key])


def isolation_case() -> dict[str, float]:
    """Two packed documents through TRL's padding-free collator at U2 x R2 against sdpa on one rank.

    Returns the worst |logit| differences of document 2: ring_sp vs document 2 alone, the sdpa
    reference without a KV cache vs alone (transformers isolates packed documents then), and the
    probe: sdpa WITH a cache on the packed row, where document 2 sees document 1.
    """
    import copy

    import ring_sp
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from ring_sp.integrations import transformers as rsp_hf
    from ring_sp.integrations.transformers.sft_trainer import TOKENS_KEY, SFTShardCollator

    topology = ring_sp.init_sequence_parallel(ulysses_size=2, ring_size=2)
    rsp_hf.register(topology, layout="zigzag")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_sp").eval()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 64, (n,), generator=gen) for n in (37, 51)]
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    examples = [{"input_ids": d.tolist()} for d in docs]
    batch = collator(examples)
    shard = SFTShardCollator(collator, topology, layout="zigzag")(examples)
    inputs = {k: v for k, v in shard.items() if k not in ("shift_labels", TOKENS_KEY)}
    n = batch["input_ids"].shape[1]
    with torch.no_grad():
        local = model(**inputs, use_cache=False).logits
        full = topology.gather_sequence(local, layout="document_zigzag", cu_seqlens=shard["cu_seq_lens_q"], seq_len=n)
        packed = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        cached = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits
        alone = ref(input_ids=docs[1][None], use_cache=False).logits
    second = slice(len(docs[0]), n)
    return {"ring_sp": (full[0, second] - alone[0]).abs().max().item(),
            "sdpa_no_cache": (packed[0, second] - alone[0]).abs().max().item(),
            "sdpa_cache_probe": (cached[0, second] - alone[0]).abs().max().item()}


def test_packed_documents_isolated(pools) -> None:
    """Document 2 of a packed row does not see document 1, through TRL's collator and ring_sp's shards."""
    results = pools.get(4, env=DS_ENV).run(isolation_case, timeout=300)
    for res in results:
        assert res["sdpa_cache_probe"] > 1e-3, res  # the probe can see a leak: sdpa with a cache attends across
        assert res["sdpa_no_cache"] < 1e-5, res  # the reference isolates the documents (use_cache=False)
        assert res["ring_sp"] < 1e-5, res


def test_import_is_lazy() -> None:
    """Importing the package imports neither transformers nor trl; the attribute imports the trainer."""
    code = ("import sys, ring_sp.integrations.transformers as m\n"
            "assert 'transformers' not in sys.modules and 'trl' not in sys.modules, 'eager'\n"
            "cls = m.SequenceParallelSFTTrainer\n"
            "import trl\n"
            "assert issubclass(cls, trl.SFTTrainer) and 'trl' in sys.modules\n"
            "try:\n    m.NoSuchName\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def refusals_case() -> dict[str, str]:
    """What SequenceParallelSFTTrainer refuses (U1 x R1), before any training."""
    import dataclasses

    from ring_sp.integrations.transformers import SequenceParallelSFTTrainer

    _prepare_rank()
    trainer = _example().build_trainer([*TINY, "--ulysses-size", "1", "--ring-size", "1", "--eval-steps", "1",
                                        "--output-dir", "unused"])
    errors = {}
    try:  # first: building a second trainer resets accelerate's process-wide state under the first
        trainer.predict(trainer.eval_dataset)
    except ValueError as exc:
        errors["predict"] = str(exc)
    try:
        SequenceParallelSFTTrainer(model=trainer.model, args=dataclasses.replace(trainer.args, use_liger_kernel=True),
                                   train_dataset=trainer.train_dataset, processing_class=trainer.processing_class)
    except ValueError as exc:
        errors["liger"] = str(exc)
    return errors


def test_unsupported_setups_raise(pools) -> None:
    _example()
    errors = pools.get(4, env=DS_ENV).run(refusals_case, timeout=300)[0]  # U1 x R1 on each of 4 ranks (DP 4)
    assert "does not support use_liger_kernel" in errors["liger"] and "use_liger_kernel=False" in errors["liger"]
    assert "SequenceParallelSFTTrainer.predict without prediction_loss_only" in errors["predict"]


@pytest.mark.slow  # a 4-rank launch of the script through the DeepSpeed launcher
def test_example_runs() -> None:
    """examples/trl/sft.sh --cpu as README prints it: JSON lines with loss, grad norm and TRL's metrics."""
    lines = run_launcher(EXAMPLE / "sft.sh", "--steps", "3", "--log-json", "--max-length", "128", "--documents", "64",
                         timeout=600)
    assert [r["step"] for r in lines] == [1, 2, 3], lines
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 and 0 <= r["mean_token_accuracy"] <= 1 for r in lines), lines
