"""Pretrain a small GPT with megatron-core and ring_sp context parallelism.

Launch with ``examples/megatron/pretrain_gpt.sh`` (torchrun; ``--cpu`` for 4 gloo CPU
ranks). The world is ``TP x CP x DP`` in Megatron's order; ring_sp splits the CP group
into ``--ring-sp-ulysses-size`` x ring. Data: the Python standard library's docstrings as
byte tokens (``examples/common/data.py``); every rank draws the same batch for a step, DP
ranks take their slice and CP ranks their shard (Megatron's ``get_batch_on_this_cp_rank``
for zigzag). ``--pack-documents`` trains on whole docstrings instead: each micro-batch is one
packed THD row (Megatron's packed sequences, ``PackedSeqParams``), documents of any length
UNPADDED and placed per batch (``--ring-sp-layout auto``, its default then: short documents
whole on a rank, long ones cut; ``document_zigzag`` cuts every one, as Megatron does);
ring_sp's core attention applies RoPE at each token's position inside its document.

Megatron pieces used: ``parallel_state``, ``GPTModel`` with the ring_sp layer spec, DDP
(gradients averaged over DP x CP), and on GPUs ``get_megatron_optimizer``. On CPU,
megatron-core's optimizers and RoPE need CUDA: the script steps ``torch.optim.AdamW`` on
DDP's reduced gradients and slices RoPE with ring_sp (see
``ring_sp/integrations/megatron/cpu.py``). Checkpoints are ``torch.save`` files of the
model and optimizer state (one per TP rank), loadable at any CP size or grid.

With ``--log-json``, stdout carries exactly one JSON object per step and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, for common/

from common.data import (  # noqa: E402
    VOCAB_SIZE, PackedDocuments, TokenBatches, corpus_documents, corpus_tokens, split_corpus,
)
from common.progress import Progress  # noqa: E402

import ring_sp  # noqa: E402
from ring_sp.integrations import megatron as ring_sp_megatron  # noqa: E402

CHECKPOINT_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                   "tensor_model_parallel_size", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = parser.add_argument_group("model (Megatron-LM names)")
    model.add_argument("--num-layers", type=int, default=4)
    model.add_argument("--hidden-size", type=int, default=128)
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--num-query-groups", type=int, default=None, help="GQA key/value heads (default: MHA)")
    model.add_argument("--ffn-hidden-size", type=int, default=352, help="SwiGLU inner size")
    model.add_argument("--seq-length", type=int, default=512)
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-size", type=int, default=1)
    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=4, help="samples per data-parallel rank per step")
    train.add_argument("--train-iters", type=int, default=60)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--min-lr", type=float, default=2e-4)
    train.add_argument("--lr-warmup-iters", type=int, default=6)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--corpus-bytes", type=int, default=4_000_000, help="size of the docstring corpus to load")
    train.add_argument("--pack-documents", action="store_true",
                       help="one packed THD row of whole documents per micro-batch, unpadded, attention and RoPE "
                            "positions inside each (--ring-sp-layout defaults to auto then)")
    train.add_argument("--bf16", action="store_true", help="bf16 model with fp32 main params (GPU)")
    train.add_argument("--cpu", action="store_true", help="run on CPU ranks over gloo even if CUDA is present")
    io = parser.add_argument_group("checkpoints and logging")
    io.add_argument("--save", type=Path, default=None, help="checkpoint directory (written at the end)")
    io.add_argument("--save-interval", type=int, default=0, help="also save every N steps")
    io.add_argument("--load", type=Path, default=None, help="resume from this checkpoint directory")
    io.add_argument("--ckpt-step", type=int, default=None, help="step to load (default: the latest)")
    io.add_argument("--log-json", action="store_true", help="one JSON object per step on stdout")
    ring_sp_megatron.add_ring_sp_args(parser)
    parser.set_defaults(ring_sp_layout=None)  # zigzag, or auto (per batch) with --pack-documents
    args = parser.parse_args(argv)
    if args.ring_sp_layout is None:
        args.ring_sp_layout = "auto" if args.pack_documents else "zigzag"
    args.attention_dropout = 0.0
    args.position_embedding_type = "rope"
    return args


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Every rank checks before any collective; messages name the argument."""
    model_parallel = args.tensor_model_parallel_size * args.context_parallel_size
    if world_size % model_parallel != 0:
        raise ValueError(
            f"the world size {world_size} must be divisible by --tensor-model-parallel-size x "
            f"--context-parallel-size = {model_parallel}"
        )
    on_cpu = args.cpu or not torch.cuda.is_available()
    if not args.ring_sp and (args.context_parallel_size > 1 or on_cpu):
        raise ValueError(
            "--no-ring-sp uses megatron-core's DotProductAttention, which has no context parallelism "
            "(needs --context-parallel-size 1) and needs CUDA (its dropout RNG tracker); use --ring-sp"
        )
    if args.seq_length % (2 * args.context_parallel_size) != 0:
        raise ValueError(f"--seq-length={args.seq_length} must be a multiple of 2 x --context-parallel-size")
    if args.pack_documents and not args.ring_sp:
        raise ValueError("--pack-documents needs --ring-sp: megatron-core's local DotProductAttention refuses "
                         "packed sequences (packed_seq_params)")
    if args.pack_documents and args.context_parallel_size > 1 and args.ring_sp_layout not in ring_sp_megatron.PACKED_LAYOUTS:
        raise ValueError(
            f"--pack-documents at --context-parallel-size {args.context_parallel_size} needs --ring-sp-layout "
            f"auto (the default), document_balanced or document_zigzag (packed THD batches are sharded per "
            f"document); got {args.ring_sp_layout}"
        )
    if args.bf16 and on_cpu:
        raise ValueError("--bf16 needs CUDA: megatron-core's mixed-precision optimizer creates CUDA tensors")
    if args.ckpt_step is not None and args.load is None:
        raise ValueError("--ckpt-step needs --load")
    # install_layout_rope makes RoPE follow any --ring-sp-layout
    ring_sp_megatron.validate_ring_sp_args(args, rope_follows_layout=True)


def init_distributed(args: argparse.Namespace) -> torch.device:
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # torchrun's ranks share the cores
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    return device


def build_model(args: argparse.Namespace, device: torch.device):
    """GPTModel (ring_sp spec when --ring-sp) wrapped in Megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size, bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        # the same full weights whatever the TP size (each rank keeps its slice), CPU or GPU
        use_cpu_initialization=True,
        # fused kernels are CUDA-only extensions
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    ring_sp_config = ring_sp_megatron.validate_ring_sp_args(args, rope_follows_layout=True)
    if ring_sp_config is not None:
        spec = ring_sp_megatron.get_gpt_layer_ring_sp_spec(ring_sp_config, normalization="RMSNorm")
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=VOCAB_SIZE, max_sequence_length=args.seq_length,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    # also with --pack-documents: the ring_sp layers then rotate THD tokens by their position
    # inside their document, which needs no per-document padding (megatron-core's THD RoPE does)
    if device.type == "cpu" or args.pack_documents or ring_sp_megatron.unpacked_layout(args.ring_sp_layout) != "zigzag":
        ring_sp_megatron.install_layout_rope(model, layout=args.ring_sp_layout, device=device)
    model.to(device)
    if args.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    with ring_sp_megatron.ddp_buffers_on_cpu() if device.type == "cpu" else contextlib.nullcontext():
        return DistributedDataParallel(config, ddp_config, model)


def build_optimizer(args: argparse.Namespace, model, device: torch.device):
    """Megatron's optimizer on GPUs; on CPU (where it creates CUDA tensors) torch's AdamW."""
    if device.type == "cuda":
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                 clip_grad=args.clip_grad, bf16=args.bf16,
                                 params_dtype=torch.bfloat16 if args.bf16 else torch.float32)
        return get_megatron_optimizer(config, [model])
    decay = [p for p in model.parameters() if p.dim() > 1]  # Megatron's rule: no decay on norms and biases
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


def cpu_step(optimizer: torch.optim.Optimizer, model, clip_grad: float) -> None:
    """What Megatron's FP32 optimizer does: step on DDP's reduced grads, clipped by the
    global norm (each tensor-parallel weight counted once, summed over the TP group)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = list(model.parameters())
    squares = torch.zeros((), dtype=torch.float32)
    for p in params:
        p.grad = p.main_grad
        if param_is_not_tensor_parallel_duplicate(p):
            squares += p.main_grad.float().pow(2).sum()
    dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
    if clip_grad > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip_grad, squares.sqrt())
    optimizer.step()


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up, then cosine decay to ``--min-lr`` (``step`` counts from 1)."""
    if step <= args.lr_warmup_iters:
        return args.lr * step / args.lr_warmup_iters
    progress = (step - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def shard_batch(args: argparse.Namespace, window: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    """This CP rank's shard of a ``[b, seq+1]`` token window, in Megatron's batch keys."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    b = window.shape[0]
    batch = {"tokens": window[:, :-1], "labels": window[:, 1:], "loss_mask": torch.ones(b, args.seq_length),
             "position_ids": torch.arange(args.seq_length).expand(b, -1)}
    layout = ring_sp_megatron.unpacked_layout(args.ring_sp_layout)
    if layout == "zigzag":
        batch = get_batch_on_this_cp_rank(batch)  # Megatron's own sharding: ring_sp's zigzag
    else:
        cp = parallel_state.get_context_parallel_world_size()
        rank = parallel_state.get_context_parallel_rank()  # == topology.sp_rank (ulysses_inner)
        batch = {k: ring_sp.shard_sequence(v, rank=rank, world_size=cp, layout=layout) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def packed_windows(args: argparse.Namespace, num_windows: int, step: int, dp_rank: int, dp_size: int) -> list[int]:
    """This DP rank's ``--micro-batch-size`` window indices for ``step``: random, the same on
    every rank for a given (seed, step), so CP ranks shard the same row."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    picks = torch.randint(0, num_windows, (args.micro_batch_size * dp_size,), generator=g)
    return picks[dp_rank * args.micro_batch_size:(dp_rank + 1) * args.micro_batch_size].tolist()


def packed_batch(documents: PackedDocuments, indices: list[int], device: torch.device,
                 layout: str = "auto") -> dict[str, object]:
    """This CP rank's THD micro-batch: the windows ``indices`` end to end as ONE packed row
    (Megatron's THD batches have b = 1), documents unpadded and sharded per document; the
    ``PackedSeqParams`` under ``packed_seq_params`` and the row's padding tokens (only its end,
    to a multiple of CP; none when --seq-length is a multiple of CP) under ``padding``."""
    windows = [documents[i] for i in indices]
    cu_seqlens = [0]
    for window in windows:
        cu_seqlens += [cu_seqlens[-1] + int(end) for end in window["cu_seqlens"][1:]]
    tokens = torch.cat([window["input_ids"] for window in windows])[None].to(device)
    batch, packed = ring_sp_megatron.thd_batch_on_this_cp_rank(tokens, cu_seqlens, per_document_padding=False,
                                                               layout=layout)
    padding = int(packed.cu_seqlens_q[-1]) - tokens.shape[1]
    return {**batch, "packed_seq_params": packed, "padding": padding}


def train_step(args: argparse.Namespace, model, optimizer, batch: dict[str, object], step: int,
               device: torch.device) -> float:
    """One forward/backward/update; returns the loss averaged over DP (the same on every rank)."""
    from megatron.core import parallel_state

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch.get("packed_seq_params"))  # [b, s_local]
    mask = batch["loss_mask"]
    # Global token mean over the CP group; its backward is scaled by CP to cancel DDP's
    # average over CP (the same correction as Megatron-LM's loss * context_parallel_size).
    loss = ring_sp.sequence_parallel_loss((losses.float() * mask).sum(), mask.sum(),
                                          group=parallel_state.get_context_parallel_group(),
                                          gradients_averaged_over_sp=True)  # DDP averages over DP x CP
    loss.backward()
    model.finish_grad_sync()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(args, step)
    if device.type == "cuda":
        optimizer.step()
    else:
        cpu_step(optimizer, model, args.clip_grad)
    reported = loss.detach().reshape(1).to(device)
    dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    return reported.item() / parallel_state.get_data_parallel_world_size()


def gpt_model(model) -> torch.nn.Module:
    """The GPTModel inside DDP (and Float16Module with --bf16): checkpoints hold its state."""
    from megatron.core.transformer.module import Float16Module

    inner = model.module
    return inner.module if isinstance(inner, Float16Module) else inner


def checkpoint_file(root: Path, step: int, tp_rank: int) -> Path:
    return root / f"iter_{step:07d}" / f"model_tp{tp_rank:02d}.pt"


def save_checkpoint(args: argparse.Namespace, root: Path, step: int, model, optimizer) -> None:
    """One file per TP rank, written by DP rank 0 / CP rank 0 (the others hold copies)."""
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_context_parallel_rank() == 0:
        path = checkpoint_file(root, step, parallel_state.get_tensor_model_parallel_rank())
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": gpt_model(model).state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "args": {k: getattr(args, k) for k in CHECKPOINT_KEYS}}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    print(f"saved checkpoint {root} step {step}", file=sys.stderr)


def load_checkpoint(args: argparse.Namespace, model, optimizer) -> int:
    """Load ``--load`` (step ``--ckpt-step`` or the latest); returns the step it reached."""
    from megatron.core import parallel_state

    step = args.ckpt_step
    if step is None:
        step = int((args.load / "latest_checkpointed_iteration.txt").read_text())
    path = checkpoint_file(args.load, step, parallel_state.get_tensor_model_parallel_rank())
    state = torch.load(path, map_location="cpu", weights_only=False)
    for key, saved in state["args"].items():
        if getattr(args, key) != saved:
            raise ValueError(f"--{key.replace('_', '-')}={getattr(args, key)} differs from the checkpoint's {saved}")
    gpt_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    print(f"loaded checkpoint {args.load} step {step}", file=sys.stderr)
    return state["step"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    device = init_distributed(args)
    check_args(args, dist.get_world_size())

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    u = args.ring_sp_ulysses_size
    # Megatron's hierarchical CP groups [U, R] are ring_sp's Ulysses and ring groups, reused
    # when present (megatron-core builds them with einops).
    grid = None
    if args.ring_sp and 1 < u < args.context_parallel_size and importlib.util.find_spec("einops") is not None:
        grid = [u, args.context_parallel_size // u]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size, context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=grid,
        create_gloo_process_groups=device.type == "cuda",  # only Megatron's GPU optimizer uses them
    )
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(args.seed)
    model = build_model(args, device)
    optimizer = build_optimizer(args, model, device)
    start = load_checkpoint(args, model, optimizer) if args.load is not None else 0

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if args.pack_documents:
        documents = corpus_documents(args.corpus_bytes)
        windows = PackedDocuments(documents[: int(len(documents) * 0.95)], args.seq_length)  # the rest held out
    else:
        train, _ = split_corpus(corpus_tokens(args.corpus_bytes))
        batches = TokenBatches(train, args.seq_length + 1, args.micro_batch_size, seed=args.seed)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters()) * args.tensor_model_parallel_size
        grid_text = (f"ring_sp {u} x {args.context_parallel_size // u} (ulysses x ring), "
                     f"layout {args.ring_sp_layout}" if args.ring_sp else "no ring_sp")
        grid_text += ", packed documents (THD)" if args.pack_documents else ""
        print(f"GPT ~{params / 1e6:.2f}M parameters, {dist.get_world_size()} {device.type} ranks = "
              f"TP {args.tensor_model_parallel_size} x CP {args.context_parallel_size} x DP {dp_size}, "
              f"{grid_text}, seq {args.seq_length}", file=sys.stderr)
    progress = Progress(args.train_iters, log_json=args.log_json, enabled=dist.get_rank() == 0, start_step=start)
    tokens_per_step = args.micro_batch_size * dp_size * args.seq_length
    for step in range(start + 1, args.train_iters + 1):
        if args.pack_documents:
            batch = packed_batch(windows, packed_windows(args, len(windows), step, dp_rank, dp_size), device,
                                 args.ring_sp_layout)
        else:
            batch = shard_batch(args, batches.batch(step, dp_rank=dp_rank, dp_size=dp_size), device)
        loss = train_step(args, model, optimizer, batch, step, device)
        extra = {"padding": batch["padding"]} if args.pack_documents else {}
        progress.step(step, loss, tokens_per_step, lr=round(learning_rate(args, step), 8), **extra)
        if args.save is not None and args.save_interval and step % args.save_interval == 0:
            save_checkpoint(args, args.save, step, model, optimizer)
    if args.save is not None and not (args.save_interval and args.train_iters % args.save_interval == 0):
        save_checkpoint(args, args.save, args.train_iters, model, optimizer)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"done in {time.perf_counter() - started:.0f} s", file=sys.stderr)
