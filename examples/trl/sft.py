"""Supervised fine-tuning with TRL's ``SFTTrainer`` and ring_sp: a small Llama on packed documents.

A plain TRL script plus the ring_sp lines (marked ``# ring_sp``): the DeepSpeed config
``ds_config.json`` holds the ``"ring_sp"`` section (U2 x R2 by default),
``prepare_sequence_parallel`` builds the groups and registers ``attn_implementation="ring_sp"``,
and ``SequenceParallelSFTTrainer`` replaces ``SFTTrainer``. Nothing is downloaded: the model is
built from a config (Llama, 4 query / 2 KV heads), the tokenizer is a byte-level one built here
(256 bytes + 3 special tokens), and the dataset is built locally from Python's stdlib docstrings
(``datasets.Dataset.from_dict``). Run it with the launcher::

    examples/trl/sft.sh --cpu                      # 4 CPU ranks, U2 x R2, ZeRO-1 (DeepSpeed launcher)
    examples/trl/sft.sh --bf16 --ring-size 4       # every GPU of this machine
    examples/trl/sft.sh --cpu --fsdp2              # FSDP2 instead: accelerate launch --config_file fsdp2.yaml
    examples/trl/sft.sh --cpu --ddp                # DDP instead (no DeepSpeed, no FSDP)

``--fsdp2`` trains without DeepSpeed: the config's ``"ring_sp"`` section becomes
``prepare_sequence_parallel``'s keywords (the same settings) and FSDP2 shards the model over
all ranks (accelerate on GPUs; on CPU ranks the trainer itself, as accelerate 1.15 sets no
FSDP up there). ``--fsdp2`` must run under ``accelerate launch`` with an FSDP2 config.
``--ddp`` takes the same keywords without FSDP: plain ``DistributedDataParallel`` over all ranks
(``use_cpu=True`` on CPU ranks, where accelerate wraps nothing otherwise); any launcher.

``--max-length`` is the GLOBAL length of a packed row (TRL's BFD packing: documents never
split, ``position_ids`` restarting per document), cut over the ``U x R`` ranks. ``--data
prompt-completion`` trains with TRL's completion-only loss (each docstring's first line is the
prompt), ``--lora`` with a PEFT LoRA adapter, ``--packing none`` on padded rows. ``--no-ring-sp``
trains the same model with ``attn_implementation="sdpa"`` and the same global batch without
sequence parallelism (``NUM_RANKS=1``): the reference the ring_sp run matches step by step.
Prints a tqdm bar (loss, tokens/s) on stderr and, with ``--log-json``, one JSON line per step
(``step``, ``loss``, ``grad_norm``, ``mean_token_accuracy``, ``entropy``, ``tokens_per_s``) on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset, disable_progress_bars
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, TrainerCallback)
from transformers.trainer_callback import ProgressCallback
from trl import SFTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.common

import ring_sp.integrations.deepspeed as rsp_ds  # noqa: E402
from examples.common.data import _docstrings  # noqa: E402
from examples.common.progress import Progress  # noqa: E402
from ring_sp.integrations.transformers import SequenceParallelSFTTrainer  # noqa: E402  # ring_sp
from ring_sp.integrations.transformers.trainer import prepare_sequence_parallel  # noqa: E402  # ring_sp

DEFAULT_CONFIG = Path(__file__).resolve().with_name("ds_config.json")
SPECIAL = ("<pad>", "<eos>", "<unk>")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed-config", default=str(DEFAULT_CONFIG), help="DeepSpeed JSON config (with 'ring_sp')")
    p.add_argument("--ulysses-size", type=int, help="override ring_sp.ulysses_size of the config")
    p.add_argument("--ring-size", type=int, help="override ring_sp.ring_size of the config")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override zero_optimization.stage")
    p.add_argument("--fsdp2", action="store_true",
                   help="FSDP2 instead of DeepSpeed (run under accelerate launch --config_file fsdp2.yaml)")
    p.add_argument("--ddp", action="store_true",
                   help="DDP instead of DeepSpeed: the section's settings as keywords, no FSDP (use_cpu on CPU ranks)")
    p.add_argument("--no-ring-sp", action="store_true",
                   help='reference run: disable the ring_sp section, attn_implementation="sdpa" (use one rank)')
    p.add_argument("--model", choices=["llama", "mistral"], default="llama",
                   help="mistral: a sliding window (--sliding-window) in every layer")
    p.add_argument("--sliding-window", type=int, default=24)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-length", type=int, default=512, help="SFTConfig.max_length: the GLOBAL packed row length")
    p.add_argument("--packing", choices=["bfd", "bfd_split", "wrapped", "none"], default="bfd")
    p.add_argument("--data", choices=["text", "prompt-completion"], default="text")
    p.add_argument("--documents", type=int, default=1200, help="docstrings in the training set")
    p.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter (r=8) on the attention projections")
    p.add_argument("--loss-type", choices=["nll", "dft"], default="nll")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--micro-batch", type=int, default=2, help="packed rows per micro-batch per data-parallel replica")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off here (faster on CPU)")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPUs)")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (the exact eval loss); 0: never")
    p.add_argument("--eval-documents", type=int, default=24, help="held-out docstrings (evaluate(), --eval-steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="sft_output")
    p.add_argument("--log-json", action="store_true", help="one JSON object per step on stdout")
    p.add_argument("--timeout-s", type=int, default=300, help="process-group timeout")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by launchers
    return p.parse_args(argv)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built here (no download): 256 byte tokens, then <pad>, <eos>, <unk>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab.update({token: len(alphabet) + i for i, token in enumerate(SPECIAL)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """(train, eval) built locally from the stdlib's docstrings: plain text or prompt / completion."""
    wanted = args.documents + args.eval_documents
    pieces = _docstrings(min(4_000_000, 2_000 * wanted))  # the stdlib parsed only as far as needed: the same first
    if len(pieces) < wanted:                               # documents, in file order, without seconds of parsing
        pieces = _docstrings(4_000_000)
    docs = [d.decode("utf-8", errors="replace").strip() for d in pieces]
    docs = [d[: 3 * args.max_length] for d in docs]  # some longer than a row: BFD truncates, bfd_split splits them
    train, held_out = docs[: args.documents], docs[args.documents: args.documents + args.eval_documents]

    def build(texts: list[str]) -> Dataset:
        if args.data == "text":
            return Dataset.from_dict({"text": texts})
        first = [t.split("\n", 1) for t in texts]
        return Dataset.from_dict({"prompt": [f[0] + "\n" for f in first],
                                  "completion": [f[1] if len(f) > 1 else "" for f in first]})

    return build(train), build(held_out)


def model_config(args: argparse.Namespace, vocab_size: int, pad_id: int, eos_id: int):
    common = dict(vocab_size=vocab_size, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  max_position_embeddings=4 * args.max_length, tie_word_embeddings=False, use_cache=False,
                  pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None)
    if args.model == "mistral":
        return MistralConfig(sliding_window=args.sliding_window, **common)
    return LlamaConfig(**common)


def ring_sp_keywords(args: argparse.Namespace) -> dict:
    """--fsdp2 / --ddp: the config's "ring_sp" section (with the overrides) as prepare_sequence_parallel's keywords."""
    return dict(ds_config(args)[rsp_ds.SECTION])


def ds_config(args: argparse.Namespace) -> dict:
    config = rsp_ds.load_config(args.deepspeed_config)
    section = config.setdefault(rsp_ds.SECTION, {})
    for key in ("ulysses_size", "ring_size"):
        if getattr(args, key) is not None:
            section[key] = getattr(args, key)
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.no_ring_sp:
        section["enabled"] = False
    return config


class StepProgress(TrainerCallback):
    """Replaces the Trainer's bar: examples.common's tqdm bar (loss, tokens/s) and JSON lines, once per step."""

    def __init__(self, total_steps: int, log_json: bool) -> None:
        self.progress = Progress(total_steps, log_json=log_json, enabled=dist.get_rank() == 0)
        self.tokens_seen = 0

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:  # noqa: ANN001 (Trainer's signature)
        if logs and "loss" in logs:
            tokens = int(logs.get("num_tokens", 0))
            extra = {k: round(float(logs[k]), 6) for k in ("grad_norm", "mean_token_accuracy", "entropy") if k in logs}
            self.progress.step(state.global_step, float(logs["loss"]), tokens - self.tokens_seen, **extra)
            self.tokens_seen = tokens
        if logs and "eval_loss" in logs:
            self.progress.log(state.global_step, eval_loss=float(logs["eval_loss"]))


def build_trainer(argv: list[str] | None = None) -> SequenceParallelSFTTrainer:
    """Everything up to ``trainer.train()`` (the tests call this on their own ranks)."""
    args = parse_args(argv)
    if os.environ.get("RANK", "0") != "0":
        disable_progress_bars()  # datasets' preparation bars once, not once per rank
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    training_args = SFTConfig(
        output_dir=args.output_dir, deepspeed=None if args.fsdp2 or args.ddp else ds_config(args),
        use_cpu=args.ddp and not torch.cuda.is_available(),  # DDP on CPU ranks: accelerate's MULTI_CPU
        ddp_find_unused_parameters=False if args.ddp else None,  # every parameter is used: no extra graph walk
        per_device_train_batch_size=args.micro_batch,
        per_device_eval_batch_size=args.micro_batch, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=args.lr, warmup_steps=args.warmup, lr_scheduler_type="cosine",
        optim=args.optim, max_grad_norm=args.max_grad_norm, bf16=args.bf16, seed=args.seed, data_seed=args.seed,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_drop_last=True,
        gradient_checkpointing=args.gradient_checkpointing, max_length=args.max_length,
        packing=args.packing != "none", packing_strategy="bfd" if args.packing == "none" else args.packing,
        loss_type=args.loss_type, eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None, ddp_timeout=args.timeout_s, dataloader_pin_memory=torch.cuda.is_available(),
    )
    if args.fsdp2 or args.ddp:  # ring_sp: the same settings as keywords; FSDP2 comes from accelerate launch's config
        topology = prepare_sequence_parallel(training_args, **ring_sp_keywords(args))
    else:
        topology = prepare_sequence_parallel(training_args)  # ring_sp: groups + attn_implementation "ring_sp"
    tokenizer = byte_tokenizer()
    torch.manual_seed(args.seed)
    config = model_config(args, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    attention = "sdpa" if topology is None else "ring_sp"  # ring_sp
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 lora_dropout=0.0, task_type="CAUSAL_LM")
    train, held_out = datasets(args)
    trainer = SequenceParallelSFTTrainer(  # ring_sp: was SFTTrainer
        model=model, args=training_args, train_dataset=train, eval_dataset=held_out,
        processing_class=tokenizer, peft_config=peft_config)
    if dist.get_rank() == 0:
        dp = dist.get_world_size() if topology is None else topology.dp_size
        engine = "FSDP2" if args.fsdp2 else "DDP" if args.ddp else "DeepSpeed"
        grid = "1 (sdpa)" if topology is None else f"{topology.ulysses_size}x{topology.ring_size} (ulysses x ring)"
        print(f"{args.model} {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
              f"{args.micro_batch * args.grad_accum * dp} rows of <= {args.max_length} tokens per step; world "
              f"{dist.get_world_size()} = DP {dp} x SP {grid}; {engine}",
              file=sys.stderr)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(StepProgress(args.steps, args.log_json))
    trainer.ring_sp_example_args = args
    return trainer


def main(argv: list[str] | None = None) -> None:
    build_trainer(argv).train()


if __name__ == "__main__":
    main()
