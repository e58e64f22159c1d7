"""The stack the ``memory`` section trains: :mod:`benchmarks.cuda_long_sequence`'s Llama-sized
model, made into the one ``ring_sp.plan.step_memory`` describes, and the same stack under ALST's modules.

* :class:`RingLayer`: ``cuda_long_sequence.Layer`` (fused q/k/v projection, gated MLP, its
  ``tiled_map`` switch) with transformers' Llama RMSNorm (:class:`HFRMSNorm`: fp32 upcast,
  what the model's ``kernels="hf"`` counts) and ring_sp's attention on a one-rank group
  (:func:`ring_sp.ring_attention`: GQA without repeating KV heads, out + lse kept);
* :class:`AlstLayer`: the same layer as DeepSpeed ALST runs it on one GPU: the attention by
  ``sdpa`` with KV heads repeated (``cuda_long_sequence``'s, HF's sdpa path) and the MLP through
  DeepSpeed's ``TiledMLP`` (``ceil(n / hidden)`` tiles, its recipe);
* :class:`StepModel`: ``cuda_long_sequence.Model`` (embedding, layers, final norm, untied head;
  its ``loss`` runs the modes ``tiled`` / ``+ckpt`` / ``+offload``) built from either layer;
  :func:`alst_loss`: ALST's step: every layer checkpointed, the head and loss through
  ``TiledFusedLogitsLoss`` with 1 GiB of fp32 logits per tile.

DeepSpeed is imported only by :func:`alst_modules` (the GPU machine may lack it: the caller
reports the ALST row as skipped with the import error).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ring_sp import ring_attention
from ring_sp.plan.step_memory import Transformer

from ..cuda_long_sequence import Layer, Model

ALST_LOSS_TILE_BYTES = 2**30  # ALST sizes its loss tiles to 1 GiB of fp32 logits


def one_rank_group() -> dist.ProcessGroup:
    """The default group, started as one gloo rank in this process if none is (ring_sp's
    attention runs on a group; one rank exchanges nothing)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


class HFRMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm``: the variance in fp32, the weight applied in the input dtype."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RingLayer(Layer):
    """``cuda_long_sequence.Layer`` with HF norms and ring_sp's attention (one rank)."""

    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int) -> None:
        super().__init__(hidden, ffn, heads, kv_heads)
        self.norm1, self.norm2 = HFRMSNorm(hidden), HFRMSNorm(hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(x).view(n, -1, d).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        out = ring_attention(q[None], k[None], v[None], group=one_rank_group(), causal=True)
        return self.o(out[0].reshape(n, -1))


class AlstLayer(RingLayer):
    """The layer under ALST's modules: sdpa attention (KV heads repeated), DeepSpeed's ``TiledMLP``."""

    attention = Layer.attention
    tiled_mlp: Any = None  # deepspeed's TiledMLP, set by StepModel

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        def gated(self: AlstLayer, t: torch.Tensor) -> torch.Tensor:
            return self.down(F.silu(self.gate(t)) * self.up(t))

        shards = math.ceil(x.shape[0] / x.shape[1])  # its recipe: ceil(seqlen / hidden) tiles
        return self.tiled_mlp.apply(gated, self, x, shards, [self.down.weight, self.gate.weight, self.up.weight])


class StepModel(Model):
    """``cuda_long_sequence.Model`` built from ``layer`` (:class:`RingLayer` or :class:`AlstLayer`)
    with an HF final norm. ``Model.__init__`` is not called: it would build its own layers."""

    def __init__(self, shape: Transformer, layer: type[RingLayer], tiled_mlp: Any = None) -> None:
        nn.Module.__init__(self)
        h = shape.hidden
        self.embed = nn.Embedding(shape.vocab, h)
        self.layers = nn.ModuleList(layer(h, shape.ffn, shape.heads, shape.kv_heads) for _ in range(shape.layers))
        for block in self.layers:
            block.tiled_mlp = tiled_mlp
        self.norm = HFRMSNorm(h)
        self.head = nn.Linear(h, shape.vocab, bias=False)


def build(shape: Transformer, device: torch.device, dtype: torch.dtype, alst: Any = None) -> StepModel:
    """The stack on ``device`` in ``dtype``, every gradient allocated (zeros, as in any step
    after the first); ``alst``: :func:`alst_modules`' result for the ALST stack."""
    torch.manual_seed(0)
    with torch.device(device):
        model = StepModel(shape, AlstLayer if alst else RingLayer, alst[0] if alst else None)
    model = model.to(dtype)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def alst_modules() -> tuple[Any, Any]:
    """(TiledMLP, TiledFusedLogitsLoss) from DeepSpeed; ImportError (naming what is missing) without it."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    return TiledMLP, TiledFusedLogitsLoss


def alst_loss(model: StepModel, ids: torch.Tensor, labels: torch.Tensor, fused_loss: Any) -> torch.Tensor:
    """ALST's step on one GPU: every layer checkpointed, the tiled fused logits loss."""
    x = model.embed(ids)
    for layer in model.layers:
        x = checkpoint(layer, x, use_reentrant=True)
    x = model.norm(x)
    n, vocab = x.shape[0], model.head.weight.shape[0]
    shards = max(1, math.ceil(n * vocab * 4 / ALST_LOSS_TILE_BYTES))

    def loss_sum(head: nn.Linear, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float(), y, reduction="sum", ignore_index=-100)

    valid = (labels != -100).sum()
    total = fused_loss.apply(loss_sum, model.head, x[None], labels[None], None, shards, [model.head.weight], "sum")
    return total / valid


def tokens(n: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence of ``n`` random tokens and its next-token labels (the last ignored)."""
    ids = torch.randint(0, vocab, (n,), device=device, generator=torch.Generator(device=device).manual_seed(n))
    labels = torch.roll(ids, -1)
    labels[-1] = -100
    return ids, labels
