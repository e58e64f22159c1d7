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
TINY = ["--max-length", "128", "--documents", "48", "--eval-documents", "8", "--d-model", "32", "--steps", "3",
        "--optim", "sgd", "--lr", "0.5", "--warmup", "0", "--max-grad-norm", "1.0"]
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
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    out = {key: [entry[key] for entry in logs] for key in ("step", "loss", "grad_norm", "mean_token_accuracy",
                                                             "entropy", "num_tokens")}
    topology = trainer.ring_sp_topology
    out["grid"] = None if topology is None else (topology.ulysses_size, topology.ring_size, topology.dp_size)
    out["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
    out["trainable"] = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters() if p.requires_grad)
    if evaluate:
        out["eval"] = trainer.evaluate()
    return out


def eval_case(argv: list[str], output_dir: str) -> dict[str, float]:
    """evaluate() of an untrained model (the example's held-out set, packed), plus the oracle token mean."""
    _prepare_rank()
    trainer = _example().build_trainer([*argv, "--eval-steps", "1", "--output-dir", output_dir])
    if trainer.ring_sp_topology is None:  # the oracle (transformers' evaluate() refuses an untrained ZeRO-1 engine)
        return {"token_mean": _token_mean(trainer)}
    return trainer.evaluate()


def _token_mean(trainer: Any) -> float:
    """The eval set's next-token loss as ONE token mean, over whole sequences, here without SP (the oracle)."""
    total, count = 0.0, 0
    model = trainer.model.eval()
    with torch.no_grad():
        for batch in trainer.get_eval_dataloader():
            labels = batch["labels"][:, 1:]  # TRL's padding-free collator marks every document's first label -100
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            total += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), labels.flatten(),
                                                       reduction="sum", ignore_index=-100).item()
            count += int((labels != -100).sum())
    return total / count


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def _compare(results: list[dict[str, Any]], ref: dict[str, Any], tol: float = 1e-5) -> None:
    assert ref["step"] == [1, 2, 3], ref["step"]
    assert ref["loss"][-1] < ref["loss"][0], ref["loss"]  # it trains
    for res in results:
        assert res["step"] == ref["step"] and res["trainable"] == ref["trainable"]
        for name in ("loss", "grad_norm", "entropy", "mean_token_accuracy"):
            errors = [_rel(g, w) for g, w in zip(res[name], ref[name])]
            assert max(errors) < tol, (name, res[name], ref[name])
        assert res["num_tokens"] == ref["num_tokens"], (res["num_tokens"], ref["num_tokens"])


def _sp_vs_one_rank(pools, tmp_path: Path, grid: tuple[int, int], stage: int, extra: list[str]) -> None:
    args = [*TINY, "--zero-stage", str(stage), *extra]
    sp = pools.get(4, env=DS_ENV).run(train_case, [*args, "--ulysses-size", str(grid[0]), "--ring-size", str(grid[1])],
                                      str(tmp_path / "sp"), timeout=400)
    dp = 4 // (grid[0] * grid[1])
    assert [res["grid"] for res in sp] == [(grid[0], grid[1], dp)] * 4
    assert all(res["zero_stage"] == stage for res in sp)
    micro = int(args[args.index("--micro-batch") + 1]) if "--micro-batch" in args else 2
    (ref,) = pools.get(1, env=DS_ENV).run(train_case, [*args, "--no-ring-sp", "--micro-batch", str(micro * dp)],
                                          str(tmp_path / "ref"), timeout=400)
    assert ref["grid"] is None
    _compare(sp, ref)


@pytest.mark.parametrize("grid,stage,extra", [
    # the two grids of the target, BFD packing (padding-free, positions restarting per document);
    # U1xR4 with ONE KV head: fewer KV heads than the SP degree; gradient accumulation x SP
    ((2, 2), 1, ["--grad-accum", "2"]),
    ((1, 4), 3, ["--kv-heads", "1"]),
    # PEFT LoRA with the completion-only loss (prompt-completion data), DP 2 x R2
    pytest.param((1, 2), 1, ["--lora", "--data", "prompt-completion"], marks=pytest.mark.slow),
    # padded rows (packing=False: ring_sp drops the padding), DFT loss, ZeRO-2
    pytest.param((2, 2), 2, ["--packing", "none", "--loss-type", "dft"], marks=pytest.mark.slow),
    # bfd_split packing, a sliding-window model (every layer windowed, window < a document)
    pytest.param((2, 2), 1, ["--packing", "bfd_split", "--model", "mistral", "--sliding-window", "24"],
                 marks=pytest.mark.slow),
])
def test_sft_sp_equals_one_rank(pools, tmp_path: Path, grid: tuple[int, int], stage: int, extra: list[str]) -> None:
    """Every step's loss, DeepSpeed grad norm, mean token accuracy, entropy and token count on 4 ranks
    equal plain TRL's on one rank with sdpa."""
    _example()  # the rank functions import it by module name
    _sp_vs_one_rank(pools, tmp_path, grid, stage, extra)


def test_sft_sliding_window_lora_completion_only(pools, tmp_path: Path) -> None:
    """The default suite's sample of the slow sweep: Mistral (sliding window 24 < documents) with a LoRA
    adapter and the completion-only loss at U2 x R2 against plain TRL with sdpa on one rank."""
    _example()
    _sp_vs_one_rank(pools, tmp_path, (2, 2), 1, ["--model", "mistral", "--sliding-window", "24", "--lora",
                                                  "--data", "prompt-completion"])


def test_eval_loss_equal_at_sp_1_2_4(pools, tmp_path: Path) -> None:
    """evaluate() at SP 1 (DP 4), SP 2 (DP 2) and SP 4 (DP 1) on 4 ranks: the exact token mean of the packed
    eval set, as one rank with sdpa computes it, and the same eval metrics (token means) at every SP degree."""
    _example()
    args = [*TINY, "--eval-documents", "48"]
    pool = pools.get(4, env=DS_ENV)
    got = {sp: pool.run(eval_case, [*args, "--ulysses-size", str(u), "--ring-size", str(r)], str(tmp_path / str(sp)),
                        timeout=400)
           for sp, (u, r) in {1: (1, 1), 2: (1, 2), 4: (2, 2)}.items()}
    (ref,) = pools.get(1, env=DS_ENV).run(eval_case, [*args, "--no-ring-sp"], str(tmp_path / "ref"), timeout=400)
    for sp, results in got.items():
        for res in results:
            assert _rel(res["eval_loss"], ref["token_mean"]) < 1e-5, (sp, res["eval_loss"], ref["token_mean"])
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
    results = pools.get(4).run(isolation_case, timeout=300)
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
    """What SequenceParallelSFTTrainer refuses, on one rank (U1 x R1), before any training."""
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
    (errors,) = pools.get(1, env=DS_ENV).run(refusals_case, timeout=300)
    assert "does not support use_liger_kernel" in errors["liger"] and "use_liger_kernel=False" in errors["liger"]
    assert "SequenceParallelSFTTrainer.predict without prediction_loss_only" in errors["predict"]


@pytest.mark.slow  # a 4-rank launch of the script through the DeepSpeed launcher
def test_example_runs() -> None:
    """examples/trl/sft.sh --cpu as README prints it: JSON lines with loss, grad norm and TRL's metrics."""
    lines = run_launcher(EXAMPLE / "sft.sh", "--steps", "3", "--log-json", "--max-length", "128", "--documents", "64",
                         timeout=600)
    assert [r["step"] for r in lines] == [1, 2, 3], lines
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 and 0 <= r["mean_token_accuracy"] <= 1 for r in lines), lines
