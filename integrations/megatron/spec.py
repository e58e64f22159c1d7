"""GPT layer specs whose ``core_attention`` is :class:`RingSPCoreAttention`.

``get_gpt_layer_ring_sp_spec`` is megatron-core's local GPT layer spec with one submodule
swapped, so every other choice (norms, MLP, MoE, qk-norm) stays Megatron's.

Megatron-LM's ``--spec MODULE NAME`` does NOT call ``NAME``: its ``gpt_builder`` hands
``vars(MODULE)[NAME]`` to ``GPTModel`` as the layer spec itself (a ``ModuleSpec``, as in
``--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec``). The package
therefore also exposes ``gpt_layer_ring_sp_spec``, a ``ModuleSpec`` built on first access
(:func:`megatron_lm_layer_spec`) from Megatron-LM's parsed arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from ring_sp import SequenceParallelTopology

from .arguments import megatron_lm_args, validate_ring_sp_args
from .config import RingSPConfig
from .core_attention import RingSPCoreAttention


def replace_core_attention(layer_spec: ModuleSpec, core_attention: ModuleSpec | type) -> ModuleSpec:
    """A copy of a self-attention ``TransformerLayer`` spec with another ``core_attention``.

    Works for megatron-core's local and TransformerEngine GPT layer specs alike (only the
    ``self_attention.submodules.core_attention`` field changes).
    """
    attention = layer_spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=core_attention)
    attention = dataclasses.replace(attention, submodules=submodules)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention))


def get_gpt_layer_ring_sp_spec(
    ring_sp_config: Optional[RingSPConfig] = None,
    topology: Optional[SequenceParallelTopology] = None,
    **local_spec_kwargs: Any,
) -> ModuleSpec:
    """megatron-core's local GPT ``TransformerLayer`` spec with ring_sp core attention.

    ``local_spec_kwargs`` go to ``get_gpt_layer_local_spec`` (e.g.
    ``normalization="RMSNorm"``, ``qk_layernorm=True``, ``num_experts=8``,
    ``multi_latent_attention=True``: MLA's value head size differs from q/k's, which ring_sp
    attends with as it is).
    ``ring_sp_config``/``topology`` are handed to every :class:`RingSPCoreAttention`
    (None: Megatron-LM's ``--ring-sp-*`` arguments or a pure ring, and a topology over
    Megatron's context-parallel group).
    """
    params = {"ring_sp_config": ring_sp_config, "topology": topology}
    core_attention = ModuleSpec(module=RingSPCoreAttention, params={k: v for k, v in params.items() if v is not None})
    return replace_core_attention(get_gpt_layer_local_spec(**local_spec_kwargs), core_attention)


def megatron_lm_layer_spec() -> ModuleSpec:
    """The layer spec for Megatron-LM's ``--spec ring_sp.integrations.megatron gpt_layer_ring_sp_spec``.

    With ``--ring-sp`` it is :func:`get_gpt_layer_ring_sp_spec` (its arguments validated
    first, on every rank); with ``--no-ring-sp`` Megatron-core's own local spec, so the
    switch alone turns ring_sp on and off. Model options are taken from the arguments as
    Megatron-LM's ``gpt_builder`` does for its local spec.
    """
    args = megatron_lm_args()
    if args is None:
        raise RuntimeError(
            "gpt_layer_ring_sp_spec reads Megatron-LM's parsed arguments; outside Megatron-LM call "
            "ring_sp.integrations.megatron.get_gpt_layer_ring_sp_spec(...) instead"
        )
    local = {
        "num_experts": getattr(args, "num_experts", None),
        "moe_grouped_gemm": getattr(args, "moe_grouped_gemm", False),
        "qk_layernorm": getattr(args, "qk_layernorm", False),
        "normalization": getattr(args, "normalization", None),
        "qk_l2_norm": getattr(args, "qk_l2_norm", False),
        "multi_latent_attention": getattr(args, "multi_latent_attention", False),
    }
    config = validate_ring_sp_args(args)
    if config is None:
        return get_gpt_layer_local_spec(**local)
    return get_gpt_layer_ring_sp_spec(config, **local)
