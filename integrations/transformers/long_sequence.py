"""The whole training step at long context for Hugging Face models: tiled MLP, tiled loss, offloaded checkpoints.

    model = rsp_hf.enable_long_sequence(model)                 # tiled MLP + tiled logits/loss
    loss = rsp_hf.model_loss(model, shard, topology=topology)  # exact global token mean, no full logits
    loss.backward()

* Tiled MLP: every decoder layer's gated MLP (``down(act(gate(x)) * up(x))``: Llama, Qwen2/3,
  Mistral, Gemma 1/2/3, OLMo 2) runs over tiles of ``tile_tokens`` tokens through
  :func:`ring_sp.tiling.tiled_map`: its ``[tokens, ffn]`` intermediates exist for one tile,
  recomputed in the backward. The weights are read straight from the ``nn.Linear``
  parameters (one read per forward and one per backward, not one per tile).
* Tiled loss: :func:`model_loss` runs the model with the LM head turned into
  :func:`ring_sp.tiling.tiled_linear_cross_entropy` for that call (logits + loss over tiles,
  one ``[tile_tokens, vocab]`` tile at a time; Gemma's final soft-capping included). The
  head's module is called once, so a ZeRO-3 engine gathers its weight once per step; a tied
  embedding works alike. Outside :func:`model_loss` the head returns logits as before.
* Offloaded checkpoints: with activation checkpointing on, the hidden state each checkpointed
  layer keeps lives in host memory (:mod:`ring_sp.offload`).

Anything the tiling does not know (an MLP or head of another structure) is an error naming
the module and the switch to turn off; nothing falls back silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ring_sp import sequence_parallel_loss
from ring_sp.data import IGNORE_INDEX
from ring_sp.offload import OffloadedCheckpoint
from ring_sp.tiling import check_tile_tokens, tiled_linear_cross_entropy, tiled_map

from .loss import loss_reduction

# MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (transformers 5.18)
GATED_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP",
                        "Olmo2MLP"})
# model types whose causal-LM forward is ``logits = lm_head(hidden)`` (+ final_logit_softcapping), nothing else
PLAIN_HEADS = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "olmo2", "gpt_oss"})
_MOE_MLPS = {"GptOssMLP": "gpt-oss's mixture-of-experts block"}


@dataclass(frozen=True)
class LongSequenceConfig:
    """What :func:`enable_long_sequence` switched on (``model.ring_sp_long_sequence``)."""

    tiled_mlp: bool
    tiled_loss: bool
    offload_checkpoints: bool
    tile_tokens: int


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {type(value).__name__} {value!r}")
    return value


def _unwrap(model: Any) -> nn.Module:
    """The ``nn.Module`` of a model or of a DeepSpeed engine (``engine.module``)."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and hasattr(model, "zero_optimization_stage"):  # a DeepSpeed engine
        model = inner
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a Hugging Face causal-LM nn.Module (or a DeepSpeed engine around one); "
                        f"got {type(model).__name__}")
    return model


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at model.base_model.layers, so ring_sp cannot "
                         f"find its MLPs; pass tiled_mlp=False")
    return layers


# ---------------------------------------------------------------- tiled MLP

def _gated_mlp(x: torch.Tensor, act: nn.Module, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
               gate_b: torch.Tensor | None, up_b: torch.Tensor | None, down_b: torch.Tensor | None) -> torch.Tensor:
    """A gated MLP on one tile ``[t, H] -> [t, H]``, as the HF classes in :data:`GATED_MLPS` compute it."""
    return F.linear(act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


class _TiledGatedMLP:
    """Mixed into a gated MLP's class: its forward over token tiles (see :func:`ring_sp.tiling.tiled_map`)."""

    ring_sp_tile_tokens: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        params = [lin.weight for lin in linears] + [lin.bias for lin in linears]
        act = self.act_fn
        return tiled_map(lambda tile, *p: _gated_mlp(tile, act, *p), x, params, tile_tokens=self.ring_sp_tile_tokens)


def _check_mlp(name: str, mlp: nn.Module) -> None:
    """Raise unless ``mlp`` is a gated MLP this module knows (by class and structure)."""
    cls = type(mlp).__name__
    if isinstance(mlp, _TiledGatedMLP):
        return
    if cls in _MOE_MLPS:
        raise ValueError(f"{name} is a {cls} ({_MOE_MLPS[cls]}), which ring_sp does not tile; pass tiled_mlp=False "
                         f"(its experts run untiled)")
    structure = all(type(getattr(mlp, key, None)) is nn.Linear for key in ("gate_proj", "up_proj", "down_proj"))
    if cls not in GATED_MLPS or not structure or not isinstance(getattr(mlp, "act_fn", None), nn.Module):
        raise ValueError(
            f"{name} is a {cls}, which ring_sp's tiled MLP does not know (it tiles {sorted(GATED_MLPS)} with plain "
            f"nn.Linear gate_proj/up_proj/down_proj and an act_fn module); pass tiled_mlp=False"
        )


def _mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for i, layer in enumerate(_decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no .mlp module for ring_sp to tile; "
                             f"pass tiled_mlp=False")
        found.append((f"model.base_model.layers[{i}].mlp", mlp))
    return found


_MIXED: dict[tuple[type, type], type] = {}


def _mix(module: nn.Module, mixin: type) -> None:
    """Give ``module`` the class ``mixin + its class`` (one class per pair, so copies and isinstance work)."""
    cls = type(module)
    if isinstance(module, mixin):
        return
    key = (mixin, cls)
    if key not in _MIXED:
        _MIXED[key] = type(f"RingSPTiled{cls.__name__}", (mixin, cls), {"__module__": __name__})
    module.__class__ = _MIXED[key]


# ---------------------------------------------------------------- tiled head + loss

@dataclass
class _LossRequest:
    """What :func:`model_loss` asks the head for during one forward."""

    labels: torch.Tensor
    softcap: float | None
    tile_tokens: int
    ignore_index: int
    loss_sum: torch.Tensor | None = None
    calls: int = 0


class _TiledHead:
    """Mixed into the LM head (an ``nn.Linear``): inside :func:`model_loss` it returns the tiled loss sum."""

    ring_sp_request: _LossRequest | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self.ring_sp_request
        if request is None:
            return super().forward(hidden)  # logits, as before (generation, evaluation)
        request.calls += 1
        if hidden.shape[:-1] != request.labels.shape:
            raise ValueError(f"the LM head got hidden states {tuple(hidden.shape)} but the shard's shift_labels are "
                             f"{tuple(request.labels.shape)}; do not pass logits_to_keep to model_loss")
        request.loss_sum = tiled_linear_cross_entropy(hidden, self.weight, request.labels, bias=self.bias,
                                                      tile_tokens=request.tile_tokens,
                                                      ignore_index=request.ignore_index, softcap=request.softcap)
        # returned as the head's output so hooks on the head (ZeRO-3's re-gather before its backward) see it
        return request.loss_sum


def _check_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PLAIN_HEADS or not isinstance(head, nn.Linear) or not (
            type(head) is nn.Linear or isinstance(head, _TiledHead)):
        raise ValueError(
            f"ring_sp's tiled loss does not know the LM head of {type(model).__name__} (model_type={model_type!r}, "
            f"head {type(head).__name__}): it tiles a plain nn.Linear head of model types {sorted(PLAIN_HEADS)}; "
            f"pass tiled_loss=False"
        )
    return head


# ---------------------------------------------------------------- the switch

def enable_long_sequence(model: nn.Module, *, tiled_mlp: bool = True, tiled_loss: bool = True,
                         offload_checkpoints: bool = False, tile_tokens: int | None = None) -> nn.Module:
    """Switch a Hugging Face causal LM to the long-sequence step, in place; returns ``model``.

    ``tiled_mlp``: every decoder MLP over tiles of ``tile_tokens`` tokens (exact; one
    tile's ``[tokens, ffn]`` intermediates at a time). ``tiled_loss``: :func:`model_loss`
    computes the LM head and cross entropy over tiles (exact; one ``[tile_tokens, vocab]``
    logits tile at a time). ``offload_checkpoints``: the hidden states activation
    checkpointing keeps per layer live in host memory (needs
    ``model.gradient_checkpointing_enable()`` first). ``tile_tokens``: tokens per tile
    (None: :data:`ring_sp.tiling.DEFAULT_TILE_TOKENS`). Local: no communication, so every
    rank raises the same error before any collective. Calling it again replaces the settings.
    """
    module = _unwrap(model)
    for name, value in (("tiled_mlp", tiled_mlp), ("tiled_loss", tiled_loss),
                        ("offload_checkpoints", offload_checkpoints)):
        _check_flag(name, value)
    tile = check_tile_tokens(tile_tokens)
    mlps = _mlps(module) if tiled_mlp else []
    for name, mlp in mlps:
        _check_mlp(name, mlp)
    head = _check_head(module) if tiled_loss else None
    if offload_checkpoints:
        _check_checkpointing(module)
    # everything checked: now change the modules
    for _, mlp in mlps:
        _mix(mlp, _TiledGatedMLP)
        mlp.ring_sp_tile_tokens = tile
    if not tiled_mlp and hasattr(module, "base_model") and isinstance(getattr(module.base_model, "layers", None), nn.ModuleList):
        for layer in module.base_model.layers:
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, _TiledGatedMLP):
                mlp.__class__ = mlp.__class__.__mro__[2]  # back to the HF class
    if head is not None:
        _mix(head, _TiledHead)
    module.ring_sp_long_sequence = LongSequenceConfig(tiled_mlp, tiled_loss, offload_checkpoints, tile)
    if offload_checkpoints:
        _install_offload(module)
    return model


def long_sequence_config(model: Any) -> LongSequenceConfig | None:
    """The settings :func:`enable_long_sequence` gave ``model`` (or its DeepSpeed engine), or None."""
    return getattr(_unwrap(model), "ring_sp_long_sequence", None)


def _check_checkpointing(module: nn.Module) -> None:
    if not getattr(module, "is_gradient_checkpointing", False):
        raise ValueError(
            "offload_checkpoints=True moves the hidden states activation checkpointing keeps to host memory, but "
            f"{type(module).__name__} has activation checkpointing off; call model.gradient_checkpointing_enable() "
            "(TrainingArguments(gradient_checkpointing=True) with the Trainer) first, or pass offload_checkpoints=False"
        )


def _install_offload(module: nn.Module) -> None:
    """Every checkpointed decoder layer checkpoints through one :class:`ring_sp.offload.OffloadedCheckpoint`.

    Done again before every step: ``gradient_checkpointing_enable()`` (the Trainer calls it
    when training starts) replaces the layers' checkpoint function.
    """
    offloader = getattr(module, "ring_sp_offloader", None)
    if offloader is None:
        offloader = module.ring_sp_offloader = OffloadedCheckpoint()
    for layer in _decoder_layers(module):
        if getattr(layer, "_gradient_checkpointing_func", None) is not offloader:
            layer._gradient_checkpointing_func = offloader


# ---------------------------------------------------------------- the loss

@contextlib.contextmanager
def _head_request(head: nn.Module, request: _LossRequest) -> Iterator[_LossRequest]:
    head.ring_sp_request = request
    try:
        yield request
    finally:
        head.ring_sp_request = None


def shard_loss_sum(model: Any, inputs: Mapping[str, Any], shift_labels: torch.Tensor, *,
                   ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, Any]:
    """(Summed cross entropy of this rank's tokens ``[0-d fp32]``, the model's outputs) for one shard.

    ``inputs``: ``model(**inputs)``'s arguments (the shard without its labels);
    ``shift_labels`` ``[b, n]``. Tiled when :func:`enable_long_sequence` switched the loss on
    (the outputs then carry no logits), else from the logits. ``model`` may be a DeepSpeed
    engine (its forward runs). Checks everything local before the forward.
    """
    module = _unwrap(model)
    config = long_sequence_config(module)
    if config is not None and config.offload_checkpoints:
        _check_checkpointing(module)
        _install_offload(module)
    if config is None or not config.tiled_loss:
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        if logits.shape[:-1] != shift_labels.shape:
            raise ValueError(f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} must agree on "
                             f"[batch, seq]")
        loss_sum = F.cross_entropy(logits.flatten(0, -2).float(), shift_labels.flatten(), ignore_index=ignore_index,
                                   reduction="sum")
        return loss_sum, outputs
    head = _check_head(module)
    softcap = getattr(module.config, "final_logit_softcapping", None)
    request = _LossRequest(shift_labels, softcap, config.tile_tokens, ignore_index)
    with _head_request(head, request):
        outputs = model(**inputs)
    if request.calls != 1 or request.loss_sum is None:
        raise RuntimeError(f"{type(module).__name__}'s forward called its LM head {request.calls} times (expected once); "
                           f"ring_sp's tiled loss cannot apply: pass tiled_loss=False")
    return request.loss_sum, outputs


def model_loss(model: Any, shard: Mapping[str, Any], *, topology: Any = None, engine: Any = None,
               gradients_averaged_over_sp: bool | None = None) -> torch.Tensor:
    """Run ``model`` on ``shard`` (from :func:`shard_batch`) and return the exact global-token-mean loss.

    Tiled when :func:`enable_long_sequence` switched the loss on (the full ``[tokens,
    vocab]`` logits never exist), untiled otherwise; the same value either way, ready for
    ``backward()``. The reduction is :func:`causal_lm_loss`'s: ``engine=`` a DeepSpeed engine
    from ``ring_sp.integrations.deepspeed.initialize`` (its ZeRO stage decides the scaling;
    ``model`` may be the engine itself, which then also serves as ``engine``); ``topology=``
    the grid, with ``gradients_averaged_over_sp`` (default False: gradients SUMMED over the
    SP ranks, as ZeRO 0-2 or a plain all-reduce do; True when they are averaged over DP x SP,
    as DDP does); neither: one rank, the plain mean. Returns a 0-d fp32 tensor, equal on
    every SP rank.
    """
    if not isinstance(shard, Mapping) or not isinstance(shard.get("shift_labels"), torch.Tensor):
        raise ValueError("shard must be a mapping from shard_batch(), with 'shift_labels' [batch, seq]; got "
                         f"{type(shard).__name__} with keys {sorted(shard) if isinstance(shard, Mapping) else None}")
    if engine is None and topology is None and hasattr(model, "zero_optimization_stage"):  # model is an engine
        engine = model
    if topology is not None and engine is None and gradients_averaged_over_sp is None:
        gradients_averaged_over_sp = False
    reduction = loss_reduction(engine=engine, topology=topology,
                               gradients_averaged_over_sp=gradients_averaged_over_sp)  # checked before the forward
    inputs = dict(shard)
    shift_labels = inputs.pop("shift_labels")
    inputs.pop("labels", None)
    inputs.setdefault("use_cache", False)
    loss_sum, _ = shard_loss_sum(model, inputs, shift_labels)
    count = (shift_labels != IGNORE_INDEX).sum()
    if reduction is None:
        return loss_sum / count.clamp(min=1)
    group, averaged = reduction
    return sequence_parallel_loss(loss_sum, count, group=group, gradients_averaged_over_sp=averaged)


__all__ = ["GATED_MLPS", "PLAIN_HEADS", "LongSequenceConfig", "enable_long_sequence", "long_sequence_config",
           "model_loss", "shard_loss_sum"]
