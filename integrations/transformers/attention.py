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

and guards ``PreTrainedModel.__call__`` (:func:`_guard_forward`): a ring_sp model's inputs
(``labels=``, ``input_ids``, ``shift_labels``) are checked against the shard's fingerprint
before its forward. Every error found on one rank (there, in the mask hook, or in the
attention's shard check) is raised on every rank of the SP group by the first attention
call's agreement (:mod:`ring_sp.agreement`), before any other collective.

transformers' registries are global, so the registration is too: one topology (and one
layout/backend) serves every model using ``"ring_sp"``; registering again replaces it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp import SequenceParallelTopology, hybrid_attention
from ring_sp.agreement import defer, raise_at_next_agreement, shard_values
from ring_sp.attention import raise_on_every_rank
from ring_sp.layouts import Boundaries, check_grid_layout
from ring_sp.integrations.versions import require_supported
from ring_sp.validation import check_head_chunks, check_kv_exchange, check_options

from .features import (check_mask_call, check_model_config, host_values, labels_error,
                       later_tokens_error, model_name, ring_sp_call_options, sees_later_tokens)
from .multimodal import LOCAL_ENCODERS, select_image_tokens, selected_tokens, vision_model_error
from .shards import IMAGE_TOKENS_KEY, SHARD_KEY, agreed_values, check_shard, images_checksum, inputs_error, remember

ATTN_IMPLEMENTATION = "ring_sp"


@dataclass(frozen=True)
class Registration:
    """What :func:`register` was given: the grid, the input layout and the local kernel."""

    topology: SequenceParallelTopology
    layout: str
    backend: str
    kv_exchange: str = "ring"
    head_chunks: int | str | None = None


class RingSPAttention:
    """The ``AttentionInterface`` function (an object, so it carries its registration).

    ``__call__(module, query, key, value, attention_mask, **kwargs) -> (out [b, n, h, d], None)``
    """

    def __init__(self, registration: Registration) -> None:
        self.registration = registration
        # every layer gets the same cu_seq_lens_q / _k tensors: convert each once per forward, not per layer
        self._cu_cache: list[tuple[torch.Tensor, int, Boundaries]] = []
        self._checked: tuple = ()  # the fingerprint and position_ids last checked, with their versions

    def _boundaries(self, cu: torch.Tensor) -> Boundaries:
        """A ``cu_seq_lens_*`` (or spans) tensor as a flat tuple (one host sync per new tensor)."""
        for tensor, version, boundaries in self._cu_cache:
            if tensor is cu and version == cu._version:
                return boundaries
        boundaries = host_values(cu)
        self._cu_cache = [*self._cu_cache[-2:], (cu, cu._version, boundaries)]  # the last q, k and spans tensors
        return boundaries

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        reg = self.registration
        if reg.topology.sp_size > 1 and _decoding():  # generate()'s decode step: over the sharded KV cache
            from .generation import decode_call

            return decode_call(module, query, key, value, kwargs, reg), None
        local_encoder = getattr(getattr(module, "config", None), "model_type", None) in LOCAL_ENCODERS
        if local_encoder or (reg.topology.sp_size == 1 and (attention_mask is not None or key.shape[-2] != query.shape[-2])):
            # a known vision tower attends within whole images, which every rank holds (.multimodal); on one
            # rank holding the whole sequence a KV cache (generation), padding or a block mask is sdpa's business
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # HF [b, h, n, d] -> ring_sp [b, n, h, d]
        chunks = getattr(module, "ring_sp_head_chunks", None)  # enable_long_sequence's, else register()'s
        chunks = reg.head_chunks if chunks is None else chunks
        mark, positions = kwargs.get(SHARD_KEY), kwargs.get("position_ids")
        with shard_values(agreed_values(mark)):  # the global batch, compared across ranks on every call
            try:
                options = ring_sp_call_options(module, query, key, attention_mask, kwargs, layout=reg.layout,
                                               backend=reg.backend, boundaries=self._boundaries)
                if options["causal"] and options["spans"] is None and _SEES_LATER.get():
                    raise later_tokens_error(model_name(getattr(module, "config", None), module))
            except (TypeError, ValueError) as exc:
                raise_on_every_rank(exc, q, k, v, topology=reg.topology, layout=reg.layout, backend=reg.backend,
                                    kv_exchange=reg.kv_exchange, head_chunks=chunks)
            seen = (mark, positions, tuple(t._version for t in (mark, positions) if isinstance(t, torch.Tensor)),
                    options["cu_seqlens"], options["layout"], options["spans"])
            last = self._checked
            if not (last and seen[0] is last[0] and seen[1] is last[1] and seen[2:] == last[2:]):
                # every layer gets the same tensors: check once per forward, before the first collective
                try:
                    check_shard(mark, positions, batch=q.shape[0], local_len=q.shape[1], layout=options["layout"],
                                boundaries=options["cu_seqlens"], topology=reg.topology,
                                where=model_name(getattr(module, "config", None)), spans=options["spans"])
                except (TypeError, ValueError) as exc:
                    raise_on_every_rank(exc, q, k, v, topology=reg.topology, kv_exchange=reg.kv_exchange,
                                        head_chunks=chunks, **options)
                self._checked = seen
            # enable_long_sequence(offload_checkpoints=True) turns the re-run's reuse off (its out + lse would stay
            # on the device for every layer); None: the default
            reuse = getattr(module, "ring_sp_reuse_on_recompute", None)
            return hybrid_attention(q, k, v, topology=reg.topology, kv_exchange=reg.kv_exchange, head_chunks=chunks,
                                    reuse_on_recompute=reuse, **options), None

    def mask(self, *, attention_mask: torch.Tensor | None = None, q_length: int = 0, kv_length: int = 0,
             q_offset: Any = 0, config: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """The ``AttentionMaskInterface`` hook: checks, then no mask (the attention needs none).

        With an SP group of ONE rank, a KV cache (generation) or a padding mask gets sdpa's own
        mask, and the attention hands those calls to sdpa: the sequence is whole, so that is exact.
        """
        try:
            check_model_config(config)
        except ValueError as exc:
            if not defer(exc):  # inside a forward of register()'s guard: raised on every rank by the first layer
                raise
        if self.registration.topology.sp_size > 1 and _decoding():
            return None  # a decode step over the sharded cache sees every earlier token (windows: the attention's)
        cached = kv_length != q_length or isinstance(q_offset, torch.Tensor) or q_offset != 0
        padded = attention_mask is not None and not bool(attention_mask.all())
        later = not cached and sees_later_tokens(kwargs.get("mask_function"), kwargs.get("batch_size", 1), q_length,
                                                 kwargs.get("device"))
        if self.registration.topology.sp_size > 1 and _IN_FORWARD.get():  # the attention then needs spans for it
            _SEES_LATER.set(later or _SEES_LATER.get())
        if self.registration.topology.sp_size == 1 and (cached or padded or later):
            from transformers.masking_utils import sdpa_mask

            return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                             config=config, **kwargs)
        try:
            check_mask_call(config, attention_mask, q_length, kv_length, q_offset)
        except ValueError as exc:
            if not defer(exc):
                raise
        return None


def register(topology: SequenceParallelTopology, *, layout: str = "zigzag", backend: str = "auto",
             kv_exchange: str = "ring", head_chunks: int | str | None = None) -> str:
    """Register ring_sp with transformers; returns ``"ring_sp"`` for ``attn_implementation=``.

    Afterwards ``AutoModelForCausalLM.from_config(cfg, attn_implementation="ring_sp")``,
    ``from_pretrained(..., attn_implementation="ring_sp")`` or
    ``model.set_attn_implementation("ring_sp")`` run every attention layer over
    ``topology``'s ``U x R`` grid. ``layout``: how batches are sharded
    (:func:`ring_sp.integrations.transformers.shard_batch` with the same ``layout``; packed
    documents turn ``zigzag`` into ``document_zigzag`` on both sides). ``backend``: the
    local kernel (``ring_sp.kernels.BACKENDS``). ``kv_exchange``: the ring groups' KV
    exchange (``ring``, ``all_gather`` or ``auto``; see :func:`ring_sp.ring_attention`).
    ``head_chunks``: every layer's heads in that many chunks (None: unchunked; ``"auto"``;
    see :func:`ring_sp.hybrid_attention`); an attention module's own ``ring_sp_head_chunks``
    (set by ``enable_long_sequence``) takes precedence. No communication. Raises when the installed transformers is outside the supported range
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
    check_head_chunks(head_chunks)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attention = RingSPAttention(Registration(topology, layout, backend, kv_exchange, head_chunks))
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attention.mask)
    _guard_generate()
    _guard_forward()
    return ATTN_IMPLEMENTATION


def generation_topology(model: Any) -> Any:
    """The topology whose SP group ``model.generate()`` runs over together (a ``"ring_sp"`` model, an SP
    group of more than one rank), else None (one-rank SP groups hand cached calls to sdpa)."""
    current = registration()
    if uses_ring_sp(model) and current is not None and current.topology.sp_size > 1:
        return current.topology
    return None


def _guard_generate() -> None:
    """``generate()`` of a ring_sp model over more than one SP rank runs on every rank of the SP
    group together (:func:`.generation.generate_together`: its arguments agreed, the prompt
    prefilled over the grid into a sharded KV cache, each token decoded against it). Wraps
    ``GenerationMixin.generate`` once; other models (and one-rank SP groups, where ring_sp hands
    cached calls to sdpa) pass through.
    """
    from transformers.generation.utils import GenerationMixin

    def guard(generate: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            topology = generation_topology(self)
            if topology is not None:
                from .generation import generate_together

                return generate_together(generate, self, topology, args, kwargs)
            return generate(self, *args, **kwargs)

        return guarded

    _wrap_once(GenerationMixin, "generate", guard)


def _wrap_once(owner: type, name: str, guard: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``guard(owner.name)`` (with its name and docstring), once."""
    original = getattr(owner, name)
    if getattr(original, "_ring_sp_guard", False):
        return
    guarded = functools.wraps(original)(guard(original))
    guarded._ring_sp_guard = True
    setattr(owner, name, guarded)


_IN_FORWARD: ContextVar[bool] = ContextVar("ring_sp_in_forward", default=False)
# whether this forward's mask lets a token see a later one (the mask hook's finding; reset per guarded forward)
_SEES_LATER: ContextVar[bool] = ContextVar("ring_sp_sees_later", default=False)


def _guard_forward() -> None:
    """Every forward of a ring_sp model over more than one SP rank checks its inputs first.

    Wraps ``PreTrainedModel.__call__`` once (as :func:`_guard_generate` wraps ``generate``), so
    no model escapes it, whether it went through ``rsp_ds.initialize``, the Trainer or neither:
    ``labels=`` (transformers' loss would shift them inside this rank's shard and average over
    this rank) and ``input_ids`` / ``shift_labels`` that are not the ones the shard's fingerprint
    was cut with (:func:`.shards.inputs_error`). An error found here is not raised here: the
    forward goes on (without ``labels``) to its first attention call, whose agreement raises it
    on every rank of the SP group (``ring_sp.agreement.raise_at_next_agreement``), so a rank
    that alone is wrong does not leave its peers waiting. A vision-language model this
    integration does not know is refused the same way (:func:`.multimodal.vision_model_error`);
    a known one keeps only its shard's image tokens (:func:`.multimodal.select_image_tokens`,
    the rows of ``"ring_sp_image_tokens"``). Other models pass through.
    """
    from transformers import PreTrainedModel

    def guard(call: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            current = registration()
            if _IN_FORWARD.get() or current is None or current.topology.sp_size == 1 or not uses_ring_sp(self):
                return call(self, *args, **kwargs)
            cache = kwargs.get("past_key_values")
            if getattr(cache, "is_ring_sp", False) and cache.prefill is None:
                from .generation import cached_forward, decoding

                if not decoding():  # generate()'s forwards: the prefill cut there, each decode step as it is
                    return cached_forward(functools.partial(guarded, self), self, current, kwargs)
            where = model_name(getattr(self, "config", None))
            error = None
            if kwargs.get("labels") is not None:
                error = labels_error(where, kwargs.pop("labels"), kwargs.get("shift_labels"), current.topology.sp_size)
            mark = kwargs.get(SHARD_KEY)
            images = images_checksum(kwargs.get("pixel_values"), kwargs.get(IMAGE_TOKENS_KEY))
            error = error or inputs_error(mark, kwargs.get("input_ids", args[0] if args else None),
                                          kwargs.get("shift_labels"), where, images) or vision_model_error(self.config)
            if error is not None:  # raised by the first attention call on every rank: images that do not fit the
                kwargs.pop("pixel_values", None)  # tokens must not fail before it on this rank alone
            select_image_tokens(self)
            token, later = _IN_FORWARD.set(True), _SEES_LATER.set(False)
            try:
                with raise_at_next_agreement(error), selected_tokens(kwargs.pop(IMAGE_TOKENS_KEY, None)):
                    out = call(self, *args, **kwargs)
            finally:
                _IN_FORWARD.reset(token)
                _SEES_LATER.reset(later)
            remember(getattr(out, "logits", None), mark)  # for causal_lm_loss's check of its labels
            return out

        return guarded

    _wrap_once(PreTrainedModel, "__call__", guard)


def _decoding() -> bool:
    """Whether generate()'s decode step is running (only then is .generation imported)."""
    module = sys.modules.get(f"{__package__}.generation")
    return module is not None and module.decoding()


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


__all__ = ["ATTN_IMPLEMENTATION", "Registration", "RingSPAttention", "generation_topology", "register",
           "registered_topology", "registration", "uses_ring_sp"]
