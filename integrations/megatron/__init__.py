"""ring_sp for Megatron: the argument switch, a ``core_attention`` spec, and glue.

* :func:`add_ring_sp_args` / :func:`validate_ring_sp_args`: Megatron-LM's
  ``extra_args_provider`` and the cross-argument checks (no megatron import).
* :func:`get_gpt_layer_ring_sp_spec`: megatron-core's local GPT layer spec with
  :class:`RingSPCoreAttention` as ``core_attention``.
* ``gpt_layer_ring_sp_spec``: the same spec as an object, built from Megatron-LM's
  arguments on first access, for ``--spec ring_sp.integrations.megatron gpt_layer_ring_sp_spec``.
* :func:`topology_from_parallel_state`: the ring_sp topology over Megatron's CP group.
* :func:`install_layout_rope`: RoPE on CPU ranks and any layout, and on packed (THD)
  documents of any length (the ring_sp layers rotate each token by its document position).
* :func:`ddp_buffers_on_cpu`: running on CPU ranks (gloo).
* :func:`thd_batch_on_this_cp_rank`: a packed (THD) batch for one CP rank without
  TransformerEngine; :class:`RingSPCoreAttention` takes its ``PackedSeqParams``.

Importing this package does not import megatron and has no side effects: the names that
need megatron-core load their module on first use (PEP 562 ``__getattr__``). Of the other
integrations it uses :mod:`ring_sp.integrations.versions` alone.
"""

from __future__ import annotations

import importlib
from typing import Any

from .arguments import add_ring_sp_args, megatron_lm_args, ring_sp_config_from_args, validate_ring_sp_args
from .config import PACKED_LAYOUTS, RingSPConfig, unpacked_layout
from .cpu import ddp_buffers_on_cpu
from .packed import thd_batch_on_this_cp_rank
from .rope import LayoutRotaryEmbedding, install_layout_rope
from .topology import topology_from_parallel_state

# the names whose modules import megatron-core at their top: loaded on first use (an
# optional third-party package, not a circle)
_LAZY = {
    "RingSPCoreAttention": ".core_attention",
    "get_gpt_layer_ring_sp_spec": ".spec",
    "megatron_lm_layer_spec": ".spec",
    "replace_core_attention": ".spec",
}

__all__ = [
    "PACKED_LAYOUTS",
    "LayoutRotaryEmbedding",
    "RingSPConfig",
    "add_ring_sp_args",
    "ddp_buffers_on_cpu",
    "gpt_layer_ring_sp_spec",
    "install_layout_rope",
    "megatron_lm_args",
    "ring_sp_config_from_args",
    "thd_batch_on_this_cp_rank",
    "topology_from_parallel_state",
    "unpacked_layout",
    "validate_ring_sp_args",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name == "gpt_layer_ring_sp_spec":
        # deferred like megatron itself: .spec imports megatron-core at its top (no circle)
        from .spec import megatron_lm_layer_spec

        value = megatron_lm_layer_spec()
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Megatron's spec_utils.import_module (behind Megatron-LM's --spec) reads
    # vars(module)[name] right after the from-import that called us: keep the value there.
    globals()[name] = value
    return value
