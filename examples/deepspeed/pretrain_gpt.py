"""Pretrain a compact GPT with DeepSpeed and ring_sp sequence parallelism.

nanoGPT-style model (token embedding, pre-norm blocks, GQA attention with RoPE, GELU MLP,
tied head) whose core attention is ``ring_sp.SequenceParallelAttention``: every rank of a
``U x R`` sequence-parallel group holds 1/(U*R) of each sequence (zigzag layout), RoPE
uses the GLOBAL positions of its tokens, and the loss is the exact full-sequence loss.
The ``"ring_sp"`` section of the DeepSpeed config (``ds_config.json``) switches it on.
Data: Python's own stdlib docstrings as bytes (no download). Run it with the launcher,
``examples/deepspeed/pretrain_gpt.sh [--cpu]``, or e.g.::

    DS_ACCELERATOR=cpu deepspeed --quiet --num_gpus 4 examples/deepspeed/pretrain_gpt.py --log-json
    deepspeed --num_gpus 8 examples/deepspeed/pretrain_gpt.py --ulysses-size 2 --ring-size 4 --bf16

``--tiled-mlp --tiled-loss [--tile-tokens N] [--checkpoint-activations --offload-checkpoints]``
(or the same keys in the ``"ring_sp"`` section) run the long-sequence step: MLPs and the
head + loss over token tiles (``ring_sp.tiling``), checkpointed activations in host memory.

``--pack-documents`` trains on whole documents packed into each row instead of windows
of the text stream: attention stays inside each document (``cu_seqlens``), positions
restart per document, and the layout defaults to ``auto`` (``document_balanced``: short
documents whole on one rank, long ones cut, every rank's work equal; ``--layout
document_zigzag`` cuts every document).

Prints a progress bar (loss, tokens/s) on stderr and, with ``--log-json``, one JSON object
per step on stdout. ``--eval-interval K`` adds, every K steps and after the last, the exact
loss on held-out text (``{"step", "eval_loss"}``: the token mean over ``--eval-samples``
samples, each once over the data-parallel replicas, ``ring_sp.integrations.deepspeed.evaluation_loss``).

Checkpoints: ``--save DIR --save-interval K`` saves a DeepSpeed checkpoint every K steps and at
the end; ``DIR/latest`` moves to a tag only once every rank has written it (atomically, so a
rank killed while saving never leaves it naming a half-written tag). ``--load DIR`` resumes
from ``latest``: parameters, optimizer, LR schedule and data position, so the run ends bitwise
as one never stopped; the checkpoint does not depend on ``U x R`` (the attention has no
parameters): resume under another grid of the same world size. On another number of ranks,
convert it first (``python -m deepspeed.checkpoint.ds_to_universal --input_folder DIR/global_stepN
--output_folder DIR/global_stepN_universal --inject_missing_state``) and add ``--load-universal``.
A rank that dies makes the others stop with an error naming it (``--timeout-s`` bounds the
wait on a rank that hangs).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.common

import ring_sp  # noqa: E402
import ring_sp.integrations.deepspeed as rsp_ds  # noqa: E402
from examples.common.data import (VOCAB_SIZE, PackedDocuments, TokenWindows, corpus_documents,  # noqa: E402
                                  corpus_tokens, split_corpus)
from examples.common.faults import LostRanks, fault_from_env  # noqa: E402
from examples.common.progress import Progress  # noqa: E402
from ring_sp.integrations.deepspeed.engine import save_checkpoint  # noqa: E402
from ring_sp.agreement import raise_at_next_agreement  # noqa: E402
from ring_sp.data import shard_positions_error  # noqa: E402
from ring_sp.nodes import describe_links  # noqa: E402
from ring_sp.offload import OffloadedCheckpoint  # noqa: E402
from ring_sp.tiling import check_tile_tokens, tile_linear, tiled_linear_cross_entropy, tiled_map  # noqa: E402
from ring_sp.validation import KV_EXCHANGES  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().with_name("ds_config.json")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # < n_head: grouped-query attention; == n_head: multi-head
    mlp_ratio: int = 4
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def rope_tables(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[b, n, 1, head_dim / 2]`` (fp32) for positions ``[b, n]``: must be GLOBAL positions."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, n, h, d]`` by the angles of ``rope_tables`` (rotate-half form)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """q/k/v projections, RoPE, core attention over the sequence-parallel grid, output projection."""

    def __init__(self, cfg: GPTConfig, core: nn.Module | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.core = core  # None: plain causal attention on a full sequence (no SP)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, n, self.cfg.n_head, self.cfg.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, n, self.cfg.n_kv_head, self.cfg.head_dim), cos, sin)
        v = self.v_proj(x).view(b, n, self.cfg.n_kv_head, self.cfg.head_dim)
        if self.core is not None:
            y = self.core(q, k, v, cu_seqlens)  # [b, n, h, d], exact over the whole sequence
        else:
            y = torch.cat([causal_attention(q[:, doc], k[:, doc], v[:, doc]) for doc in _documents(n, cu_seqlens)], dim=1)
        return self.o_proj(y.reshape(b, n, -1))


def _documents(n: int, cu_seqlens: torch.Tensor | None) -> list[slice]:
    """Each document's slice of an unsharded row (the whole row without ``cu_seqlens``)."""
    bounds = [0, n] if cu_seqlens is None else cu_seqlens.tolist()
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's own causal attention on one unsharded ``[b, n, h, d]`` sequence (no SP)."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, core: nn.Module | None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, core)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model), nn.GELU(), nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        )

        self.tiled_mlp = False  # the MLP runs over token tiles (GPT.enable_long_sequence)
        self.mlp_tile_tokens: int | None = None  # tokens per tile (None: sized by ring_sp from the shard)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin, cu_seqlens)
        h = self.ln_2(x)
        if not self.tiled_mlp:
            return x + self.mlp(h)
        up, down = self.mlp[0], self.mlp[2]
        return x + tiled_map(_gelu_mlp, h, [up.weight, up.bias, down.weight, down.bias], tile_tokens=self.mlp_tile_tokens,
                           tile_width=4 * up.weight.shape[0])  # up, gelu(up) and their two gradients


def _gelu_mlp(x: torch.Tensor, up_w: torch.Tensor, up_b: torch.Tensor, down_w: torch.Tensor,
              down_b: torch.Tensor) -> torch.Tensor:
    """Block.mlp on one tile of tokens, from its weights (what ring_sp.tiling.tiled_map recomputes; its
    linears' weight gradients summed in fp32 by tile_linear on the model's dtype)."""
    return tile_linear(F.gelu(tile_linear(x, up_w, up_b)), down_w, down_b)


class GPT(nn.Module):
    """``forward(input_ids, position_ids) -> logits``: ``[b, n]`` shard -> ``[b, n, vocab]``.

    With ``topology`` the attention is ``SequenceParallelAttention(topology, causal=True)``
    and the inputs are this rank's shard (``position_ids`` global); without, a plain model.
    ``kv_exchange``: how its ring groups exchange KV (the config section's).
    """

    def __init__(self, cfg: GPTConfig, topology: ring_sp.SequenceParallelTopology | None = None,
                 *, layout: str = "zigzag", backend: str = "auto", kv_exchange: str = "ring") -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head or cfg.n_head % cfg.n_kv_head or cfg.head_dim % 2:
            raise ValueError(f"need d_model % n_head == 0, n_head % n_kv_head == 0 and an even head_dim; got {cfg}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, None if topology is None else
                  ring_sp.SequenceParallelAttention(topology, causal=True, layout=layout, backend=backend,
                                                    kv_exchange=kv_exchange))
            for _ in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: scale the residual projections by depth
            for proj in (block.attn.o_proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    checkpointing = False  # activation checkpointing per block (--checkpoint-activations)
    tiled_loss = False  # forward(labels=) returns the tiled loss sum
    loss_tile_tokens: int | None = None  # tokens per tile (None: sized by ring_sp from the shard)
    _checkpoint: Callable[..., torch.Tensor] | None = None

    def enable_long_sequence(self, *, tiled_mlp: bool, tiled_loss: bool, offload_checkpoints: bool,
                             tile_tokens: int | None, lean_layers: bool | None = None,
                             head_chunks: int | str | None = None) -> None:
        """The ``"ring_sp"`` section's long-sequence switches (``rsp_ds.initialize`` calls this).

        ``tiled_mlp``: each block's MLP over tiles of ``tile_tokens`` tokens; ``tiled_loss``:
        ``forward(..., labels=)`` returns the summed loss of the head over tiles, never the
        full logits; ``offload_checkpoints``: the checkpointed block inputs in host memory
        (needs ``checkpointing``). The same ring_sp/ pieces as the Hugging Face integration.
        """
        tile = check_tile_tokens(tile_tokens)
        if lean_layers:  # None (the default) asks for lean pieces where there are some: a GPT has none
            raise ValueError("lean_layers=True: ring_sp's lean layers replace RMSNorms, and this GPT has LayerNorms; "
                             "pass lean_layers=false or leave it unset")
        for block in self.blocks:  # the attention's heads in chunks (ring_sp.SequenceParallelAttention)
            if block.attn.core is not None:
                block.attn.core.head_chunks = head_chunks
        if offload_checkpoints and not self.checkpointing:
            raise ValueError("offload_checkpoints=True needs activation checkpointing: pass --checkpoint-activations, "
                             "or offload_checkpoints=False")
        for block in self.blocks:
            block.tiled_mlp, block.mlp_tile_tokens = tiled_mlp, tile
        self.tiled_loss, self.loss_tile_tokens = tiled_loss, tile
        self._checkpoint = OffloadedCheckpoint() if offload_checkpoints else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
        """``cu_seqlens``: boundaries of packed documents in the global row (attention stays inside).

        Returns the logits ``[b, n, vocab]``; with ``labels`` (tiled loss on) the SUM of the
        shard's token losses (0-d fp32) instead, computed over tiles.
        """
        cos, sin = rope_tables(position_ids, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.wte(input_ids)
        core = self.blocks[0].attn.core  # cu_seqlens must be the documents the global positions restart in:
        error = None if core is None else shard_positions_error(  # else every rank raises at the first attention
            position_ids, layout=core.layout, rank=core.topology.sp_rank, world_size=core.topology.sp_size,
            cu_seqlens=cu_seqlens, where="GPT.forward")
        with raise_at_next_agreement(error):
            for block in self.blocks:
                if self.checkpointing and self.training:
                    run = self._checkpoint or functools.partial(checkpoint, use_reentrant=False)
                    x = run(block, x, cos, sin, cu_seqlens)
                else:
                    x = block(x, cos, sin, cu_seqlens)
        x = self.ln_f(x)
        if labels is None:
            return self.lm_head(x)
        if not self.tiled_loss:
            raise ValueError("forward(labels=) is the tiled loss: switch it on with tiled_loss (ring_sp.tiled_loss)")
        return tiled_linear_cross_entropy(x, self.lm_head.weight, labels, tile_tokens=self.loss_tile_tokens)


def tiled_loss(loss_sum: torch.Tensor, labels: torch.Tensor, engine: Any) -> torch.Tensor:
    """The mean over the full sample(s) from this shard's summed loss (``GPT.forward(labels=)``)."""
    count = (labels != ring_sp.IGNORE_INDEX).sum()
    if getattr(engine, "ring_sp_topology", None) is None:
        return loss_sum / count.clamp(min=1)
    return ring_sp.sequence_parallel_loss(loss_sum, count, group=engine.ring_sp_topology.sp_group,
                                          gradients_averaged_over_sp=rsp_ds.gradients_averaged_over_sp(engine))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, engine: Any) -> torch.Tensor:
    """Mean next-token cross entropy of the full sample(s); labels already shifted.

    Under ring_sp the loss is reduced over the SP group with the gradient convention of
    ``engine``'s ZeRO stage; ``engine=None`` (or no ring_sp section): plain PyTorch.
    """
    if getattr(engine, "ring_sp_topology", None) is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    return rsp_ds.cross_entropy(logits, labels, engine)


def common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of the DeepSpeed examples (also examples/transformers): config overrides, model, schedule, data."""
    p.add_argument("--deepspeed_config", "--deepspeed-config", default=str(DEFAULT_CONFIG), help="DeepSpeed JSON config")
    p.add_argument("--ulysses-size", type=int, help="override ring_sp.ulysses_size of the config")
    p.add_argument("--ring-size", type=int, help="override ring_sp.ring_size of the config")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="override zero_optimization.stage")
    p.add_argument("--layout", choices=list(ring_sp.LAYOUT_CHOICES), help="override ring_sp.layout of the config")
    p.add_argument("--kv-exchange", choices=list(KV_EXCHANGES),
                   help="override ring_sp.kv_exchange of the config (double_ring: a ring spanning nodes runs as an "
                        "inner ring per node, each KV shard crossing to every other node once)")
    p.add_argument("--pack-documents", action="store_true",
                   help="pack whole documents per row, attention inside each (the layout then defaults to auto: "
                        "short documents whole on a rank, long ones cut, chosen per batch)")
    p.add_argument("--micro-batch", type=int, help="override train_micro_batch_size_per_gpu (samples per SP group)")
    p.add_argument("--bf16", action="store_true", help="train in bf16 (GPUs)")
    p.add_argument("--tiled-mlp", action="store_true", help="set ring_sp.tiled_mlp: MLPs over token tiles")
    p.add_argument("--tiled-loss", action="store_true", help="set ring_sp.tiled_loss: head + loss over token tiles")
    p.add_argument("--tile-tokens", type=int, help="set ring_sp.tile_tokens (tokens per tile)")
    p.add_argument("--checkpoint-activations", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--offload-checkpoints", action="store_true",
                   help="set ring_sp.offload_checkpoints: checkpointed activations in host memory (with --checkpoint-activations)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then cosine decay to 10%%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=1_000_000)
    p.add_argument("--log-json", action="store_true", help="one JSON object per step on stdout")
    p.add_argument("--eval-interval", type=int, default=0,
                   help="every K steps (and after the last), the exact loss on held-out text; 0: never")
    p.add_argument("--eval-samples", type=int, default=16, help="held-out samples per evaluation")
    p.add_argument("--load-universal", action="store_true",
                   help='resume from a DeepSpeed universal checkpoint (ds_to_universal; "checkpoint": {"load_universal": '
                        "true}): another number of ranks")
    p.add_argument("--timeout-s", type=float, default=300,
                   help="process-group timeout: how long ranks wait on one that hangs (one that dies frees them at once)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by launchers
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--save", metavar="DIR", help="save a DeepSpeed checkpoint here every --save-interval steps and at the end")
    p.add_argument("--save-interval", type=int, default=0, help="0: only at the end")
    p.add_argument("--load", metavar="DIR", help="resume from the latest complete checkpoint in DIR")
    p.add_argument("--auto-resume", action="store_true",
                   help="resume from --save's latest checkpoint when it has one, else start (torchrun --max-restarts "
                        "restarts every rank with the same command)")
    p.add_argument("--log-memory", action="store_true", help="add every rank's resident memory (MiB) to the JSON lines")
    return p.parse_args(argv)


def ds_config_from_args(args: argparse.Namespace) -> dict:
    """The JSON config with the command line's overrides applied."""
    config = rsp_ds.load_config(args.deepspeed_config)
    section = config.setdefault(rsp_ds.SECTION, {})
    for key in ("ulysses_size", "ring_size", "layout", "kv_exchange"):
        if getattr(args, key) is not None:
            section[key] = getattr(args, key)
    if getattr(args, "pack_documents", False) and args.layout is None:
        section["layout"] = "auto"  # packed documents: their placement chosen per batch
    for key in ("tiled_mlp", "tiled_loss", "offload_checkpoints"):
        if getattr(args, key):
            section[key] = True
    if args.tile_tokens is not None:
        section["tile_tokens"] = args.tile_tokens
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch
        config.pop("train_batch_size", None)  # let DeepSpeed derive it from the data-parallel size
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.load_universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    return config


def endless_batches(loader: torch.utils.data.DataLoader, skip: int) -> Iterator[dict[str, torch.Tensor]]:
    """The loader's batches epoch after epoch (reshuffled per epoch), after skipping ``skip`` of them."""
    for epoch in itertools.count(skip // len(loader)):
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        if epoch == skip // len(loader):
            batches = itertools.islice(batches, skip % len(loader), None)
        yield from batches


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10% at ``total``."""
    progress = min(1.0, step / max(1, total))
    return min(1.0, (step + 1) / max(1, warmup)) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def resident_mib() -> float:
    """This process's resident memory now (Linux ``/proc/self/statm``), in MiB."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def start_rank(args: argparse.Namespace) -> None:
    """What every rank of a DeepSpeed example does first (also used by examples/transformers)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    rsp_ds.skip_cpu_inference_comm_build()  # on CPU: no JIT build of DeepSpeed's C++ shm op
    # DeepSpeed's ZeRO still calls the all-gather torch 2.13 deprecated: one warning per rank, not ours to fix
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated", category=FutureWarning)
    if args.log_json:  # stdout carries only the JSON lines
        for handler in deepspeed.utils.logger.handlers:
            handler.setStream(sys.stderr)
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(args.seed)


def training_dataset(args: argparse.Namespace) -> torch.utils.data.Dataset:
    """Windows of the text stream, or (``--pack-documents``) whole documents packed per row."""
    if args.pack_documents:
        documents = corpus_documents(args.corpus_bytes)
        return PackedDocuments(documents[: int(len(documents) * 0.95)], args.seq_len)  # the rest held out
    return TokenWindows(split_corpus(corpus_tokens(args.corpus_bytes))[0], args.seq_len)


def held_out_dataset(args: argparse.Namespace) -> torch.utils.data.Dataset:
    """The first ``--eval-samples`` held-out samples, in the form of :func:`training_dataset`'s."""
    if args.pack_documents:
        documents = corpus_documents(args.corpus_bytes)
        held_out = PackedDocuments(documents[int(len(documents) * 0.95):], args.seq_len)
    else:
        held_out = TokenWindows(split_corpus(corpus_tokens(args.corpus_bytes))[1], args.seq_len)
    return torch.utils.data.Subset(held_out, range(min(args.eval_samples, len(held_out))))


def eval_loss(engine: Any, loader: torch.utils.data.DataLoader,
              loss_sum_of: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
              topology: ring_sp.SequenceParallelTopology | None) -> float:
    """The exact held-out loss (the token mean over every sample of ``loader``'s set, all ranks)."""
    engine.eval()
    try:
        return rsp_ds.evaluation_loss(
            loader, lambda batch: loss_sum_of({k: v.to(engine.device) for k, v in batch.items()}), topology,
            device=engine.device)[0]
    finally:
        engine.train()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the shard's next-token losses, its valid-token count); labels already shifted."""
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


def train_step(engine: Any, batches: Iterator[dict[str, torch.Tensor]], loss_of: Callable[[dict[str, torch.Tensor]], torch.Tensor],
               dp_group: dist.ProcessGroup | None) -> float:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches; the loss averaged over the DP replicas."""
    accum = engine.gradient_accumulation_steps()
    total = torch.zeros((), device=engine.device)
    for _ in range(accum):
        loss = loss_of({k: v.to(engine.device) for k, v in next(batches).items()})
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    dist.all_reduce(total, group=dp_group)  # equal on the SP ranks of a replica: average the replicas
    return total.item() / (accum * dist.get_world_size(dp_group))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    start_rank(args)
    ds_config = ds_config_from_args(args)
    sp_config = rsp_ds.RingSPConfig.from_ds_config(ds_config)  # None only with "enabled": false
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                               timeout=datetime.timedelta(seconds=args.timeout_s))  # ring_sp's groups inherit it
    topology = rsp_ds.build_topology(ds_config)  # before the model: its attention needs the groups
    layout = "zigzag" if sp_config is None else sp_config.layout
    cfg = GPTConfig(d_model=args.d_model, n_layer=args.layers, n_head=args.heads, n_kv_head=args.kv_heads)
    model = GPT(cfg, topology, layout=layout, backend="auto" if sp_config is None else sp_config.backend,
                kv_exchange="ring" if sp_config is None else sp_config.kv_exchange)
    model.checkpointing = args.checkpoint_activations  # before initialize, which applies the section's tiling
    fault = fault_from_env()  # the tests' injected kill (tests/test_resume.py); None otherwise
    if fault is not None:
        fault.arm(model.blocks[min(1, cfg.n_layer - 1)])
    n_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.warmup, args.steps))
    engine, _, _, _ = rsp_ds.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)

    start_step = 0
    if args.auto_resume and not args.save:
        raise ValueError("--auto-resume resumes from --save's checkpoints: pass --save DIR")
    load = args.load or (args.save if args.auto_resume and (Path(args.save) / "latest").is_file() else None)
    if load:
        path, client_state = engine.load_checkpoint(load)
        if path is None:
            raise FileNotFoundError(f"--load {load}: no DeepSpeed checkpoint found (no 'latest' file)")
        start_step = client_state["step"]

    dp_group = None if topology is None else topology.dp_group
    dp_size = dist.get_world_size(dp_group)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    samples_per_step = micro * accum * dp_size
    dataset = training_dataset(args)
    loader = rsp_ds.sequence_parallel_dataloader(
        dataset, topology, batch_size=micro, layout=layout, seed=args.seed, pack=args.pack_documents
    )
    batches = endless_batches(loader, skip=start_step * accum)  # a resumed run continues the data order
    if dist.get_rank() == 0:
        grid = "1" if topology is None else f"{topology.ulysses_size}x{topology.ring_size}"
        print(f"GPT {n_params / 1e6:.2f}M parameters; {samples_per_step} x {args.seq_len} tokens per step; "
              f"world {dist.get_world_size()} = DP {dp_size} x SP {grid} (ulysses x ring), ZeRO-"
              f"{engine.zero_optimization_stage()}, layout {layout}{', packed documents' if args.pack_documents else ''}"
              f"{'' if topology is None or not topology.node_size else '; ' + describe_links(topology.links, topology.node_size)}",
              file=sys.stderr)
    progress = Progress(args.steps, log_json=args.log_json, enabled=dist.get_rank() == 0, start_step=start_step)
    def loss_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = (batch["input_ids"], batch["position_ids"], batch.get("cu_seqlens"))
        if model.tiled_loss:  # ring_sp.tiled_loss: the full logits never exist
            return tiled_loss(engine(*inputs, labels=batch["labels"]), batch["labels"], engine)
        return loss_fn(engine(*inputs), batch["labels"], engine)

    held_out = held_out_dataset(args)
    eval_loader = torch.utils.data.DataLoader(  # each held-out sample once over the replicas
        held_out, batch_size=micro, sampler=rsp_ds.sequence_parallel_eval_sampler(held_out, topology),
        collate_fn=loader.collate_fn)

    def eval_sum_of(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss_sum(engine(batch["input_ids"], batch["position_ids"], batch.get("cu_seqlens")), batch["labels"])

    hint = (f"resume with --load {args.save}" if args.save else "save checkpoints with --save DIR --save-interval K "
            "to resume after such a loss")
    with LostRanks(hint) as lost:
        for step in range(start_step + 1, args.steps + 1):
            lost.at_step(step)
            if fault is not None:
                fault.at_step(step)
            loss = train_step(engine, batches, loss_of, dp_group)
            extra = {"rss_mib": all_ranks(resident_mib(), engine.device)} if args.log_memory else {}
            progress.step(step, loss, tokens=samples_per_step * args.seq_len, **extra)
            if args.eval_interval and (step % args.eval_interval == 0 or step == args.steps):
                progress.log(step, eval_loss=eval_loss(engine, eval_loader, eval_sum_of, topology))
            if args.save and (step == args.steps or (args.save_interval and step % args.save_interval == 0)):
                save_checkpoint(engine, args.save, tag=f"global_step{step}", client_state={"step": step})


def all_ranks(value: float, device: torch.device) -> list[float]:
    """``value`` of every rank, in rank order (one all-gather over the default group)."""
    gathered = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([value], dtype=torch.float64, device=device))
    return [round(t.item(), 1) for t in gathered]


if __name__ == "__main__":
    main()
