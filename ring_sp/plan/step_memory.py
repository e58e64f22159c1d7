"""Memory of one whole training step per rank, and the longest sequence that fits (issue 20).

:func:`step_memory` adds up, per rank, for a decoder-only LM (:class:`Transformer`) trained
as :class:`Training` says on ``N`` tokens over a ``U x R`` grid (``n = N / (U R)`` tokens per
rank):

* resident state: parameters, gradients and Adam's two fp32 moments (plus fp32 master
  weights when training in bf16/fp16), each sharded over the ZeRO ranks from its stage
  on (params at 3, gradients at 2, optimizer states at 1), or moved to the host;
  ZeRO-3's gathered layers and the gradient reduce bucket;
* activations kept for backward: every layer's tensors (:func:`layer_kept`, counted from
  the HF modules' saved tensors), or with activation checkpointing only each layer's input
  (on the device, or in host memory with two layers' worth in flight);
* the largest transient, over the step's phases (:class:`StepMemory.phase`): the loss
  (full ``[n, vocab]`` fp32 logits and their gradients, or one tile of them), one layer's
  backward (its recomputed activations when checkpointed, the MLP's ``[n, ffn]`` gradients
  or one tile of them, the attention's buffers from :func:`ring_sp.plan.layer_cost.attention_memory`),
  and the optimizer update.

The counts follow transformers' Llama modules (RMSNorm keeps its fp32 input and normalised
output, RoPE keeps q/k after rotation, SwiGLU its gate, up, activation and product) or,
with ``kernels="fused"``, Liger-style fused RMSNorm / SwiGLU / RoPE. They are checked on CPU
against the measured peak of one step (``tests/test_step_memory.py``, the benchmark's
``length`` section). Not modelled: the CUDA context and NCCL buffers (``reserved_bytes``)
and allocator fragmentation (``fragmentation``, a fraction of the transient memory).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..shapes import GATED_MLP_TILE_TENSORS, LOSS_TILE_TENSORS, auto_tile_tokens
from .layer_cost import attention_memory
from .request import PlanError, dtype_bytes

FP32 = 4
ADAM_STATE_BYTES = 2 * FP32  # exp_avg and exp_avg_sq


@dataclass(frozen=True)
class Transformer:
    """A decoder-only LM: Llama-style attention (``heads`` q / ``kv_heads`` kv of ``head_dim``),
    a gated MLP of ``ffn``, RMSNorms, an embedding and an LM head (``tied``: one matrix)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool = False
    name: str = "custom"

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.ffn + 2 * h  # q k v o, gate up down, two norms

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden

    @property
    def largest_param(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.ffn, self.hidden * self.heads * self.head_dim)

    @staticmethod
    def from_hf_config(config: dict | str | Path, name: str | None = None) -> Transformer:
        """From an HF ``config.json`` (path or dict): Llama / Qwen / Mistral-style keys."""
        if not isinstance(config, dict):
            path = Path(config)
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise PlanError(f"model={str(path)!r}: cannot read an HF config.json ({exc}); pass a preset "
                                f"({', '.join(PRESETS)}) or the path of a model's config.json") from None
            name = name or path.parent.name or path.name
        config = config.get("text_config", config)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                               "vocab_size") if not isinstance(config.get(k), int)]
        if missing:
            raise PlanError(f"the HF config lacks {', '.join(missing)}: only decoder-only LMs with Llama-style keys "
                            f"(a dense gated MLP) can be planned")
        heads = config["num_attention_heads"]
        return Transformer(hidden=config["hidden_size"], ffn=config["intermediate_size"], heads=heads,
                           kv_heads=config.get("num_key_value_heads") or heads,
                           head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                           layers=config["num_hidden_layers"], vocab=config["vocab_size"],
                           tied=bool(config.get("tie_word_embeddings", False)), name=name or config.get("model_type", "hf"))


# The published config.json values (meta-llama/Meta-Llama-3-8B, -70B; Qwen/Qwen3-32B).
PRESETS = {
    "llama-3-8b": Transformer(4096, 14336, 32, 8, 128, 32, 128256, name="Llama-3-8B"),
    "llama-3-70b": Transformer(8192, 28672, 64, 8, 128, 80, 128256, name="Llama-3-70B"),
    "qwen3-32b": Transformer(5120, 25600, 64, 8, 128, 64, 151936, name="Qwen3-32B"),
}


def model_from(spec: str) -> Transformer:
    """A preset name (case-insensitive) or the path of an HF ``config.json`` (or its folder)."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise PlanError(f"model={spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config.json")
    return Transformer.from_hf_config(path)


@dataclass(frozen=True)
class Training:
    """How the step runs. ``zero_stage`` shards over ``zero_ranks`` (None: the SP degree);
    ``master_weights`` (None: when ``dtype`` is not fp32) keeps fp32 copies for Adam;
    ``offload_optimizer``: moments, master weights and fp32 gradients live on the host
    (DeepSpeed ``offload_optimizer``); ``kernels``: "hf" (transformers' modules) or "fused"
    (Liger-style RMSNorm / SwiGLU / RoPE); ``library``: "ring_sp" (its attention,
    :func:`ring_sp.plan.layer_cost.attention_memory`, and tiles, :mod:`ring_sp.tiling`) or "alst"
    (DeepSpeed's Ulysses around transformers' flash-attention 2, :func:`alst_attention_memory`,
    and its ``TiledMLP`` / ``TiledFusedLogitsLoss``); tile sizes in tokens (None: the library default:
    ring_sp's ``tile_tokens``; ALST's MLP ``ceil(n / hidden)`` tiles, its loss 1 GiB of fp32
    logits per tile)."""

    dtype: str = "bf16"
    zero_stage: int = 0
    zero_ranks: int | None = None
    master_weights: bool | None = None
    offload_optimizer: bool = False
    checkpointing: bool = False
    offload_checkpoints: bool = False
    tiled_mlp: bool = False
    tiled_loss: bool = False
    mlp_tile_tokens: int | None = None
    loss_tile_tokens: int | None = None
    kernels: str = "hf"
    library: str = "ring_sp"
    reduce_bucket: int = 500_000_000  # DeepSpeed's reduce_bucket_size (elements), ZeRO >= 1
    reserved_bytes: float = 0.0  # CUDA context, NCCL, ... (not tensors)
    fragmentation: float = 0.0  # share of the transient memory lost to the allocator

    def check(self) -> None:
        dtype_bytes(self.dtype)
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero-stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.kernels not in ("hf", "fused"):
            raise PlanError(f"kernels={self.kernels!r} must be 'hf' or 'fused'")
        if self.library not in ("ring_sp", "alst"):
            raise PlanError(f"library={self.library!r} must be 'ring_sp' or 'alst'")
        if self.offload_checkpoints and not self.checkpointing:
            raise PlanError("offload-checkpoints needs activation checkpointing: add --checkpointing")
        for name in ("mlp_tile_tokens", "loss_tile_tokens", "zero_ranks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PlanError(f"{name.replace('_', '-')}={value!r} must be a positive integer")


ALST_LOSS_TILE_BYTES = 2**30  # ALST sizes its loss tiles to 1 GiB of fp32 logits


def alst(zero_ranks: int | None = None) -> Training:
    """ALST's published recipe (ArcticTraining ``run-h100-sp8-llama-8b.yml``): Ulysses only,
    bf16, ZeRO-3 with the optimizer on the host, activation checkpointing with the
    checkpoints offloaded, TiledMLP (``ceil(n / hidden)`` tiles), a tiled fused logits loss
    and Liger kernels; ``expandable_segments`` against fragmentation."""
    return Training(dtype="bf16", zero_stage=3, zero_ranks=zero_ranks, offload_optimizer=True, checkpointing=True,
                    offload_checkpoints=True, tiled_mlp=True, tiled_loss=True, kernels="fused",
                    library="alst")


def alst_attention_memory(model: Transformer, *, n: int, ulysses: int, dtype: str) -> tuple[float, float]:
    """(kept, backward working) bytes of one layer's attention in ALST on ``n`` tokens per rank:
    ``UlyssesSPAttentionHF`` all-to-alls q, k, v to head layout (KV heads replicated up to one
    per rank when fewer than ``ulysses``) and the output back; flash-attention 2 keeps its
    inputs, output and lse, and in the backward holds an fp32 dq accumulator and, for GQA,
    dk / dv expanded to the q heads; the output is kept again in sequence layout (o_proj's input)."""
    e, _ = dtype_bytes(dtype)
    q = n * model.heads * model.head_dim  # elements of q (or out, dq) on this rank in either layout
    m = max(1, model.kv_heads // ulysses)
    kv = 2 * n * ulysses * m * model.head_dim  # k and v after the all-to-all
    lse = n * model.heads * FP32
    kept = e * (q + kv + q + q) + lse  # q, k, v and out in head layout; out in sequence layout
    expanded = model.heads // ulysses > m  # flash-attention 2 expands dk / dv to the q heads (GQA)
    working = e * q * 2 + FP32 * q + e * q + e * (2 * q if expanded else kv)  # dout x 2 layouts, dq accum, dq, dk/dv
    return kept, working


@dataclass(frozen=True)
class StepMemory:
    """Bytes per rank: resident state, activations kept for backward, and the largest
    transient with the phase it occurs in. ``total`` is the peak."""

    seq_len: int
    tokens_per_rank: int
    params: float
    grads: float
    optimizer: float
    zero_buffers: float
    checkpoints: float
    kept: float  # all layers' activations (none with checkpointing)
    transient: float
    phase: str
    reserved: float
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.zero_buffers + self.checkpoints + self.kept
                + self.transient + self.reserved)

    def breakdown(self) -> dict[str, float]:
        return {"parameters": self.params, "gradients": self.grads, "optimizer states": self.optimizer,
                "ZeRO buffers": self.zero_buffers, "checkpointed activations": self.checkpoints,
                "kept activations": self.kept, f"transient ({self.phase})": self.transient,
                "reserved": self.reserved}


def layer_kept(model: Transformer, training: Training, *, n: int, ulysses: int, ring: int) -> float:
    """Bytes one layer keeps for its backward (no checkpointing), ``n`` tokens on this rank,
    its output (the next layer's input) included."""
    e, _ = dtype_bytes(training.dtype)
    h, q, kv = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim
    # HF RMSNorm keeps its input upcast to fp32 (none in fp32) and the normalised value in fp32
    # then in the model dtype, plus its output: 8 bytes per hidden unit in fp32 and bf16 alike.
    # A fused RMSNorm keeps its output and the fp32 rstd.
    norm = 2 * FP32 * h if training.kernels == "hf" else e * h + FP32
    # q and k after rotation (rotation keeps no input) and v: kept by the attention itself
    # without Ulysses; with it, the all-to-all keeps nothing and its head-layout results count below
    qkv = e * (q + 2 * kv) if ulysses == 1 else 0
    attention = _attention(model, training, n=n, ulysses=ulysses, ring=ring)[0] / n
    residual = e * h  # the residual after attention; the layer's output below
    mlp = 0 if training.tiled_mlp else (4 if training.kernels == "hf" else 3) * e * model.ffn
    return n * (2 * norm + qkv + attention + 2 * residual + mlp)


def _attention(model: Transformer, training: Training, *, n: int, ulysses: int, ring: int) -> tuple[float, float]:
    """(kept, backward working) bytes of one layer's attention on this rank."""
    if training.library == "alst":
        if ring != 1:
            raise PlanError("ALST has no ring: its sequence-parallel degree is the Ulysses size (ring=1)")
        return alst_attention_memory(model, n=n, ulysses=ulysses, dtype=training.dtype)
    mem = attention_memory(ulysses=ulysses, ring=ring, batch=1, local_len=n, heads=model.heads,
                           kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=training.dtype)
    return mem.kept, mem.working


def _mlp_tile(model: Transformer, training: Training, n: int) -> int:
    if not training.tiled_mlp:
        return n
    if training.mlp_tile_tokens is not None:
        return min(n, training.mlp_tile_tokens)
    if training.library == "alst":  # ALST: ceil(n / hidden) tiles
        return math.ceil(n / math.ceil(n / model.hidden))
    width = dtype_bytes(training.dtype)[0]  # ring_sp sizes the tile: its working set no larger than [n, hidden]
    return auto_tile_tokens(n, kept_width=model.hidden, kept_bytes=width, tile_width=GATED_MLP_TILE_TENSORS * model.ffn,
                            tile_bytes=width)


def _loss_tile(model: Transformer, training: Training, n: int) -> int:
    if not training.tiled_loss:
        return n
    if training.loss_tile_tokens is not None:
        return min(n, training.loss_tile_tokens)
    if training.library == "alst":
        return min(n, max(1, ALST_LOSS_TILE_BYTES // (FP32 * model.vocab)))
    # ring_sp sizes the tile: its fp32 logits and their gradient no larger than the [n, hidden] hidden state
    return auto_tile_tokens(n, kept_width=model.hidden, kept_bytes=dtype_bytes(training.dtype)[0],
                            tile_width=LOSS_TILE_TENSORS * model.vocab, tile_bytes=FP32)


def _resident(model: Transformer, training: Training, sp: int) -> tuple[float, float, float, float]:
    """(params, grads, optimizer states, ZeRO buffers) bytes on the device."""
    e, _ = dtype_bytes(training.dtype)
    shards = training.zero_ranks or sp
    stage = training.zero_stage
    p = model.params
    master = training.master_weights if training.master_weights is not None else e != FP32
    params = p * e / (shards if stage >= 3 else 1)
    if training.offload_optimizer:  # gradients are handed to the host bucket by bucket
        grads, states = 0.0, 0.0
    else:
        grads = p * (FP32 if master else e) / (shards if stage >= 2 else 1)
        states = p * (ADAM_STATE_BYTES + (FP32 if master else 0)) / (shards if stage >= 1 else 1)
    buffers = 0.0
    if stage >= 1 and shards > 1:
        buffers += min(training.reduce_bucket, p) * e  # the gradient reduce bucket
    if stage >= 3:  # the layer being computed and the prefetched next one, gathered whole
        buffers += 2 * model.layer_params * e
    return params, grads, states, buffers


def step_memory(model: Transformer, training: Training, *, seq_len: int, ulysses: int = 1, ring: int = 1
                ) -> StepMemory:
    """The peak bytes per rank of one training step of ``seq_len`` tokens (batch 1) on a
    ``ulysses x ring`` grid; :class:`StepMemory` breaks it down."""
    training.check()
    sp = ulysses * ring
    if seq_len < sp:
        raise PlanError(f"seq-len={seq_len} is shorter than the SP degree {sp}")
    e, _ = dtype_bytes(training.dtype)
    n = seq_len // sp
    h, f, v = model.hidden, model.ffn, model.vocab
    params, grads, states, buffers = _resident(model, training, sp)
    one_layer = layer_kept(model, training, n=n, ulysses=ulysses, ring=ring)
    if training.checkpointing:
        ckpt = model.layers * n * e * h
        checkpoints = 2 * n * e * h if training.offload_checkpoints else ckpt  # in use + prefetched
        kept, recompute = 0.0, one_layer
    else:
        checkpoints, kept, recompute = 0.0, model.layers * one_layer, 0.0
    final = n * (2 * FP32 * h if training.kernels == "hf" else e * h)  # the final norm's kept tensors

    # the loss. Untiled, at its backward: log-softmax's fp32 output and two fp32 gradients of
    # [n, vocab] (the logits, and their fp32 copy, are not kept). Tiled, one tile of t tokens:
    # ring_sp holds the tile's fp32 logits and their gradient (softmax - one hot, in place;
    # plus the head's output and its gradient in the model dtype when it is not fp32) and sums
    # the head's gradient into ONE fp32 accumulator (addmm_, no per-tile product); ALST runs cross entropy's own backward per tile (three fp32
    # [t, vocab]) and adds each tile's head gradient to .grad. Both fill an [n, hidden] input
    # gradient; ZeRO-3 gathers the head.
    t = _loss_tile(model, training, n)
    head_grad = v * h * FP32
    if not training.tiled_loss:
        logits = t * v * 3 * FP32
    elif training.library == "ring_sp":
        logits = t * v * (2 * FP32 + (2 * e if e != FP32 else 0)) + head_grad + n * e * h
    else:  # (each tile's head gradient comes after its [t, vocab] buffers are freed)
        logits = t * v * 3 * FP32 + n * e * h
    head = v * h * e if training.zero_stage >= 3 else 0.0
    loss = final + logits + head
    # one layer's backward: the incoming gradient and the residual's, the layer's activations
    # (recomputed when checkpointed) and the larger of the MLP's working set (two [tokens, ffn]
    # gradients; tiled: one tile's activations and gradients, the [n, hidden] input gradient
    # and output the tiles fill) and the attention's backward buffers
    tile = _mlp_tile(model, training, n)
    mlp_acts = (4 if training.kernels == "hf" else 3) * e * f
    mlp = 2 * e * f * tile + ((mlp_acts * tile + 2 * n * e * h) if training.tiled_mlp else 0)
    att = _attention(model, training, n=n, ulysses=ulysses, ring=ring)[1]
    layer = 2 * n * e * h + recompute + max(mlp, att)
    optimizer = 0.0 if training.offload_optimizer else 2 * model.largest_param * FP32  # Adam's sqrt / divide temporaries
    phases = {"loss": loss, "layer backward": layer, "optimizer update": optimizer}
    phase = max(phases, key=phases.get)
    transient = phases[phase] * (1 + training.fragmentation)
    return StepMemory(seq_len, n, params, grads, states, buffers, checkpoints, kept, transient, phase,
                      training.reserved_bytes, phases)


def max_seq_len(model: Transformer, training: Training, memory_bytes: float, *, ulysses: int = 1, ring: int = 1,
                multiple: int | None = None) -> tuple[int, StepMemory | None]:
    """The longest sequence (a multiple of ``multiple``, default ``2 x SP`` for zigzag) whose
    step fits in ``memory_bytes`` per rank, and its breakdown; (0, None) if none does."""
    unit = multiple or 2 * ulysses * ring
    fits = lambda k: step_memory(model, training, seq_len=k * unit, ulysses=ulysses, ring=ring).total <= memory_bytes  # noqa: E731
    if not fits(1):
        return 0, None
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40 // unit:
            raise PlanError("the step's memory does not grow with the sequence: check the configuration")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit, step_memory(model, training, seq_len=lo * unit, ulysses=ulysses, ring=ring)


__all__ = ["PRESETS", "StepMemory", "Training", "Transformer", "alst", "alst_attention_memory", "layer_kept", "max_seq_len", "model_from",
           "step_memory"]
