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
* Lean layers: every RMSNorm keeps only its input and an fp32 rstd per row
  (:mod:`.lean_layers`), on by default with tiling.
* Offloaded checkpoints: with activation checkpointing on, the hidden state each checkpointed
  layer keeps lives in host memory (:mod:`ring_sp.offload`), and the attention's re-run in the
  backward computes again rather than reusing the first run's output (``reuse_on_recompute``:
  those outputs would stay on the device, one per layer).

Anything the tiling does not know (an MLP or head of another structure) is an error naming
the module and the switch to turn off; nothing falls back silently. The module classes and
their checks are :mod:`.tiled_modules`; this module is the switch and the loss step.
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
from ring_sp.tiling import check_tile_tokens
from ring_sp.validation import check_head_chunks

from .lean_layers import check_lean_layers, set_lean_layers
from .loss import loss_reduction
# the modules the step rewrites; GATED_MLPS and PLAIN_HEADS are re-exported
from .module_classes import mix, unmix
from .tiled_modules import (GATED_MLPS, PLAIN_HEADS, LossRequest, TiledGatedMLP, TiledHead, check_head, check_mlp,
                            decoder_layers, decoder_mlps)


@dataclass(frozen=True)
class LongSequenceConfig:
    """What :func:`enable_long_sequence` switched on (``model.ring_sp_long_sequence``)."""

    tiled_mlp: bool
    tiled_loss: bool
    offload_checkpoints: bool
    tile_tokens: int | None  # None: every tile sized by the library from the model and the shard
    lean_layers: bool = False
    head_chunks: int | str | None = None


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {type(value).__name__} {value!r}")
    return value


def _unwrap(model: Any) -> nn.Module:
    """The ``nn.Module`` of a model, of a DeepSpeed engine or of ``DistributedDataParallel`` (``.module``)."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and (hasattr(model, "zero_optimization_stage")  # a DeepSpeed engine
                                         or isinstance(model, nn.parallel.DistributedDataParallel)):
        model = inner
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a Hugging Face causal-LM nn.Module (or a DeepSpeed engine around one); "
                        f"got {type(model).__name__}")
    return model


# ---------------------------------------------------------------- the switch

def enable_long_sequence(model: nn.Module, *, tiled_mlp: bool = True, tiled_loss: bool = True,
                         offload_checkpoints: bool = False, tile_tokens: int | None = None,
                         lean_layers: bool | None = None, head_chunks: int | str | None = "auto") -> nn.Module:
    """Switch a Hugging Face causal LM to the long-sequence step, in place; returns ``model``.

    ``tiled_mlp``: every decoder MLP over tiles of ``tile_tokens`` tokens (exact; one
    tile's ``[tokens, ffn]`` intermediates at a time). ``tiled_loss``: :func:`model_loss`
    computes the LM head and cross entropy over tiles (exact; one ``[tile_tokens, vocab]``
    logits tile at a time). ``offload_checkpoints``: the hidden states activation
    checkpointing keeps per layer live in host memory (needs
    ``model.gradient_checkpointing_enable()`` first). ``tile_tokens``: tokens per tile
    (None, the default: sized by the library from the model and the shard, so that one
    tile's intermediates are no larger than the shard's ``[n, hidden]`` hidden state; see
    :func:`ring_sp.shapes.auto_tile_tokens`). ``lean_layers`` (None, the default: on when
    anything is tiled): every RMSNorm keeps only its input and one fp32 rstd per row for the
    backward (:mod:`.lean_layers`; exact). ``head_chunks`` (default ``"auto"``): every ring_sp
    attention layer runs its heads in chunks (:func:`ring_sp.hybrid_attention`; exact, the same
    bytes; None: as :func:`.register` says). Local: no communication, so every
    rank raises the same error before any collective. Calling it again replaces the settings.
    """
    module = _unwrap(model)
    for name, value in (("tiled_mlp", tiled_mlp), ("tiled_loss", tiled_loss),
                        ("offload_checkpoints", offload_checkpoints)):
        _check_flag(name, value)
    tile = check_tile_tokens(tile_tokens)
    if lean_layers is None:
        lean_layers = tiled_mlp or tiled_loss
    _check_flag("lean_layers", lean_layers)
    check_head_chunks(head_chunks)
    mlps = decoder_mlps(module) if tiled_mlp else []
    for name, mlp in mlps:
        check_mlp(name, mlp)
    head = check_head(module) if tiled_loss else None
    norms = check_lean_layers(module) if lean_layers else []
    if offload_checkpoints:
        _check_checkpointing(module)
    # everything checked: now change the modules
    for _, mlp in mlps:
        mix(mlp, TiledGatedMLP, "Tiled")
        mlp.ring_sp_tile_tokens = tile
    for sub in module.modules():  # switched off again: back to the HF classes
        if not tiled_mlp:
            unmix(sub, TiledGatedMLP)
        if not tiled_loss:
            unmix(sub, TiledHead)
    if head is not None:
        mix(head, TiledHead, "Tiled")
    set_lean_layers(module, bool(norms))
    for layer in decoder_layers(module):  # read by the ring_sp attention interface (register())
        attention = getattr(layer, "self_attn", None)
        if isinstance(attention, nn.Module):
            attention.ring_sp_head_chunks = head_chunks
            # a checkpointed re-run that reuses the first run's out + lse (ring_sp.recompute) keeps them on the
            # device for every layer until its backward: with the checkpoints offloaded that would be the step's
            # largest per-layer term, so the attention runs again instead (as every other layer op does)
            attention.ring_sp_reuse_on_recompute = False if offload_checkpoints else None
    module.ring_sp_long_sequence = LongSequenceConfig(tiled_mlp, tiled_loss, offload_checkpoints, tile, lean_layers,
                                                      head_chunks)
    if offload_checkpoints:
        _install_offload(module)
    return model


def long_sequence_config(model: Any) -> LongSequenceConfig | None:
    """The settings :func:`enable_long_sequence` gave ``model`` (or its DeepSpeed engine, its DDP), or None."""
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
    for layer in decoder_layers(module):
        if getattr(layer, "_gradient_checkpointing_func", None) is not offloader:
            layer._gradient_checkpointing_func = offloader


# ---------------------------------------------------------------- the loss

@contextlib.contextmanager
def _head_request(head: nn.Module, request: LossRequest) -> Iterator[LossRequest]:
    head.ring_sp_request = request
    # registered last, so it sees the output other hooks returned: ZeRO-3 wraps it in the
    # function that re-gathers the head's weight before its backward
    handle = head.register_forward_hook(lambda module, args, output: setattr(request, "output", output))
    try:
        yield request
    finally:
        head.ring_sp_request = None
        handle.remove()


def shard_loss_sum(model: Any, inputs: Mapping[str, Any], shift_labels: torch.Tensor, *,
                   ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, Any]:
    """(Summed cross entropy of this rank's tokens ``[0-d fp32]``, the model's outputs) for one shard.

    ``inputs``: ``model(**inputs)``'s arguments (the shard without its labels);
    ``shift_labels`` ``[b, n]``. Tiled when :func:`enable_long_sequence` switched the loss on
    (the outputs then carry no logits), else from the logits. ``model`` may be a DeepSpeed
    engine or ``DistributedDataParallel`` (its forward runs). Checks everything local before the forward.
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
    head = check_head(module)
    softcap = getattr(module.config, "final_logit_softcapping", None)
    request = LossRequest(shift_labels, softcap, config.tile_tokens, ignore_index)
    with _head_request(head, request):
        outputs = model(**inputs)
    if request.calls != 1 or not isinstance(request.output, torch.Tensor) or request.output.dim() != 0:
        raise RuntimeError(f"{type(module).__name__}'s forward called its LM head {request.calls} times (expected once, "
                           f"returning the loss); ring_sp's tiled loss cannot apply: pass tiled_loss=False")
    return request.output, outputs


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
