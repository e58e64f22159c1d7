"""``attn_implementation="ring_sp"``: ring_sp's grid attention inside any transformers model.

:func:`register` adds two entries under the name ``"ring_sp"`` to transformers' global
registries:

* ``AttentionInterface``: every attention layer of a model with that implementation calls
  :class:`RingSPAttention` with ``query [b, h, n, d]``, ``key``/``value [b, h_kv, n, d]``
  (this rank's shard, RoPE already applied with the GLOBAL positions) and returns
  ``[b, n, h, d]``, the exact attention over the whole sequence of the SP group;
* ``AttentionMaskInterface``: the mask hook, which returns None, so transformers never
  builds an ``N x N`` (or even ``n x n``) mask; it also runs the model-wide checks once per
  forward, before the first layer and so before any collective.

transformers' registries are global, so the registration is too: one topology (and one
layout/backend) serves every model using ``"ring_sp"``; registering again replaces it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp import SequenceParallelTopology, hybrid_attention
from ring_sp.layouts import Boundaries, as_boundaries, check_grid_layout
from ring_sp.integrations.versions import require_supported
from ring_sp.validation import check_kv_exchange, check_options

from .features import check_mask_call, check_model_config, check_positions, model_name, ring_sp_call_options

ATTN_IMPLEMENTATION = "ring_sp"


@dataclass(frozen=True)
class Registration:
    """What :func:`register` was given: the grid, the input layout and the local kernel."""

    topology: SequenceParallelTopology
    layout: str
    backend: str
    kv_exchange: str = "ring"


class RingSPAttention:
    """The ``AttentionInterface`` function (an object, so it carries its registration).

    ``__call__(module, query, key, value, attention_mask, **kwargs) -> (out [b, n, h, d], None)``
    """

    def __init__(self, registration: Registration) -> None:
        self.registration = registration
        # every layer gets the same cu_seq_lens_q / _k tensors: convert each once per forward, not per layer
        self._cu_cache: list[tuple[torch.Tensor, int, Boundaries]] = []
        self._checked: tuple[torch.Tensor | None, int] = (None, -1)  # the position_ids last checked

    def _boundaries(self, cu: torch.Tensor) -> Boundaries:
        """A ``cu_seq_lens_*`` tensor as a tuple (one host sync per new tensor)."""
        for tensor, version, boundaries in self._cu_cache:
            if tensor is cu and version == cu._version:
                return boundaries
        boundaries = as_boundaries(cu)
        self._cu_cache = [*self._cu_cache[-1:], (cu, cu._version, boundaries)]  # the last q and k tensors
        return boundaries

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        reg = self.registration
        options = ring_sp_call_options(module, query, key, attention_mask, kwargs, layout=reg.layout,
                                       backend=reg.backend, boundaries=self._boundaries)
        positions = kwargs.get("position_ids")
        if positions is not None and not (positions is self._checked[0] and positions._version == self._checked[1]):
            check_positions(positions, options["layout"], reg.topology.sp_size, model_name(getattr(module, "config", None)))
            self._checked = (positions, positions._version)  # every layer gets the same tensor: once per forward
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # HF [b, h, n, d] -> ring_sp [b, n, h, d]
        return hybrid_attention(q, k, v, topology=reg.topology, kv_exchange=reg.kv_exchange, **options), None

    def mask(self, *, attention_mask: torch.Tensor | None = None, q_length: int = 0, kv_length: int = 0,
             q_offset: Any = 0, config: Any = None, **_: Any) -> None:
        """The ``AttentionMaskInterface`` hook: checks, then no mask (the attention needs none)."""
        check_model_config(config)
        check_mask_call(config, attention_mask, q_length, kv_length, q_offset)
        return None


def register(topology: SequenceParallelTopology, *, layout: str = "zigzag", backend: str = "auto",
             kv_exchange: str = "ring") -> str:
    """Register ring_sp with transformers; returns ``"ring_sp"`` for ``attn_implementation=``.

    Afterwards ``AutoModelForCausalLM.from_config(cfg, attn_implementation="ring_sp")``,
    ``from_pretrained(..., attn_implementation="ring_sp")`` or
    ``model.set_attn_implementation("ring_sp")`` run every attention layer over
    ``topology``'s ``U x R`` grid. ``layout``: how batches are sharded
    (:func:`ring_sp.integrations.transformers.shard_batch` with the same ``layout``; packed
    documents turn ``zigzag`` into ``document_zigzag`` on both sides). ``backend``: the
    local kernel (``ring_sp.kernels.BACKENDS``). ``kv_exchange``: the ring groups' KV
    exchange (``ring``, ``all_gather`` or ``auto``; see :func:`ring_sp.ring_attention`).
    No communication. Raises when the installed transformers is outside the supported range
    (``ring_sp.integrations.versions``).
    """
    require_supported("transformers", "ring_sp.integrations.transformers.register")
    if not isinstance(topology, SequenceParallelTopology):
        raise TypeError(
            f"topology must be a ring_sp.SequenceParallelTopology (ring_sp.init_sequence_parallel or "
            f"ring_sp.integrations.deepspeed.build_topology); got {type(topology).__name__}"
        )
    check_options(causal=True, layout=layout, softmax_scale=None, backend=backend)
    check_grid_layout(layout, topology.ulysses_size, topology.ring_size)
    check_kv_exchange(kv_exchange)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attention = RingSPAttention(Registration(topology, layout, backend, kv_exchange))
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention.mask)
    return ATTN_IMPLEMENTATION


def registration() -> Registration | None:
    """The current registration of ``"ring_sp"`` with transformers, or None (never imports transformers)."""
    if "transformers" not in sys.modules:
        return None  # nothing can have been registered
    from transformers import AttentionInterface

    attention = AttentionInterface._global_mapping.get(ATTN_IMPLEMENTATION)
    return attention.registration if isinstance(attention, RingSPAttention) else None


def registered_topology() -> SequenceParallelTopology | None:
    """The topology of the last :func:`register`, or None."""
    current = registration()
    return None if current is None else current.topology


def uses_ring_sp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers model running ``attn_implementation="ring_sp"``."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


__all__ = ["ATTN_IMPLEMENTATION", "Registration", "RingSPAttention", "register", "registered_topology",
           "registration", "uses_ring_sp"]
