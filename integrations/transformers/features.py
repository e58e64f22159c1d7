"""What ring_sp's attention supports of a Hugging Face attention call, and the translation.

:func:`ring_sp_call_options` is THE one place where an HF attention call (the attention
module's attributes plus the keyword arguments transformers passes to an
``AttentionInterface`` function) becomes ring_sp keyword arguments. A feature ring_sp does
not support yet raises :class:`UnsupportedFeatureError` naming the model, the feature and
the fix. Sliding windows (the layer's ``sliding_window``: query ``i`` sees keys
``i - W < j <= i``, transformers' ``sliding_window_overlay`` and ring_sp's meaning) and
attention sinks (gpt-oss's ``s_aux``: one logit per head joined to the scores unscaled and
dropped after the softmax, ring_sp's ``sinks=``) pass straight through, and so do the shard's
bidirectional spans (``"ring_sp_spans"``, :mod:`.multimodal`). A mask in which tokens see
later ones (transformers' OR overlays: image blocks, prefixes) is found by
:func:`sees_later_tokens` in the mask hook and refused unless the call carries those spans.

:func:`check_model_config` is the model-wide part of the same checks, run by the mask hook
once per forward before the first layer, so a model whose LATER layers use chunked
attention fails before layer 0 starts any collective. Both are pure and local: every rank
given the same model and batch raises the same error before any communication.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ring_sp.layouts import Boundaries
from ring_sp.spans import Spans

from .shards import SPANS_KEY


class UnsupportedFeatureError(ValueError):
    """A model feature ring_sp's attention does not support (yet)."""


def model_name(config: Any, module: torch.nn.Module | None = None) -> str:
    """``'LlamaForCausalLM (model_type llama)'`` plus the attention module and layer, for errors."""
    architectures = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None) or "unknown"
    name = f"{architectures[0]} (model_type {model_type!r})" if architectures else f"the model of model_type {model_type!r}"
    if module is not None:
        layer = getattr(module, "layer_idx", None)
        name += f", {type(module).__name__}" + (f" of layer {layer}" if layer is not None else "")
    return name


def _unsupported(where: str, feature: str, fix: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f'{where} uses {feature}, which attn_implementation="ring_sp" does not support yet; {fix}'
    )


_LAYER_TYPES = ("full_attention", "sliding_attention")  # what ring_sp runs: causal, with or without a window


def check_model_config(config: Any) -> None:
    """Model-wide features ring_sp cannot run (layer types other than full and sliding
    attention, chunked attention). Pure."""
    where = model_name(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t not in _LAYER_TYPES})
        if other:
            raise _unsupported(
                where, f"attention layer types {other} (config.layer_types)",
                f"use a config whose layer_types are among {list(_LAYER_TYPES)}, or another attn_implementation "
                "for this model",
            )
    if getattr(config, "attention_chunk_size", None) is not None:
        raise _unsupported(
            where, f"chunked attention of {config.attention_chunk_size} tokens (config.attention_chunk_size)",
            "set config.attention_chunk_size = None",
        )


def layer_windows(config: Any) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), read as transformers' own caches read it:
    ``layer_types`` (``"sliding_attention"`` layers take ``sliding_window``), else ``sliding_window`` for
    every layer. A :class:`~.kv_cache.RingSPCache` layer drops the keys its window has passed. Pure."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * text.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def latent_layers(model: torch.nn.Module) -> frozenset[int]:
    """The layers whose attention caches MLA's compressed latents: transformers' MLA modules (DeepSeek-V2/V3 and
    kin) pass ``past_key_values.update`` their latents and expand what it returns (``expand_kv``)."""
    return frozenset(m.layer_idx for m in model.modules() if callable(getattr(m, "expand_kv", None))
                     and isinstance(getattr(m, "layer_idx", None), int))


def check_mask_call(config: Any, attention_mask: torch.Tensor | None, q_length: int, kv_length: int,
                    q_offset: Any) -> None:
    """The mask hook's checks: a padding mask or a KV cache holding earlier tokens. Local."""
    where = model_name(config)
    if attention_mask is not None and not bool(attention_mask.all()):
        raise _unsupported(
            where, "a padding attention_mask (some entries are 0)",
            "pack the sequences instead of padding them (DataCollatorWithFlattening: position_ids restarting at 0 "
            "per document), shard with ring_sp.integrations.transformers.shard_batch, and pass no attention_mask",
        )
    if kv_length != q_length or (not isinstance(q_offset, torch.Tensor) and q_offset != 0):
        raise _unsupported(
            where, f"a KV cache holding {kv_length - q_length} earlier tokens (generation with past_key_values)",
            "generate with another attn_implementation, e.g. model.set_attn_implementation('sdpa') on one rank "
            "(training and evaluation forwards are supported, with or without use_cache)",
        )


def host_values(tensor: torch.Tensor) -> tuple[int, ...]:
    """An int tensor's values as a flat tuple (one device-to-host copy)."""
    return tuple(int(x) for x in tensor.reshape(-1).tolist())


def _spans(kwargs: Mapping[str, Any], where: str, host: Callable[[torch.Tensor], tuple[int, ...]]) -> Spans | None:
    """The GLOBAL bidirectional spans :func:`..data.shard_batch` put in the shard, flat (start, stop, ...)."""
    spans = kwargs.get(SPANS_KEY)
    if spans is None:
        return None
    if not isinstance(spans, torch.Tensor) or spans.dim() != 2 or spans.shape[1] != 2 or spans.is_floating_point():
        raise ValueError(f"{where}: {SPANS_KEY!r} must be the int64 [num_spans, 2] tensor of GLOBAL (start, stop) spans "
                         f"shard_batch makes; got {_short(spans)}")
    return host(spans)


def sees_later_tokens(mask_function: Any, batch_size: int, q_length: int, device: Any) -> bool:
    """Whether transformers' ``mask_function`` lets some token see the NEXT one (an OR overlay: a
    bidirectional block or prefix from ``token_type_ids``, or no causality at all): causal,
    sliding-window and packed-document masks never do. Evaluated on the ``[b, n - 1]`` pairs
    (i, i + 1) only, as transformers' index-based mask functions allow; a function that cannot be
    evaluated that way counts as seeing them (it is no mask ring_sp knows)."""
    if mask_function is None or q_length < 2:
        return False
    rows = torch.arange(batch_size, device=device).view(-1, 1)
    queries = torch.arange(q_length - 1, device=device).view(1, -1)
    try:
        seen = mask_function(rows, torch.zeros((), dtype=torch.long, device=device), queries, queries + 1)
        return bool(torch.as_tensor(seen).any())
    except Exception:  # noqa: BLE001 - any failure: a mask we cannot read
        return True


def later_tokens_error(where: str) -> UnsupportedFeatureError:
    """The error of a model whose mask lets tokens see later ones, given no spans for it."""
    return _unsupported(
        where, "an attention mask in which tokens see later tokens (a bidirectional block or prefix, e.g. built from "
        "token_type_ids) without the spans that say where",
        "shard the batch with ring_sp.integrations.transformers.shard_batch(batch, topology, model=model), which turns "
        "the token_type_ids of a known vision-language model into spans, and pass no token_type_ids to the model")


def _cu_seqlens(kwargs: Mapping[str, Any], where: str, boundaries: Callable[[torch.Tensor], Boundaries]) -> Boundaries | None:
    """The global document boundaries of ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (equal: self-attention)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or (cu_q is not cu_k and boundaries(cu_q) != boundaries(cu_k)):
        raise ValueError(
            f"{where}: cu_seq_lens_q and cu_seq_lens_k must both be given and equal (the global document boundaries "
            f"of self-attention); make them with ring_sp.integrations.transformers.shard_batch"
        )
    return boundaries(cu_q)


def ring_sp_call_options(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         attention_mask: torch.Tensor | None, kwargs: Mapping[str, Any], *, layout: str,
                         backend: str, boundaries: Callable[[torch.Tensor], Boundaries] = host_values) -> dict[str, Any]:
    """ring_sp keyword arguments for one HF attention call, or :class:`UnsupportedFeatureError`.

    ``query`` ``[b, h, n, d]`` and ``key`` ``[b, h_kv, n_kv, d]`` as transformers passes them;
    ``layout`` / ``backend``: the registered ones (``layout`` turns document-aware when
    documents are given). ``boundaries``: turns a ``cu_seq_lens_*`` (or spans) tensor into a
    flat tuple (the caller may cache it across layers). Returns ``causal``, ``layout``,
    ``softmax_scale``, ``backend``, ``cu_seqlens``, ``spans`` (the shard's bidirectional spans
    or None), ``sliding_window`` (int or None) and ``sinks`` (``[h]`` or None) for
    :func:`ring_sp.hybrid_attention`, which validates the last three.
    """
    config = getattr(module, "config", None)
    where = model_name(config, module)
    if attention_mask is not None:
        kind = f"a {attention_mask.dim()}-D attention mask" if isinstance(attention_mask, torch.Tensor) else \
            f"an attention mask of type {type(attention_mask).__name__}"
        raise _unsupported(
            where, f"{kind} (a custom or padding mask)",
            "pass no attention_mask: packed documents go through position_ids (shard_batch turns them into "
            "document boundaries), padding is not supported",
        )
    if key.shape[-2] != query.shape[-2]:
        raise _unsupported(
            where, f"keys of length {key.shape[-2]} for queries of length {query.shape[-2]} (a KV cache holding earlier "
            "tokens, or cross-attention)",
            "generate with another attn_implementation (e.g. 'sdpa' on one rank); ring_sp runs self-attention "
            "training and evaluation forwards",
        )
    dropout = kwargs.get("dropout", 0.0) or 0.0
    if dropout > 0:
        raise _unsupported(
            where, f"attention dropout {dropout} (config.attention_dropout)",
            "set config.attention_dropout = 0.0 (ring_sp attention has no dropout)",
        )
    sliding_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    sinks = kwargs.get("s_aux", kwargs.get("sinks", getattr(module, "sinks", None)))
    if kwargs.get("softcap") is not None:
        raise _unsupported(where, f"attention logit softcapping ({kwargs['softcap']})", "set config.attn_logit_softcapping = None")
    for name in ("position_bias", "alibi", "head_mask"):
        if kwargs.get(name) is not None:
            raise _unsupported(where, f"an additive attention bias ({name})", "use a RoPE model without attention biases")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    cu_seqlens = _cu_seqlens(kwargs, where, boundaries)
    return dict(causal=bool(causal), layout=layout_for(layout, packed=cu_seqlens is not None),
                softmax_scale=kwargs.get("scaling"), backend=backend, cu_seqlens=cu_seqlens,
                spans=_spans(kwargs, where, boundaries), sliding_window=sliding_window, sinks=sinks)


def forbid_labels(model: torch.nn.Module, sp_size: int) -> None:
    """Make ``model(..., labels=...)`` raise, before the forward, while it runs on ``sp_size > 1`` ranks.

    transformers' own loss would shift ``labels`` inside this rank's shard (the last token
    of every shard loses its target and gets the next position's of the same shard) and
    average over this rank's tokens only: a wrong loss without a word. The exact loss takes
    the shard's ``shift_labels`` (shifted on the whole sequence by ``shard_batch``) in
    :func:`ring_sp.integrations.transformers.causal_lm_loss`. A forward pre-hook, installed
    once; ``sp_size == 1`` installs nothing (the model's own loss is exact then). ``register``'s
    forward guard checks the same for every ring_sp model, hooked or not (and raises on every
    rank); this hook stays for a model whose forward is called past that guard.
    """
    if sp_size == 1 or getattr(model, "_ring_sp_forbids_labels", False):
        return

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get("labels") is not None:
            raise labels_error(model_name(getattr(module, "config", None)), kwargs["labels"], kwargs.get("shift_labels"),
                               sp_size)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model._ring_sp_forbids_labels = True


def labels_error(where: str, labels: object, shift_labels: object, sp_size: int) -> ValueError:
    """The error of ``labels=`` given to a model that runs on ``sp_size > 1`` SP ranks."""
    shifted = "" if shift_labels is not None else " (and no shift_labels)"
    return ValueError(
        f"{where} was given labels={_short(labels)}{shifted} while it runs on {sp_size} sequence-parallel ranks: "
        f"transformers' loss would shift them inside this rank's shard (unshifted where shifted are expected) and "
        f"average over this rank only; pass no labels and compute the loss with "
        f"ring_sp.integrations.transformers.causal_lm_loss(logits, shard['shift_labels'], ...) on the shard of shard_batch"
    )


def _short(x: object) -> str:
    return f"Tensor(shape={tuple(x.shape)})" if isinstance(x, torch.Tensor) else type(x).__name__


def layout_for(layout: str, *, packed: bool) -> str:
    """The layout a batch is sharded with: ``zigzag`` turns into ``document_zigzag`` for packed
    documents (and back for a batch without documents); the others stay (``auto`` is
    resolved by ring_sp alike for the data and the attention, from the same documents)."""
    if packed and layout == "zigzag":
        return "document_zigzag"
    if not packed and layout == "document_zigzag":
        return "zigzag"
    return layout


__all__ = ["UnsupportedFeatureError", "check_mask_call", "check_model_config", "forbid_labels", "host_values", "labels_error",
           "later_tokens_error", "layout_for", "model_name", "ring_sp_call_options", "sees_later_tokens"]
