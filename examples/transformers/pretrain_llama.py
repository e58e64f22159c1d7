"""Pretrain a small Hugging Face Llama (GQA) with a plain DeepSpeed loop and ring_sp.

The model is ``transformers``' own ``LlamaForCausalLM`` built from a config (no download:
4 query / 2 KV heads, RoPE, byte vocabulary) with ``attn_implementation="ring_sp"``; the
``"ring_sp"`` section of the DeepSpeed config (``examples/deepspeed/ds_config.json``,
U2 x R2 by default) gives the grid. What a user adds to a DeepSpeed loop, marked
``# ring_sp`` below: build the topology from the config, ``register`` it before the
model, shard each GLOBAL batch with ``shard_batch``, and take the loss from
``model_loss`` (``--tiled-mlp --tiled-loss``: the long-sequence step, never the full logits). Data: Python's stdlib docstrings as bytes. Run it with the launcher::

    examples/transformers/pretrain_llama.sh --cpu                      # 4 CPU ranks, U2 x R2
    examples/transformers/pretrain_llama.sh --cpu --pack-documents     # whole documents, position_ids restarting
    NUM_RANKS=1 examples/transformers/pretrain_llama.sh --cpu --no-ring-sp   # the same model with sdpa on one rank
    examples/transformers/pretrain_llama.sh --bf16 --ulysses-size 2 --ring-size 4 --seq-len 32768   # every GPU

``--pack-documents`` packs whole documents per row with transformers'
``DataCollatorWithFlattening`` (position_ids restart at every document); attention stays
inside each document. Prints a tqdm bar (loss, tokens/s) on stderr and, with
``--log-json``, one ``{"step", "loss", "tokens_per_s"}`` per step on stdout.
``--eval-interval K`` evaluates every K steps (and after the last) on held-out text: the
exact token-mean loss over ``--eval-samples`` samples (``{"step", "eval_loss"}`` lines).
``--save-pretrained DIR`` writes a Hugging Face checkpoint at the end, which plain
transformers loads (the attention has no parameters).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.*

import ring_sp  # noqa: E402
import ring_sp.integrations.deepspeed as rsp_ds  # noqa: E402
import ring_sp.integrations.transformers as rsp_hf  # noqa: E402
from examples.common.data import VOCAB_SIZE  # noqa: E402
from examples.common.progress import Progress  # noqa: E402
from examples.deepspeed.pretrain_gpt import (common_args, ds_config_from_args, endless_batches, eval_loss,  # noqa: E402
                                             held_out_dataset, lr_factor, start_rank, token_loss_sum, train_step,
                                             training_dataset)


class HFBatches:
    """``collate_fn``: samples -> a GLOBAL Hugging Face batch -> this rank's shard (``shard_batch``).

    Windows stack into ``{"input_ids": [b, N]}``; packed samples (``{"input_ids", "cu_seqlens"}``)
    become their documents, flattened by ``DataCollatorWithFlattening`` into one row with
    ``position_ids`` restarting per document, as a padding-free Hugging Face pipeline feeds them.
    """

    def __init__(self, topology: ring_sp.SequenceParallelTopology | None, *, layout: str, pack: bool) -> None:
        self.topology, self.layout = topology, layout
        self.flatten = DataCollatorWithFlattening(return_tensors="pt") if pack else None

    def __call__(self, samples: Sequence[torch.Tensor | Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if self.flatten is None:
            batch = {"input_ids": torch.stack(list(samples))}
        else:
            documents = [{"input_ids": s["input_ids"][a:b].tolist()}
                         for s in samples for a, b in zip(s["cu_seqlens"].tolist(), s["cu_seqlens"].tolist()[1:])]
            batch = self.flatten(documents)
        return rsp_hf.shard_batch(batch, self.topology, layout=self.layout)  # ring_sp


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """A small Llama: GQA, RoPE, SwiGLU, RMSNorm, tied embeddings; no KV cache while training."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, tie_word_embeddings=True, use_cache=False,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The GPT example's arguments (``--d-model`` is the hidden size), plus the reference run and a HF checkpoint."""
    p = common_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--no-ring-sp", action="store_true",
                   help='reference run: disable the ring_sp section, attn_implementation="sdpa" (use one rank)')
    p.add_argument("--save-pretrained", metavar="DIR", help="save_pretrained() the model here at the end (ZeRO 0-2)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    engine, _ = train(args)
    if args.save_pretrained and dist.get_rank() == 0:
        engine.module.save_pretrained(args.save_pretrained)  # loads in plain transformers: no ring_sp parameters


def train(args: argparse.Namespace) -> tuple[object, ring_sp.SequenceParallelTopology | None]:
    """The training run of ``args``: the DeepSpeed engine after ``--steps`` steps and the topology
    (None with ``--no-ring-sp``). examples/transformers/generate_long.py generates from it."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    start_rank(args)
    ds_config = ds_config_from_args(args)
    if args.no_ring_sp:
        ds_config[rsp_ds.SECTION]["enabled"] = False
    if args.save_pretrained and ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        raise ValueError("--save-pretrained needs ZeRO 0-2 (every rank holds the whole model); drop it or --zero-stage")
    sp_config = rsp_ds.RingSPConfig.from_ds_config(ds_config)  # None with --no-ring-sp
    topology = rsp_ds.build_topology(ds_config)  # ring_sp: the groups, before the model
    if topology is None:
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        attention, layout = "sdpa", "zigzag"
    else:
        layout = sp_config.layout
        attention = rsp_hf.register(topology, layout=layout, backend=sp_config.backend)  # ring_sp: "ring_sp"
    model = AutoModelForCausalLM.from_config(llama_config(args), attn_implementation=attention, dtype=torch.float32)
    if args.checkpoint_activations:
        model.gradient_checkpointing_enable()  # before initialize, which applies ring_sp.offload_checkpoints
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.warmup, args.steps))
    engine, _, _, _ = rsp_ds.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)

    dp_group = None if topology is None else topology.dp_group
    dp_size = dist.get_world_size(dp_group)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    samples_per_step = micro * accum * dp_size
    dataset = training_dataset(args)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=micro, sampler=rsp_ds.sequence_parallel_sampler(dataset, topology, seed=args.seed),
        collate_fn=HFBatches(topology, layout=layout, pack=args.pack_documents), drop_last=True,
    )
    batches = endless_batches(loader, skip=0)
    if dist.get_rank() == 0:
        grid = "1 (sdpa)" if topology is None else f"{topology.ulysses_size}x{topology.ring_size} (ulysses x ring)"
        print(f"Llama {n_params / 1e6:.2f}M parameters; {samples_per_step} x {args.seq_len} tokens per step; "
              f"world {dist.get_world_size()} = DP {dp_size} x SP {grid}, ZeRO-{engine.zero_optimization_stage()}, "
              f"layout {layout}{', packed documents' if args.pack_documents else ''}", file=sys.stderr)
    progress = Progress(args.steps, log_json=args.log_json, enabled=dist.get_rank() == 0)
    def loss_of(shard: dict[str, torch.Tensor]) -> torch.Tensor:
        return rsp_hf.model_loss(engine, shard)  # ring_sp: the exact loss (tiled with --tiled-loss)

    held_out = held_out_dataset(args)
    eval_loader = torch.utils.data.DataLoader(  # ring_sp: each held-out sample once over the replicas, sharded
        held_out, batch_size=micro, sampler=rsp_ds.sequence_parallel_eval_sampler(held_out, topology),
        collate_fn=loader.collate_fn)

    def eval_sum_of(shard: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {k: v for k, v in shard.items() if k != "shift_labels"}
        return token_loss_sum(engine(**inputs).logits, shard["shift_labels"])

    for step in range(1, args.steps + 1):
        progress.step(step, train_step(engine, batches, loss_of, dp_group), tokens=samples_per_step * args.seq_len)
        if args.eval_interval and (step % args.eval_interval == 0 or step == args.steps):
            progress.log(step, eval_loss=eval_loss(engine, eval_loader, eval_sum_of, topology))  # ring_sp: exact
    return engine, topology


if __name__ == "__main__":
    main()
