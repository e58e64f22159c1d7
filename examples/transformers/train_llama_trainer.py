"""Train a small Llama (GQA) with the Hugging Face ``Trainer``, DeepSpeed and ring_sp.

A plain Trainer script plus the three ring_sp lines (marked ``# ring_sp``): the DeepSpeed
config ``trainer_ds_config.json`` holds the ``"ring_sp"`` section (U2 x R2 by default),
``prepare_sequence_parallel`` builds the groups and registers ``attn_implementation="ring_sp"``,
and ``SequenceParallelTrainer`` replaces ``Trainer``. The model is built from a config (no
download): Llama architecture, 4 query / 2 KV heads, byte vocabulary; the data are Python's
stdlib docstrings as bytes. Run it with the launcher::

    examples/transformers/train_llama_trainer.sh --cpu                 # 4 CPU ranks, U2 x R2
    examples/transformers/train_llama_trainer.sh --bf16 --ring-size 4  # every GPU of this machine

``--ddp`` trains under plain DDP instead of DeepSpeed (the config's ``"ring_sp"`` section
becomes ``prepare_sequence_parallel``'s keywords; checkpoints and ``--resume`` work the same).

``--pack-documents`` trains on whole documents, each micro-batch flattened into one row by
``DataCollatorWithFlattening`` (position_ids restart per document: attention stays inside
each document). ``--no-ring-sp`` trains the same model with ``attn_implementation="sdpa"`` and the same
global batch without sequence parallelism (run it on one rank: ``NUM_RANKS=1``), the
reference the ring_sp loss curve matches. ``--eval-steps K`` evaluates on held-out text every
K steps (the exact eval loss, the token mean over ``--eval-samples`` samples). ``--generate-every K``
samples the model's continuation of a held-out prompt every K steps, in the training processes
(``rsp_hf.GenerationCallback``: ``generate()`` over the SP ranks, the training left bit for bit
as it was). Prints a tqdm bar (loss, tokens/s) on stderr and, with ``--log-json``, one
``{"step", "loss", "tokens_per_s"}`` per step on stdout (tokens/s counts ``seq_len`` per sample:
an upper bound with ``--pack-documents``), one ``{"step", "eval_loss"}`` per evaluation and one
``{"step", "sample"}`` per generation.

Checkpoints: ``--save-steps K`` writes ``checkpoint-K, 2K, ...`` into ``--output-dir``, each
marked complete only once every rank has written it; ``--resume`` continues from the newest
complete one (``--resume checkpoint-N``: that one), bitwise as a run never stopped. A rank that
dies makes the others stop with an error naming it (``--timeout-s`` bounds the wait on one that hangs).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.common

import ring_sp.integrations.deepspeed as rsp_ds  # noqa: E402
from examples.common.data import TokenWindows, corpus_documents, corpus_tokens, split_corpus  # noqa: E402
from examples.common.faults import LostRanks, fault_from_env  # noqa: E402
from examples.common.progress import Progress  # noqa: E402
from examples.deepspeed.pretrain_gpt import common_args, ds_config_from_args  # noqa: E402
from examples.transformers.pretrain_llama import llama_config  # noqa: E402  (the same small Llama)
from ring_sp.nodes import describe_links  # noqa: E402
from ring_sp.integrations.transformers.trainer import (SequenceParallelTrainer,  # noqa: E402  # ring_sp
                                                       prepare_sequence_parallel)
from ring_sp.integrations.transformers.trainer_setup import newest_complete_checkpoint  # noqa: E402
from ring_sp.integrations.transformers.generation_callback import GenerationCallback  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().with_name("trainer_ds_config.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The DeepSpeed examples' arguments (``--d-model`` is the hidden size) plus the Trainer's own."""
    p = common_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.set_defaults(deepspeed_config=str(DEFAULT_CONFIG), micro_batch=4)
    p.add_argument("--no-ring-sp", action="store_true",
                   help='reference run: disable the ring_sp section, attn_implementation="sdpa" (use one rank)')
    p.add_argument("--ddp", action="store_true",
                   help="DDP instead of DeepSpeed: the config's ring_sp section as keywords (use_cpu on CPU ranks)")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--optim", default="adamw_torch", help="TrainingArguments.optim (the tests use sgd)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--output-dir", default="trainer_output", help="Trainer output_dir (written only with --save)")
    p.add_argument("--save", action="store_true", help="save_model() into --output-dir at the end (loads in plain transformers)")
    p.add_argument("--save-steps", type=int, default=0, help="a Trainer checkpoint (DeepSpeed state) every N steps; 0: none")
    p.add_argument("--resume", nargs="?", const=True, metavar="CHECKPOINT",
                   help="resume_from_checkpoint: alone, the newest complete checkpoint-N of --output-dir; or that folder")
    p.add_argument("--auto-resume", action="store_true",
                   help="resume from the newest complete checkpoint of --output-dir when it has one, else start "
                        "(the same command after a failure: torchrun --max-restarts, a scheduler's requeue)")
    p.add_argument("--eval-steps", type=int, default=0,
                   help="evaluate on --eval-samples held-out samples every N steps (eval_strategy='steps'): the exact "
                        "eval loss; 0: never")
    p.add_argument("--generate-every", type=int, default=0,
                   help="sample --generate-tokens tokens after a held-out prompt every N steps and after the last, in "
                        "the training processes (rsp_hf.GenerationCallback; over the SP ranks); 0: never")
    p.add_argument("--generate-tokens", type=int, default=32, help="new tokens per --generate-every sample")
    return p.parse_args(argv)


class TrainingDataset(torch.utils.data.Dataset):
    """Windows of the byte stream as Trainer samples: ``{"input_ids", "labels"}`` (labels unshifted, HF style)."""

    def __init__(self, windows: TokenWindows) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.windows[index]
        return {"input_ids": tokens, "labels": tokens}


class Documents(torch.utils.data.Dataset):
    """The corpus's documents (cut to ``seq_len`` tokens) as Trainer samples ``{"input_ids": [...]}``."""

    def __init__(self, documents: list[torch.Tensor], seq_len: int) -> None:
        self.documents = [doc[:seq_len] for doc in documents]

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.documents[index].tolist()}


class StepWatch(TrainerCallback):
    """Calls ``at_step(step)`` of each watcher as a training step begins (the step's number, from 1)."""

    def __init__(self, *at_step: Callable[[int], None]) -> None:
        self.at_step = at_step

    def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001 (Trainer's signature)
        for call in self.at_step:
            call(state.global_step + 1)


class JsonProgress(TrainerCallback):
    """Replaces the Trainer's own bar: examples.common's tqdm bar and JSON lines, once per optimizer step."""

    def __init__(self, total_steps: int, tokens_per_step: int, *, log_json: bool) -> None:
        self.tokens_per_step = tokens_per_step
        self.progress = Progress(total_steps, log_json=log_json, enabled=dist.get_rank() == 0)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:  # noqa: ANN001 (Trainer's signature)
        if logs and "loss" in logs:
            self.progress.step(state.global_step, float(logs["loss"]), self.tokens_per_step)
        if logs and "eval_loss" in logs:
            self.progress.log(state.global_step, eval_loss=float(logs["eval_loss"]))


def sample_callback(args: argparse.Namespace) -> GenerationCallback:
    """The model's continuation of a held-out prompt (half a sequence) every ``--generate-every`` steps,
    sampled (top-k 20), printed by rank 0 as a JSON line ``{"step", "sample"}`` with ``--log-json``."""
    prompt = split_corpus(corpus_tokens(args.corpus_bytes))[1][: args.seq_len // 2].unsqueeze(0)

    def show(step: int, tokens: torch.Tensor) -> None:
        if dist.get_rank() == 0:
            text = bytes(tokens[0, prompt.shape[1]:].tolist()).decode("utf-8", errors="replace")
            print(json.dumps({"step": step, "sample": text}) if args.log_json else f"step {step}: {text!r}",
                  file=sys.stdout if args.log_json else sys.stderr, flush=True)

    return GenerationCallback(prompt, every=args.generate_every, seed=args.seed, on_generate=show,
                              max_new_tokens=args.generate_tokens, do_sample=True, top_k=20, pad_token_id=0)


def build_trainer(argv: list[str] | None = None) -> SequenceParallelTrainer:
    """Everything up to ``trainer.train()`` (the tests call this on their own ranks)."""
    args = parse_args(argv)
    # DeepSpeed's ZeRO still calls the all-gather torch 2.13 deprecated: one warning per rank, not ours to fix
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    ds_config = ds_config_from_args(args)
    if args.no_ring_sp:
        ds_config[rsp_ds.SECTION]["enabled"] = False
    training_args = TrainingArguments(
        output_dir=args.output_dir, deepspeed=None if args.ddp else ds_config,
        use_cpu=args.ddp and not torch.cuda.is_available(),  # DDP on CPU ranks: accelerate's MULTI_CPU
        # DDP regroups its gradient buckets after the first step unless it looks for unused parameters: a run
        # resumed from a checkpoint would then sum gradients in another order than one never stopped (1 ulp
        # off, measured); the search (one walk of the autograd graph per step) keeps the resume bitwise
        ddp_find_unused_parameters=True if args.ddp else None,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        warmup_steps=args.warmup, lr_scheduler_type="cosine", optim=args.optim, weight_decay=0.1, adam_beta2=0.95,
        max_grad_norm=args.max_grad_norm, bf16=args.bf16, seed=args.seed, data_seed=args.seed, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500, report_to="none",
        dataloader_drop_last=True, eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps or None,
        per_device_eval_batch_size=args.micro_batch, ddp_timeout=round(args.timeout_s),
    )
    if args.ddp:  # ring_sp: the section's settings as keywords (no DeepSpeed config to read them from)
        topology = prepare_sequence_parallel(training_args, **ds_config[rsp_ds.SECTION])
    else:
        topology = prepare_sequence_parallel(training_args)  # ring_sp: groups + attn_implementation "ring_sp"
    torch.manual_seed(args.seed)
    attention = "sdpa" if topology is None else "ring_sp"  # ring_sp
    model = AutoModelForCausalLM.from_config(llama_config(args), attn_implementation=attention, dtype=torch.float32)
    fault = fault_from_env()  # the tests' injected kill (tests/test_resume.py); None otherwise
    if fault is not None:
        fault.arm(model.model.layers[min(1, len(model.model.layers) - 1)])
    if args.pack_documents:  # Hugging Face's padding-free packing; ring_sp turns it into document masking
        documents = corpus_documents(args.corpus_bytes)
        cut = int(len(documents) * 0.95)  # the rest held out
        dataset, collator = Documents(documents[:cut], args.seq_len), DataCollatorWithFlattening()
        held_out = Documents(documents[cut:][: args.eval_samples], args.seq_len)
    else:
        train_tokens, val_tokens = split_corpus(corpus_tokens(args.corpus_bytes))
        dataset, collator = TrainingDataset(TokenWindows(train_tokens, args.seq_len)), None  # default_data_collator
        held_out = TrainingDataset(TokenWindows(val_tokens, args.seq_len))
        held_out = torch.utils.data.Subset(held_out, range(min(args.eval_samples, len(held_out))))
    trainer = SequenceParallelTrainer(model=model, args=training_args, train_dataset=dataset,  # ring_sp: was Trainer
                                      eval_dataset=held_out if args.eval_steps else None, data_collator=collator)
    dp_size = dist.get_world_size() if topology is None else topology.dp_size
    samples_per_step = args.micro_batch * args.grad_accum * dp_size
    if dist.get_rank() == 0:
        grid = "1 (sdpa)" if topology is None else f"{topology.ulysses_size}x{topology.ring_size} (ulysses x ring)"
        what = "documents of <=" if args.pack_documents else "x"
        print(f"Llama {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; {samples_per_step} {what} "
              f"{args.seq_len} tokens per step; world {dist.get_world_size()} = DP {dp_size} x SP {grid}"
              f"{'' if topology is None or not topology.node_size else '; ' + describe_links(topology.links, topology.node_size)}",
              file=sys.stderr)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(JsonProgress(args.steps, samples_per_step * args.seq_len, log_json=args.log_json))
    if fault is not None:
        trainer.add_callback(StepWatch(fault.at_step))
    if args.generate_every:
        trainer.add_callback(sample_callback(args))
    trainer.ring_sp_example_args = args
    return trainer


def main(argv: list[str] | None = None) -> None:
    trainer = build_trainer(argv)
    args = trainer.ring_sp_example_args
    hint = (f"resume with --resume (the newest complete checkpoint of {args.output_dir})" if args.save_steps else
            "save checkpoints with --save-steps K to resume after such a loss")
    with LostRanks(hint) as lost:
        trainer.add_callback(StepWatch(lost.at_step))
        resume = args.resume
        if args.auto_resume and resume is None:
            resume = newest_complete_checkpoint(args.output_dir)
        trainer.train(resume_from_checkpoint=resume)
    if args.save:
        trainer.save_model()


if __name__ == "__main__":
    main()
