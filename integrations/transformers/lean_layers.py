"""Lean layers for Hugging Face models: norms, RoPE, MLPs and attention outputs that keep less.

``enable_long_sequence(model, lean_layers=True)`` (on by default with tiling) switches, in
place and reversibly (:func:`set_lean_layers`), every module it knows to a forward built on
:mod:`ring_sp.lean`, exact against the module (the same ops and roundings):

* every RMSNorm of a known class (:data:`LEAN_NORMS`, the q/k norms of Qwen3, Gemma 3 and
  OLMo 2 included): keeps its input and one fp32 rstd per row, not fp32 copies of the rows;
* the attention of Llama, Qwen2/3, Mistral, Gemma 1/2/3 and OLMo 2 (:data:`LEAN_ATTENTIONS`,
  one forward, transformers' own, with small per-family hooks): its RoPE keeps only the
  positions (the model's rotary embedding, :class:`LeanRotary`, tags the cos / sin it makes
  so the backward can make them again), and the attention output is kept once: when the
  attention returns it in strides ``o_proj`` cannot view (ring_sp's one-rank CPU kernel
  returns it head-major), ``o_proj`` keeps that tensor itself
  (:func:`ring_sp.lean.linear_keeping_input`) rather than a second, contiguous copy;
* every untiled gated MLP of :data:`GATED_MLPS`: keeps its input, gate and up (the
  activation and the product are recomputed). A tiled MLP (``tiled_mlp=True``) keeps less
  (its input only) and is left tiled.

Anything else a known model holds is refused with an error naming it and
``lean_layers=False``: an RMSNorm of another class, a known module with another structure
(e.g. LoRA-wrapped MLP projections), a module whose forward was replaced on the instance,
a dynamic RoPE (``dynamic``, ``longrope``: its tables depend on state the backward cannot
see). Attention and MLP classes outside the lists (gpt-oss, Mixtral, Granite, Phi-3: their
norms only) run as transformers' own.

Liger-kernel (``use_liger_kernel`` / ``apply_liger_kernel_to_*``, CUDA): a module Liger
replaced (a ``Liger*`` class, or a forward bound from ``liger_kernel``), and the attention of
a family whose ``apply_rotary_pos_emb`` Liger patched, are left to Liger; ring_sp's lean
pieces go only where transformers' own modules are, so no module is ever both. Liger's
pieces keep about as little (RMSNorm its input and rstd, RoPE its cos / sin, SwiGLU gate and
up). Imports no transformers at module level (classes are matched by name).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ring_sp.lean import gated_mlp, linear_keeping_input, rms_norm, rms_norm_rows, rotary
from ring_sp.tensor_tags import tag, tagged
from ring_sp.tiling import mark_rowwise_origin

from .module_classes import hf_class, mix, unmix
from .tiled_modules import GATED_MLPS, TiledGatedMLP

# RMSNorm classes (transformers 5.18) -> how they apply their weight (ring_sp.lean.NORM_VARIANTS)
LEAN_NORMS = {"LlamaRMSNorm": "llama", "Qwen2RMSNorm": "llama", "Qwen3RMSNorm": "llama", "MistralRMSNorm": "llama",
              "MixtralRMSNorm": "llama", "Qwen2MoeRMSNorm": "llama", "GraniteRMSNorm": "llama", "Phi3RMSNorm": "llama",
              "Olmo2RMSNorm": "olmo", "GptOssRMSNorm": "olmo", "GemmaRMSNorm": "gemma", "Gemma2RMSNorm": "gemma",
              "Gemma3RMSNorm": "gemma"}


@dataclass(frozen=True)
class AttentionFamily:
    """How one family's attention forward differs from Llama's (transformers 5.18)."""

    norms: str | None = None  # q/k norms: "flat" (on [.., h*d]), "heads" (on [b, n, h, d]), "transposed" ([b, h, n, d])
    window: str | None = None  # sliding_window passed from "module" (self.sliding_window) or "config"
    softcap: bool = False  # passes softcap=self.attn_logit_softcapping
    rope_cast: bool = False  # its apply_rotary_pos_emb casts the result back to q's / k's dtype


LEAN_ATTENTIONS = {
    "LlamaAttention": AttentionFamily(), "GemmaAttention": AttentionFamily(),
    "Qwen2Attention": AttentionFamily(window="module"), "MistralAttention": AttentionFamily(window="config"),
    "Qwen3Attention": AttentionFamily(norms="heads", window="module"),
    "Gemma2Attention": AttentionFamily(window="module", softcap=True),
    "Gemma3Attention": AttentionFamily(norms="transposed", window="module"),
    "Olmo2Attention": AttentionFamily(norms="flat", rope_cast=True),
}
LEAN_ROTARIES = frozenset(name.replace("Attention", "RotaryEmbedding") for name in LEAN_ATTENTIONS)


# ---------------------------------------------------------------- the lean forwards

class LeanRMSNorm:
    """Mixed into a known RMSNorm's class: its forward through :func:`ring_sp.lean.rms_norm`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.eps if hasattr(self, "eps") else self.variance_epsilon
        variant = LEAN_NORMS[self.ring_sp_hf_class.__name__]
        out = rms_norm(hidden_states, self.weight, eps, variant)
        if not self.__dict__.get("ring_sp_feeds_mlp", False):
            return out
        # the decoder layer's MLP, if tiled, keeps hidden_states and normalises its tiles again
        return mark_rowwise_origin(out, hidden_states, lambda rows, weight: rms_norm_rows(rows, weight, eps, variant),
                                   lambda: (self.weight,))


@dataclass(frozen=True)
class RopeSource:
    """How a cos / sin pair was made: by ``rotary`` (its transformers class ``cls``) for these positions."""

    rotary: nn.Module
    cls: type
    dtype: torch.dtype
    device: torch.device
    args: tuple

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same cos / sin again (transformers' forward, no grad, on a dtype/device stand-in)."""
        stand_in = torch.empty(0, dtype=self.dtype, device=self.device)
        return self.cls.forward(self.rotary, stand_in, positions, *self.args)


class LeanRotary:
    """Mixed into the model's rotary embedding: tags the cos / sin it returns with their source."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        cls = self.ring_sp_hf_class
        cos, sin = cls.forward(self, x, position_ids, *args)
        source = (RopeSource(self, cls, x.dtype, x.device, args), position_ids)
        # on the tables' storage (ring_sp.tensor_tags): ZeRO-3 hands the attention aliases of them
        return tag(cos, "rope", source), tag(sin, "rope", source)


class LeanAttention:
    """Mixed into a known attention class: transformers' forward with the lean RoPE and output."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        hf = self.ring_sp_hf_class
        family = LEAN_ATTENTIONS[hf.__name__]
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k = self.q_proj(hidden_states), self.k_proj(hidden_states)
        if family.norms == "flat":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(hidden_shape), k.view(hidden_shape)
        if family.norms == "heads":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if family.norms == "transposed":
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        source, positions = _rope_source(self, cos, sin)
        q, k = rotary(q, k, cos, sin, positions, source.cos_sin, cast_to_input=family.rope_cast)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                          sys.modules[hf.__module__].eager_attention_forward)
        extra = {}
        if family.window is not None:
            extra["sliding_window"] = (self.sliding_window if family.window == "module"
                                       else getattr(self.config, "sliding_window", None))
        if family.softcap:
            extra["softcap"] = self.attn_logit_softcapping
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                                 self.attention_dropout, scaling=self.scaling, **extra, **kwargs)
        if out.is_contiguous() or type(self.o_proj) is not nn.Linear:
            # o_proj's input is a view of out (or o_proj is not a plain linear): as transformers does
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
        return linear_keeping_input(out, self.o_proj.weight, self.o_proj.bias), weights


def _rope_source(module: nn.Module, cos: torch.Tensor, sin: torch.Tensor) -> tuple[RopeSource, torch.Tensor]:
    source = tagged(cos, "rope")
    if source is None or tagged(sin, "rope") is not source:
        raise ValueError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) got position_embeddings its model's "
            f"rotary embedding did not make: ring_sp's lean RoPE makes cos/sin again from the positions in the backward, "
            f"so they must come from the model's rotary_emb (run the model, not the layer alone); or pass "
            f"lean_layers=False"
        )
    return source


class LeanGatedMLP:
    """Mixed into an untiled gated MLP: :func:`ring_sp.lean.gated_mlp` (keeps x, gate and up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        return gated_mlp(x, self.act_fn, gate.weight, gate.bias, up.weight, up.bias, down.weight, down.bias)


LEAN_MIXINS = (LeanRMSNorm, LeanRotary, LeanAttention, LeanGatedMLP)


# ---------------------------------------------------------------- checks

def _refuse(name: str, module: nn.Module, why: str) -> ValueError:
    return ValueError(f"{name or 'model'} is a {type(module).__name__}, which ring_sp's lean layers do not know "
                      f"({why}); pass lean_layers=False")


def _liger(module: nn.Module) -> bool:
    """Liger-kernel's module, or one whose forward Liger bound on the instance."""
    bound = module.__dict__.get("forward")
    owner = getattr(getattr(bound, "__func__", bound), "__module__", "") or ""
    return type(module).__name__.startswith("Liger") or type(module).__module__.startswith("liger_kernel") or \
        owner.startswith("liger_kernel")


def _check_forward(name: str, module: nn.Module) -> None:
    bound = module.__dict__.get("forward")
    if bound is not None:
        raise _refuse(name, module, f"its forward was replaced on the instance by "
                                    f"{getattr(bound, '__qualname__', bound)!r}, whose saved tensors ring_sp cannot see")


def _check_norm(name: str, module: nn.Module) -> bool:
    """Whether ``module`` (an RMSNorm by name) is ring_sp's to switch; raises on an unknown one."""
    if _liger(module):
        return False
    cls = hf_class(module).__name__
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    weight = getattr(module, "weight", None)
    if cls not in LEAN_NORMS or not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
        raise _refuse(name, module, f"they replace {sorted(LEAN_NORMS)} with a 1-D weight and an eps")
    _check_forward(name, module)
    return True


def _check_attention(name: str, attn: nn.Module) -> bool:
    """Whether a decoder layer's attention is ring_sp's to switch (False: not a known class, or Liger's RoPE)."""
    hf = hf_class(attn)
    family = LEAN_ATTENTIONS.get(hf.__name__)
    if family is None:
        return False
    apply_rope = getattr(sys.modules.get(hf.__module__), "apply_rotary_pos_emb", None)
    if getattr(apply_rope, "__module__", "").startswith("liger_kernel"):
        return False  # Liger patched this family's RoPE: left to Liger
    needed = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["q_norm", "k_norm"] if family.norms else [])
    missing = [key for key in needed if not isinstance(getattr(attn, key, None), nn.Module)]
    attrs = ["head_dim", "scaling", "attention_dropout", "layer_idx"] + (["sliding_window"] if family.window == "module"
                                                                         else []) + (
        ["attn_logit_softcapping"] if family.softcap else [])
    missing += [key for key in attrs if not hasattr(attn, key)]
    if missing or not hasattr(sys.modules.get(hf.__module__), "eager_attention_forward"):
        raise _refuse(name, attn, f"a {hf.__name__} without {missing or 'its eager_attention_forward'}")
    _check_forward(name, attn)
    return True


def _check_mlp(name: str, mlp: nn.Module) -> bool:
    """Whether a decoder layer's MLP is ring_sp's to make lean (False: tiled, Liger's or not a gated MLP)."""
    if isinstance(mlp, TiledGatedMLP) or _liger(mlp) or hf_class(mlp).__name__ not in GATED_MLPS:
        return False
    plain = all(type(getattr(mlp, key, None)) is nn.Linear for key in ("gate_proj", "up_proj", "down_proj"))
    if not plain or not callable(getattr(mlp, "act_fn", None)):
        raise _refuse(name, mlp, "a gated MLP needs plain nn.Linear gate_proj / up_proj / down_proj and an act_fn")
    _check_forward(name, mlp)
    return True


def _check_rotary(name: str, rope: Any) -> None:
    if not isinstance(rope, nn.Module) or hf_class(rope).__name__ not in LEAN_ROTARIES:
        raise ValueError(f"{name} is {type(rope).__name__}, not a rotary embedding ring_sp's lean RoPE knows "
                         f"({sorted(LEAN_ROTARIES)}); pass lean_layers=False")
    types = rope.rope_type.values() if isinstance(rope.rope_type, dict) else [rope.rope_type]
    dynamic = [t for t in types if "dynamic" in t or t == "longrope"]
    if dynamic:
        raise ValueError(f"{name} uses rope_type {dynamic[0]!r}, whose tables change with the sequence seen: ring_sp's "
                         f"lean RoPE cannot make them again for the backward; pass lean_layers=False")
    _check_forward(name, rope)


def _mlp_input_norm(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's norm whose output is its MLP's input: Gemma 2/3's pre-feedforward
    norm, Llama-style layers' post-attention norm; None for OLMo 2's post-norm layers (their
    MLP takes the residual itself)."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        return layer.pre_feedforward_layernorm
    if hasattr(layer, "post_feedforward_layernorm"):
        return None
    return getattr(layer, "post_attention_layernorm", None)


def _plan(model: nn.Module) -> list[tuple[nn.Module, type]]:
    """Every (module, lean mixin) of ``model`` to switch; raises on anything it does not know."""
    plan = []
    for name, module in model.named_modules():
        if isinstance(module, LeanRMSNorm) or (type(module).__name__.endswith("RMSNorm") and _check_norm(name, module)):
            plan.append((module, LeanRMSNorm))
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    attentions = 0
    for i, layer in enumerate(layers if isinstance(layers, nn.ModuleList) else []):
        prefix = f"model.base_model.layers[{i}]"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if isinstance(attn, nn.Module) and _check_attention(f"{prefix}.self_attn", attn):
            plan.append((attn, LeanAttention))
            attentions += 1
        if isinstance(mlp, nn.Module) and _check_mlp(f"{prefix}.mlp", mlp):
            plan.append((mlp, LeanGatedMLP))
    if attentions:
        rope = getattr(base, "rotary_emb", None)
        _check_rotary("model.base_model.rotary_emb", rope)
        plan.append((rope, LeanRotary))
    if not plan:
        raise ValueError(f"{type(model).__name__} has no module ring_sp's lean layers know (RMSNorms "
                         f"{sorted(LEAN_NORMS)}, attentions {sorted(LEAN_ATTENTIONS)}); pass lean_layers=False")
    return plan


def check_lean_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` :func:`set_lean_layers` would switch (none changed here): its
    RMSNorms, known attentions and their rotary embedding, untiled gated MLPs. Raises a
    ValueError naming the module and ``lean_layers=False`` on one it does not know."""
    return [module for module, _ in _plan(model)]


def set_lean_layers(model: nn.Module, on: bool) -> nn.Module:
    """Switch ``model``'s modules to their lean forwards (``on``, after the checks of
    :func:`check_lean_layers`: nothing changes if they raise) or back to transformers' own
    classes (``on=False``: every lean mixin taken out, tiled MLPs stay tiled). In place;
    returns ``model``. An MLP tiled afterwards runs tiled; call again after switching tiling off."""
    if not isinstance(on, bool):
        raise TypeError(f"on must be True or False; got {type(on).__name__} {on!r}")
    if on:
        for module, mixin in _plan(model):
            mix(module, mixin, "Lean")
        layers = getattr(getattr(model, "base_model", model), "layers", None)
        for layer in layers if isinstance(layers, nn.ModuleList) else []:
            norm = _mlp_input_norm(layer)
            if isinstance(norm, LeanRMSNorm):  # a tiled MLP keeps this norm's input instead of its output
                norm.ring_sp_feeds_mlp = True
    else:
        for module in list(model.modules()):
            for mixin in LEAN_MIXINS:
                unmix(module, mixin)
    return model


__all__ = ["LEAN_ATTENTIONS", "LEAN_NORMS", "LEAN_ROTARIES", "AttentionFamily", "LeanAttention", "LeanGatedMLP",
           "LeanRMSNorm", "LeanRotary", "RopeSource", "check_lean_layers", "hf_class", "set_lean_layers"]
