"""The Hugging Face modules the long-sequence step rewrites in place: gated MLPs and the LM head.

Which classes ring_sp knows (:data:`GATED_MLPS`, :data:`PLAIN_HEADS`), the structural checks
that refuse any other (an error naming the module and the switch to turn off), and the
mixins that give a known module its tiled forward (switched in by :mod:`.module_classes`): :class:`TiledGatedMLP` (the MLP over
token tiles, :func:`ring_sp.tiling.tiled_map`) and :class:`TiledHead` (inside
:func:`..long_sequence.model_loss`, the LM head returns the tiled loss sum,
:func:`ring_sp.tiling.tiled_linear_cross_entropy`). :func:`mix` / :func:`unmix` switch a
module's class. Imports no transformers (classes are matched by name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ring_sp.shapes import GATED_MLP_TILE_TENSORS
from ring_sp.tiling import rowwise_origin, tile_linear, tiled_linear_cross_entropy, tiled_map

from .module_classes import hf_class

# MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (transformers 5.18)
GATED_MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP",
                        "Olmo2MLP"})
# model types whose causal-LM forward is ``logits = lm_head(hidden)`` (+ final_logit_softcapping), nothing else
PLAIN_HEADS = frozenset({"llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "olmo2", "gpt_oss"})
_MOE_MLPS = {"GptOssMLP": "gpt-oss's mixture-of-experts block"}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at model.base_model.layers, so ring_sp cannot "
                         f"find its MLPs; pass tiled_mlp=False")
    return layers


# ---------------------------------------------------------------- tiled MLP

def _gated_mlp(x: torch.Tensor, act: nn.Module, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
               gate_b: torch.Tensor | None, up_b: torch.Tensor | None, down_b: torch.Tensor | None) -> torch.Tensor:
    """A gated MLP on one tile ``[t, H] -> [t, H]``, as the HF classes in :data:`GATED_MLPS` compute it
    (its weights' gradients summed by :func:`ring_sp.tiling.tile_linear`)."""
    return tile_linear(act(tile_linear(x, gate_w, gate_b)) * tile_linear(x, up_w, up_b), down_w, down_b)


class TiledGatedMLP:
    """Mixed into a gated MLP's class: its forward over token tiles (see :func:`ring_sp.tiling.tiled_map`)."""

    ring_sp_tile_tokens: int | None  # None: sized by the library from the shard and the ffn width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linears = (self.gate_proj, self.up_proj, self.down_proj)
        params = [lin.weight for lin in linears] + [lin.bias for lin in linears]
        act = self.act_fn
        width = GATED_MLP_TILE_TENSORS * self.gate_proj.weight.shape[0]
        origin = rowwise_origin(x)
        if origin is None:
            return tiled_map(lambda tile, *p: _gated_mlp(tile, act, *p), x, params, tile_tokens=self.ring_sp_tile_tokens,
                             tile_width=width)
        # x is a lean norm's output: keep the norm's input (the residual, kept anyway) and
        # normalise each tile again, so the [n, hidden] normalised rows are kept by nobody
        norm, before = origin.fn, list(origin.params())
        k = len(before)
        return tiled_map(lambda tile, *p: _gated_mlp(norm(tile, *p[:k]), act, *p[k:]), origin.source,
                         before + params, tile_tokens=self.ring_sp_tile_tokens, tile_width=width)


def check_mlp(name: str, mlp: nn.Module) -> None:
    """Raise unless ``mlp`` is a gated MLP this module knows (by class and structure)."""
    cls = hf_class(mlp).__name__  # a lean MLP names its HF class
    if isinstance(mlp, TiledGatedMLP):
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


def decoder_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for i, layer in enumerate(decoder_layers(model)):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) has no .mlp module for ring_sp to tile; "
                             f"pass tiled_mlp=False")
        found.append((f"model.base_model.layers[{i}].mlp", mlp))
    return found


# ---------------------------------------------------------------- tiled head + loss

@dataclass
class LossRequest:
    """What :func:`..long_sequence.model_loss` asks the head for during one forward."""

    labels: torch.Tensor
    softcap: float | None
    tile_tokens: int | None  # None: sized by the library (ring_sp.tiling.tile_tokens_for)
    ignore_index: int
    loss_sum: torch.Tensor | None = None
    output: torch.Tensor | None = None  # the head's output after every forward hook (ZeRO-3 wraps it there)
    calls: int = 0


class TiledHead:
    """Mixed into the LM head (an ``nn.Linear``): inside :func:`..long_sequence.model_loss`, the tiled loss sum."""

    ring_sp_request: LossRequest | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self.ring_sp_request
        if request is None:
            if torch.is_grad_enabled() and self.training and hidden.requires_grad:
                # a training forward outside model_loss would build the full logits: say so, never fall back
                raise RuntimeError(
                    "this model has tiled_loss=True (enable_long_sequence / the ring_sp section), so a training forward "
                    "must take its loss from ring_sp.integrations.transformers.model_loss(model, shard, ...), which "
                    "never builds the full logits; or switch it off with tiled_loss=False"
                )
            return super().forward(hidden)  # logits, as before (generation and evaluation run without grad)
        request.calls += 1
        if hidden.shape[:-1] != request.labels.shape:
            raise ValueError(f"the LM head got hidden states {tuple(hidden.shape)} but the shard's shift_labels are "
                             f"{tuple(request.labels.shape)}; do not pass logits_to_keep to model_loss")
        request.loss_sum = tiled_linear_cross_entropy(hidden, self.weight, request.labels, bias=self.bias,
                                                      tile_tokens=request.tile_tokens,
                                                      ignore_index=request.ignore_index, softcap=request.softcap)
        # returned as the head's output so hooks on the head (ZeRO-3's re-gather before its backward) see it
        return request.loss_sum


def check_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PLAIN_HEADS or not isinstance(head, nn.Linear) or not (
            type(head) is nn.Linear or isinstance(head, TiledHead)):
        raise ValueError(
            f"ring_sp's tiled loss does not know the LM head of {type(model).__name__} (model_type={model_type!r}, "
            f"head {type(head).__name__}): it tiles a plain nn.Linear head of model types {sorted(PLAIN_HEADS)}; "
            f"pass tiled_loss=False"
        )
    return head


__all__ = ["GATED_MLPS", "PLAIN_HEADS", "LossRequest", "TiledGatedMLP", "TiledHead", "check_head", "check_mlp",
           "decoder_layers", "decoder_mlps", "mix", "unmix"]
