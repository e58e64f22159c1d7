"""A Hugging Face batch -> this rank's shard, such that ``model(**shard)`` runs on the grid.

Hugging Face conventions in, ring_sp's sharding out:

* ``labels`` (default: ``input_ids``) are shifted on the FULL sequence and returned as
  ``shift_labels``, which transformers' causal-LM loss takes as already shifted;
* ``position_ids`` stay GLOBAL (in layout order), so RoPE sees each token's true position;
* packed documents in the ``DataCollatorWithFlattening`` convention (``position_ids``
  restarting at every document, or its ``cu_seq_lens_q``) become document boundaries over
  the whole row (``cu_seq_lens_q`` / ``cu_seq_lens_k``, GLOBAL and equal on every rank, which
  transformers forwards to the attention) and the document-aware layout; labels are shifted
  inside each document;
* a batch whose length ``N`` is not a multiple of the layout's unit (``2 x SP`` for zigzag)
  is treated as packed: each row one document, all rows one flattened row, so the data and
  the attention (which turns ``zigzag`` into ``document_zigzag`` whenever ``cu_seq_lens``
  are given) always agree; ring_sp's ``shard_batch`` pads the row's end (its own document,
  labels ignored), and ``seq_len=`` of ``gather_sequence`` drops it again;
* an ``attention_mask`` must be all ones (padding is not supported) and is dropped;
* a vision-language model's ``token_type_ids`` become its bidirectional spans (``"ring_sp_spans"``,
  GLOBAL, for the attention; rows of a batch become documents of one row) and its
  ``pixel_values`` the images with a token in this shard (:mod:`.multimodal`), for the models
  :data:`.multimodal.KNOWN` (``model=`` says which); others are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ring_sp import LAYOUT_CHOICES, SequenceParallelTopology
from ring_sp import shard_batch as ring_sp_shard_batch
from ring_sp.data import sharded_together
from ring_sp.layouts import AUTO, Boundaries, as_boundaries, layout_unit
from ring_sp.spans import Spans

from .attention import registration
from .features import UnsupportedFeatureError, layout_for, model_name
from .multimodal import KNOWN, batch_spans, image_ordinals, known_model, shard_images
from .shards import IMAGE_TOKENS_KEY, SHARD_KEY, SPANS_KEY, batch_checksum, fingerprint, images_checksum

_FLASH_LENGTHS = ("max_length_q", "max_length_k")  # DataCollatorWithFlattening's, recomputed by nobody here
_VISION = ("token_type_ids", "pixel_values")  # a vision-language model's inputs (.multimodal)
_ORDINALS = "ring_sp_image_ordinals"  # sharded with the ids, then turned into the shard's images


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return f"{type(x).__name__} {x!r}"


def document_boundaries(position_ids: torch.Tensor) -> Boundaries:
    """Boundaries of the documents of ``[b, N]`` positions laid end to end as ONE row of ``b * N``.

    A document starts where a position is not its predecessor + 1 (transformers'
    ``find_packed_sequence_indices`` rule) and at every row start.
    """
    b, n = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return tuple(torch.nonzero(starts.reshape(-1)).flatten().tolist()) + (b * n,)


def _documents(batch: dict[str, Any], b: int, n: int) -> Boundaries | None:
    """The batch's document boundaries over the flattened row, or None when no row is packed."""
    cu_q, cu_k = batch.pop("cu_seq_lens_q", None), batch.pop("cu_seq_lens_k", None)
    for key in _FLASH_LENGTHS:
        batch.pop(key, None)
    given = None
    if cu_q is not None or cu_k is not None:
        given = as_boundaries(cu_q if cu_q is not None else cu_k)
        if cu_q is not None and cu_k is not None and as_boundaries(cu_k) != given:
            raise ValueError("batch['cu_seq_lens_q'] and batch['cu_seq_lens_k'] differ; self-attention needs one set "
                             "of document boundaries")
        if b != 1 or given[0] != 0 or given[-1] != n:
            raise ValueError(
                f"batch['cu_seq_lens_q'] must describe ONE flattened row: start at 0 and end at its length {n}, with "
                f"input_ids of shape [1, {n}]; got {_describe(cu_q)} for input_ids [{b}, {n}]"
            )
    if "position_ids" in batch:
        found = document_boundaries(batch["position_ids"])
        if given is not None and found != given:
            raise ValueError(
                "batch['position_ids'] and batch['cu_seq_lens_q'] describe different documents (positions must "
                "restart at every boundary); pass one of them"
            )
        given = found
    if given is None or len(given) - 1 == b:
        return None  # one document per row: nothing packed
    return given


def _vision_inputs(full: dict[str, Any], model: Any) -> tuple[Spans | None, torch.Tensor | None]:
    """Pop a vision-language model's ``token_type_ids`` and ``pixel_values``: (its GLOBAL spans or
    None, the pixel values or None); add the image tokens' ordinals to shard with the ids."""
    token_types, pixels = (full.pop(key, None) for key in _VISION)
    if token_types is None and pixels is None:
        return None, None
    config = getattr(model, "config", model)
    known = known_model(config)
    if known is None:
        given = " and ".join(key for key, value in zip(_VISION, (token_types, pixels)) if value is not None)
        if model is None:
            raise ValueError(f"the batch holds {given}: pass model= (the model, or its config) so that shard_batch "
                             f"turns them into the model's bidirectional spans and this shard's images")
        raise UnsupportedFeatureError(
            f'{model_name(config)} takes {given}, which attn_implementation="ring_sp" does not support yet for this '
            f"model type (known: {sorted(KNOWN)}); train it with another attn_implementation")
    spans = None if token_types is None else batch_spans(known, token_types)
    if pixels is not None:
        full[_ORDINALS] = image_ordinals(full["input_ids"], config.image_token_id)
    return spans, pixels


def shard_batch(batch: Mapping[str, Any], topology: SequenceParallelTopology | None, *, layout: str = "zigzag",
                pad_id: int = 0, model: Any = None, validate: bool | None = None) -> dict[str, torch.Tensor]:
    """This rank's shard of a GLOBAL Hugging Face batch, ready for ``model(**shard)``.

    ``batch``: ``input_ids`` ``[b, N]``; optional ``labels`` ``[b, N]`` (unshifted, the HF
    convention; default ``input_ids``; -100 is ignored), ``position_ids`` ``[b or 1, N]``,
    an all-ones ``attention_mask``, DataCollatorWithFlattening's ``cu_seq_lens_q/k`` and
    ``max_length_q/k``; other ``[b, N, ...]`` tensors are sharded alike. ``topology``:
    the grid (None: one rank, the same keys, nothing sharded). ``layout``: the one given
    to :func:`register`.

    Returns ``input_ids``, ``position_ids`` (global, in layout order) and ``shift_labels``,
    each ``[b, N / sp_size]``, and ``"ring_sp_shard"``: int64 ``[12]``, which rank, topology,
    layout, batch, positions, tokens and labels the shard was cut for (the attention checks it, so a shard
    run where it does not belong raises instead of computing a wrong answer; see
    :mod:`.shards`). Packed documents (positions restarting), or a length ``N``
    that is not a multiple of :func:`ring_sp.layouts.layout_unit` (each row then one
    document), make ONE row of all ``b`` rows of any document lengths, use the
    document-aware layout (``zigzag`` -> ``document_zigzag``), get padded at the row's end
    only (to a multiple of the unit, with ``pad_id``; labels ignored) and add
    ``cu_seq_lens_q`` = ``cu_seq_lens_k``: int32 ``[docs + 1]`` boundaries of the GLOBAL
    row (the padding its own last document), the same on every rank, which the model
    forwards to the attention; gather logits with ``seq_len=b * N`` to drop the padding.

    Every rank of the SP group calls it with the same global batch. Its errors (arguments,
    the batch's keys and shapes) are found before any communication; then, with a group (the
    SP group of the topology given to :func:`register`, else of ``topology``; more than one
    rank), every rank of it raises: one agreement (:mod:`ring_sp.agreement`, the attention's),
    so an error on one rank is that rank's message on all of them, never a peer left waiting
    in the model's first collective. ``validate=False`` or ``RING_SP_VALIDATE=0``: no
    communication, an error raises on its rank alone; nor is there any in a DataLoader worker
    (no process group there: the loop that fetches the batches agrees, as the trainers do).

    Vision-language models (``model=``: the model or its config, of a type in
    :data:`.multimodal.KNOWN`): ``token_type_ids`` ``[b, N]`` become the bidirectional spans
    ``"ring_sp_spans"`` (int64 ``[num_spans, 2]``, GLOBAL; ``b > 1`` rows become documents of
    one row) and ``pixel_values`` ``[images, ...]`` the images with a token in this shard, with
    ``"ring_sp_image_tokens"`` (which rows of their features are the shard's image tokens; on
    more than one rank): see :mod:`.multimodal` for how, and what it costs.
    """
    return sharded_together(_agreement_group(topology), batch, layout,
                            lambda: _cut(batch, topology, layout=layout, pad_id=pad_id, model=model), validate=validate)


def _agreement_group(topology: object) -> Any:
    """The SP group whose ranks :func:`shard_batch` makes fail together, or None: the registered
    topology's (the group the attention agrees on: a rank given another topology still meets
    its peers there) else ``topology``'s, of more than one rank; None for ``topology=None`` (one rank, nothing sharded)."""
    if topology is None or not dist.is_initialized():
        return None
    registered = registration()
    for chosen in (None if registered is None else registered.topology, topology):
        if isinstance(chosen, SequenceParallelTopology) and chosen.sp_size > 1:
            return chosen.sp_group
    return None


def _cut(batch: Mapping[str, Any], topology: SequenceParallelTopology | None, *, layout: str,
         pad_id: int, model: Any) -> dict[str, torch.Tensor]:
    """:func:`shard_batch`'s checks and sharding on this rank alone (no communication)."""
    if topology is not None and not isinstance(topology, SequenceParallelTopology):
        raise TypeError(f"topology must be a ring_sp.SequenceParallelTopology or None; got {type(topology).__name__}")
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUT_CHOICES}; use the layout given to register()")
    registered = registration()
    if registered is not None and registered.topology is topology and registered.layout != layout:
        raise ValueError(f"layout={layout!r} but register() was given layout={registered.layout!r} for this topology: "
                         f"shard with the layout the attention assumes")
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError(f"batch must be a mapping with 'input_ids' [batch, seq]; got {_describe(batch)}")
    full = dict(batch)
    for key, value in full.items():
        if not isinstance(value, torch.Tensor) and key not in _FLASH_LENGTHS:
            raise TypeError(f"batch[{key!r}] must be a tensor; got {_describe(value)}")
    input_ids = full["input_ids"]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"batch['input_ids'] must be an integer tensor [batch, seq]; got {_describe(input_ids)}")
    b, n = input_ids.shape
    mask = full.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise ValueError(
            "batch['attention_mask'] has zeros (padding), which ring_sp does not support: pack the sequences instead "
            "(transformers' DataCollatorWithFlattening, position_ids restarting at 0 per document) and drop the mask"
        )
    if "position_ids" in full and full["position_ids"].shape[0] == 1 and b > 1:
        full["position_ids"] = full["position_ids"].expand(b, n)
    spans, pixels = _vision_inputs(full, model)
    boundaries = _documents(full, b, n)
    sp_size, sp_rank = (1, 0) if topology is None else (topology.sp_size, topology.sp_rank)
    unpacked_unit = layout_unit("zigzag" if layout == AUTO else layout, sp_size)  # auto: zigzag without documents
    if boundaries is None and (n % unpacked_unit or (spans is not None and b > 1)):
        boundaries = tuple(range(0, b * n + 1, n))  # any length, or spans per row: each row one document, flattened
    layout = layout_for(layout, packed=boundaries is not None)
    if boundaries is not None:
        full = {key: value.reshape(1, b * n, *value.shape[2:]) for key, value in full.items()}  # one packed row
    batch_sum = batch_checksum(full["input_ids"], full.get("labels", full["input_ids"]))  # the same on every rank
    shard = ring_sp_shard_batch(full, rank=sp_rank, world_size=sp_size, layout=layout, shift=True, cu_seqlens=boundaries,
                                pad_id=pad_id, spans=None if spans is None else list(zip(spans[0::2], spans[1::2])))
    shard["shift_labels"] = shard.pop("labels")
    cu = shard.pop("cu_seqlens", None)  # the GLOBAL boundaries, the tail padding as its own document
    if cu is not None:
        shard["cu_seq_lens_q"] = shard["cu_seq_lens_k"] = cu.to(device=input_ids.device, dtype=torch.int32)
    if spans is not None:
        shard[SPANS_KEY] = shard.pop("spans")
    if pixels is not None:
        ordinals = shard.pop(_ORDINALS)
        images, rows = shard_images(pixels, ordinals, int((full[_ORDINALS] > 0).sum()), "shard_batch")
        shard["pixel_values"] = pixels if sp_size == 1 else images
        if sp_size > 1:
            shard[IMAGE_TOKENS_KEY] = rows
    shard[SHARD_KEY] = fingerprint(sp_size=sp_size, sp_rank=sp_rank, layout=layout,
                                   global_len=shard["input_ids"].shape[1] * sp_size, boundaries=as_boundaries(cu),
                                   position_ids=shard["position_ids"], input_ids=shard["input_ids"],
                                   shift_labels=shard["shift_labels"], batch=batch_sum, spans=spans,
                                   images=images_checksum(shard.get("pixel_values"), shard.get(IMAGE_TOKENS_KEY)))
    return shard


__all__ = ["document_boundaries", "shard_batch"]
