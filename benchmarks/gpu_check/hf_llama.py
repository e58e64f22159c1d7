"""The Hugging Face model the ``step`` section trains, and the ways to train its step.

transformers' ``LlamaForCausalLM`` from a config (no weights) with a
:class:`ring_sp.plan.step_memory.Transformer` shape (:func:`llama_3_8b`: Llama-3-8B's with a few
layers; :data:`TINY` in the dry run), seeded, built on the device in the model's dtype, every
gradient allocated. Its step, one :class:`Step` per mode (:data:`MODES`):

* ``ring_sp``: ring_sp's defaults, the path its users run: ``register`` on a one-rank
  topology, ``attn_implementation="ring_sp"``, ``enable_long_sequence(model)`` (tiled MLP and
  loss with tiles sized by ring_sp, lean layers, head chunks ``"auto"``), the loss from
  ``model_loss``;
* ``ring_sp+ckpt``: the same with every layer checkpointed (reentrant, on the device);
* ``untiled``: ring_sp's attention and nothing else switched on: transformers' MLP, the full
  logits, ``model_loss`` (the loss from the logits);
* ``ALST``: ALST's modules on one GPU, as issue 38 measured them: sdpa attention (torch's own
  choice of kernel: cuDNN's on an H200), DeepSpeed's ``TiledMLP`` with its recipe's
  ``ceil(n / hidden)`` tiles, every layer checkpointed (reentrant, on the device),
  ``TiledFusedLogitsLoss`` with 1 GiB of fp32 logits per tile (:data:`ALST_LOSS_TILE_BYTES`).

:func:`build_steps` builds the modes from one seed, all training ONE set of parameters and
gradients (:func:`share_parameters`), so every mode's loss at a length must agree. DeepSpeed is
imported only for ``ALST`` (the caller reports the mode skipped with the import error).

The model's pieces (:func:`llama_3_8b`, :data:`TINY`, :func:`llama_config`, :func:`build_model`,
:func:`tokens`, :func:`one_rank_topology`, :class:`Step`) have the names and meaning of the
``memory`` section's model builder on branch ``longest`` (``benchmarks/gpu_check/llama.py``), so
that one module can serve both once the two meet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ring_sp
import ring_sp.integrations.transformers as rsp_hf
from ring_sp.data import IGNORE_INDEX
from ring_sp.plan.step_memory import PRESETS, Transformer

TINY = Transformer(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=300, name="tiny (dry)")
MODES = ("ring_sp", "ring_sp+ckpt", "untiled", "ALST")
ALST_LOSS_TILE_BYTES = 2**30  # ALST sizes its loss tiles to about 1 GiB of fp32 logits
REENTRANT = {"use_reentrant": True}  # ALST's checkpointing, and ring_sp+ckpt's like it


def llama_3_8b(layers: int) -> Transformer:
    """Llama-3-8B's shape (``PRESETS["llama-3-8b"]``) with ``layers`` decoder layers."""
    return dataclasses.replace(PRESETS["llama-3-8b"], layers=layers, name=f"Llama-3-8B-sized, {layers} layers")


def llama_config(shape: Transformer) -> Any:
    """transformers' ``LlamaConfig`` of ``shape``: Llama-3's RoPE (theta 500,000, no scaling),
    positions up to 2^21, no dropout, untied head unless ``shape.tied``."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=1 << 21,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
                       attention_dropout=0.0, tie_word_embeddings=shape.tied)


def build_model(shape: Transformer, device: torch.device, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """``LlamaForCausalLM`` of ``shape`` on ``device`` in ``dtype`` (seed 0), training mode, every
    gradient allocated (zeros, as in any step after the first)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(llama_config(shape), attn_implementation=attn_implementation,
                                              dtype=dtype)
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def tokens(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[1, n]`` random token ids (seeded by ``n``); their next-token labels are the ids shifted."""
    generator = torch.Generator(device=device).manual_seed(n)
    return torch.randint(0, vocab, (1, n), device=device, generator=generator)


def one_rank_topology() -> ring_sp.SequenceParallelTopology:
    """ring_sp's ``1 x 1`` grid over the default group, started as one gloo rank in this process
    if none is (one rank exchanges nothing)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return ring_sp.init_sequence_parallel(1, 1)


@dataclass
class Step:
    """One mode's step on one model: ``loss(ids)`` (``ids`` ``[1, n]``; the mean next-token loss,
    0-d fp32, ready for ``backward()``), inside ``context()``; ``pieces`` names what runs."""

    name: str
    model: nn.Module
    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    pieces: dict[str, str]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        with self.context():
            return self.loss_fn(ids)


def share_parameters(source: nn.Module, target: nn.Module) -> None:
    """Make every parameter of ``target`` the very parameter of ``source`` at the same name (same
    architecture): one set of weights and gradients for both; ``target``'s own are freed."""
    for name, module in target.named_modules():
        mine = source.get_submodule(name)
        for key in module._parameters:
            module._parameters[key] = mine._parameters[key]


def _ring_sp_step(mode: str, shape: Transformer, device: torch.device, dtype: torch.dtype,
                  topology: ring_sp.SequenceParallelTopology) -> Step:
    rsp_hf.register(topology)
    model = build_model(shape, device, dtype, rsp_hf.ATTN_IMPLEMENTATION)
    if mode == "ring_sp+ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=REENTRANT)
    if mode != "untiled":
        rsp_hf.enable_long_sequence(model)  # its defaults
    config = rsp_hf.long_sequence_config(model)
    pieces = {"attention": "ring_sp",
              "checkpointing": "every layer, on the device" if mode == "ring_sp+ckpt" else "off",
              "mlp": "transformers" if config is None else "ring_sp tiled",
              "loss": "transformers (full logits)" if config is None else "ring_sp tiled",
              "lean_layers": str(bool(config and config.lean_layers)),
              "head_chunks": str(config.head_chunks if config else None)}

    def loss(ids: torch.Tensor) -> torch.Tensor:
        return rsp_hf.model_loss(model, rsp_hf.shard_batch({"input_ids": ids, "labels": ids}, topology))

    return Step(mode, model, loss, pieces)


def _alst_step(shape: Transformer, device: torch.device, dtype: torch.dtype) -> Step:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    model = build_model(shape, device, dtype, "sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=REENTRANT)

    def gated(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def tiled_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [b, n, hidden]
        shards = math.ceil(x.shape[1] / x.shape[2])  # its recipe: ceil(seqlen / hidden) tiles
        return TiledMLP.apply(gated, mlp, x, shards, [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight])

    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)

    def loss_sum(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float().flatten(0, -2), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)

    def loss(ids: torch.Tensor) -> torch.Tensor:
        shift = F.pad(ids, (0, 1), value=IGNORE_INDEX)[:, 1:]
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        tiles = max(1, math.ceil(ids.numel() * shape.vocab * 4 / ALST_LOSS_TILE_BYTES))
        total = TiledFusedLogitsLoss.apply(loss_sum, model.lm_head, hidden, shift, None, tiles,
                                           [model.lm_head.weight], "sum")
        return total / (shift != IGNORE_INDEX).sum()

    pieces = {"attention": "sdpa (torch's choice of kernel)", "checkpointing": "every layer, on the device",
              "mlp": "DeepSpeed TiledMLP, ceil(n / hidden) tiles",
              "loss": "DeepSpeed TiledFusedLogitsLoss, 1 GiB fp32 logits per tile"}
    return Step("ALST", model, loss, pieces)


def build_step(mode: str, shape: Transformer, device: torch.device, dtype: torch.dtype,
               topology: ring_sp.SequenceParallelTopology | None = None) -> Step:
    """The :class:`Step` of ``mode`` (one of :data:`MODES`; ring_sp's on ``topology``, default
    :func:`one_rank_topology`); ``ALST`` raises ImportError without DeepSpeed."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if mode == "ALST":
        return _alst_step(shape, device, dtype)
    return _ring_sp_step(mode, shape, device, dtype, topology or one_rank_topology())


def build_steps(modes: Iterable[str], shape: Transformer, device: torch.device, dtype: torch.dtype
                ) -> tuple[dict[str, Step], dict[str, str]]:
    """({mode: Step} all sharing the first one's parameters and gradients, {mode: why it cannot be built})."""
    modes = tuple(modes)
    steps: dict[str, Step] = {}
    missing: dict[str, str] = {}
    topology = one_rank_topology() if any(m != "ALST" for m in modes) else None
    for mode in modes:
        try:
            step = build_step(mode, shape, device, dtype, topology)
        except ImportError as exc:  # DeepSpeed missing: the mode is reported, the others run
            missing[mode] = f"{type(exc).__name__}: {exc}"
            continue
        if steps:
            share_parameters(next(iter(steps.values())).model, step.model)
        steps[mode] = step
    return steps, missing
