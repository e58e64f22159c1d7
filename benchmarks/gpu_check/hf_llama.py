"""The Hugging Face model a GPU section trains, and the ways to train its step.

transformers' ``LlamaForCausalLM`` from a config (no weights) with Llama-3-8B's shape
(:data:`LLAMA_3_8B`; a few layers), seeded, built on the device in the model's dtype. Its
step, one :class:`Step` per mode:

* ``ring_sp``: ring_sp's defaults, the path its users run: ``register`` on a one-rank
  topology, ``attn_implementation="ring_sp"``, ``enable_long_sequence(model)`` (tiled MLP and
  loss with tiles sized by ring_sp, lean layers, head chunks ``"auto"``), the loss from
  ``model_loss``;
* ``ring_sp+ckpt``: the same with every layer checkpointed (``gradient_checkpointing_enable()``);
* ``untiled``: ring_sp's attention and nothing else switched on: transformers' MLP, the full
  logits, ``model_loss`` (the loss from the logits);
* ``ALST``: ALST's modules on one GPU, as issue 38 measured them: sdpa attention (torch's own
  choice of kernel: cuDNN's on an H200), DeepSpeed's ``TiledMLP`` with its recipe's
  ``ceil(n / hidden)`` tiles, every layer checkpointed (reentrant, on the device),
  ``TiledFusedLogitsLoss`` with 1 GiB of fp32 logits per tile (:data:`ALST_LOSS_TILE_BYTES`).

:func:`build_steps` builds the modes from one seed, all training ONE set of parameters and
gradients (:func:`share_parameters`), so every mode's loss at a length must agree. DeepSpeed is
imported only for ``ALST`` (the caller reports the mode skipped with the import error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ring_sp
import ring_sp.integrations.transformers as rsp_hf
from ring_sp.data import IGNORE_INDEX

LLAMA_3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 300, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}  # the dry run's
MODES = ("ring_sp", "ring_sp+ckpt", "untiled", "ALST")
ALST_LOSS_TILE_BYTES = 2**30  # ALST sizes its loss tiles to 1 GiB of fp32 logits


def llama_config(shape: Mapping[str, Any], layers: int) -> Any:
    """A ``LlamaConfig`` of ``shape`` (:data:`LLAMA_3_8B`'s keys) with ``layers`` decoder layers, untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=1 << 21, attention_dropout=0.0,
                       tie_word_embeddings=False)


def one_rank_topology() -> ring_sp.SequenceParallelTopology:
    """ring_sp's grid of one rank (U1 x R1) over the default group, started as one gloo rank in
    this process if none is: the attention exchanges nothing."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return ring_sp.init_sequence_parallel(1, 1)


def build_model(config: Any, device: torch.device, dtype: torch.dtype, attention: str) -> nn.Module:
    """``LlamaForCausalLM`` of ``config`` on ``device`` in ``dtype`` (seed 0), training mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype).train()


def share_parameters(source: nn.Module, target: nn.Module) -> None:
    """Make every parameter of ``target`` the very parameter of ``source`` at the same name (same
    architecture): one set of weights and gradients for both; ``target``'s own are freed."""
    for name, module in target.named_modules():
        mine = source.get_submodule(name)
        for key in module._parameters:
            module._parameters[key] = mine._parameters[key]


@dataclass
class Step:
    """One mode's step: ``inputs = prepare(ids)`` outside the timing, then ``loss(inputs)`` runs
    the forward and returns the loss to ``backward()``."""

    mode: str
    model: nn.Module
    prepare: Callable[[torch.Tensor], Any]
    loss: Callable[[Any], torch.Tensor]


def _ring_sp_step(mode: str, config: Any, device: torch.device, dtype: torch.dtype,
                  topology: ring_sp.SequenceParallelTopology) -> Step:
    rsp_hf.register(topology)
    model = build_model(config, device, dtype, "ring_sp")
    if mode == "ring_sp+ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if mode != "untiled":
        rsp_hf.enable_long_sequence(model)  # its defaults

    def prepare(ids: torch.Tensor) -> Any:
        return rsp_hf.shard_batch({"input_ids": ids, "labels": ids}, topology)

    return Step(mode, model, prepare, lambda shard: rsp_hf.model_loss(model, shard))


def _alst_step(config: Any, device: torch.device, dtype: torch.dtype) -> Step:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    model = build_model(config, device, dtype, "sdpa")  # torch's own SDPA choice (cuDNN's on an H200)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})

    def gated(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))

    def tiled_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [b, n, hidden]
        shards = math.ceil(x.shape[1] / x.shape[2])  # its recipe: ceil(seqlen / hidden) tiles
        return TiledMLP.apply(gated, mlp, x, shards, [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight])

    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)

    def prepare(ids: torch.Tensor) -> Any:
        shift = F.pad(ids, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return ids, positions, shift, (shift != IGNORE_INDEX).sum()

    def loss_sum(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(h).float().flatten(0, -2), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)

    def loss(inputs: Any) -> torch.Tensor:
        ids, positions, shift, valid = inputs
        hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        head = model.lm_head
        tiles = max(1, math.ceil(ids.numel() * head.weight.shape[0] * 4 / ALST_LOSS_TILE_BYTES))
        return TiledFusedLogitsLoss.apply(loss_sum, head, hidden, shift, None, tiles, [head.weight], "sum") / valid

    return Step("ALST", model, prepare, loss)


def build_step(mode: str, config: Any, device: torch.device, dtype: torch.dtype,
               topology: ring_sp.SequenceParallelTopology | None = None) -> Step:
    """The :class:`Step` of ``mode`` (one of :data:`MODES`; ring_sp's on ``topology``, default
    :func:`one_rank_topology`); ``ALST`` raises ImportError without DeepSpeed."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if mode == "ALST":
        return _alst_step(config, device, dtype)
    return _ring_sp_step(mode, config, device, dtype, topology or one_rank_topology())


def build_steps(modes: Iterable[str], config: Any, device: torch.device, dtype: torch.dtype
                ) -> tuple[dict[str, Step], dict[str, str]]:
    """({mode: Step} all sharing the first one's parameters, with every gradient allocated
    (zeros, as in any step after the first), {mode: why it cannot be built})."""
    steps: dict[str, Step] = {}
    missing: dict[str, str] = {}
    topology = one_rank_topology() if any(m != "ALST" for m in modes) else None
    for mode in modes:
        try:
            step = build_step(mode, config, device, dtype, topology)
        except ImportError as exc:  # DeepSpeed missing: the mode is reported, the others run
            missing[mode] = f"{type(exc).__name__}: {exc}"
            continue
        if steps:
            share_parameters(next(iter(steps.values())).model, step.model)
        steps[mode] = step
    if steps:
        for p in next(iter(steps.values())).model.parameters():
            p.grad = torch.zeros_like(p)
    return steps, missing


def tokens(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[1, n]`` random token ids, seeded by ``n``."""
    g = torch.Generator(device=device).manual_seed(n)
    return torch.randint(0, vocab, (1, n), device=device, generator=g)
