"""Vision-language models on the grid: their bidirectional spans and the images each shard needs.

A vision-language model packs image tokens into its text; its attention is causal except
inside each image (Gemma 3: OR(causal, same image) from ``token_type_ids``). On the grid that
becomes ring_sp's ``spans=`` (:mod:`ring_sp.spans`), and each rank needs the image features
of the image tokens its shard holds. The models this integration knows (:data:`KNOWN`, by
``model_type``) say how:

* **spans:** ``token_type_ids`` of the GLOBAL batch -> the model's own per-token block ids ->
  GLOBAL spans (:func:`batch_spans`), which :func:`..data.shard_batch` puts in the shard
  (``"ring_sp_spans"``, fingerprinted) for the attention; ``token_type_ids`` leave the shard;
* **images:** every rank runs the vision tower on the images with at least one token in its
  shard (:func:`shard_images`): an image cut by a shard edge is encoded on each rank holding
  part of it; no communication. The model's projector output (``[images, tokens, hidden]``)
  is narrowed to the rank's image tokens, in its local order, by a forward hook
  (:func:`select_image_tokens`), so the model's own ``masked_scatter`` places them. A rank
  holding no image token encodes one image and keeps none of its tokens (its vision tower's
  gradients are then zeros, not missing: every rank reduces the same parameters). The vision
  tower's own attention (:data:`LOCAL_ENCODERS`) runs whole on each rank (sdpa).

Cost, per step: the vision tower's forward and backward on ``images / P`` images per rank
on average plus each cut image once more (zigzag over ``P`` SP ranks cuts a sequence, or
with ``document_zigzag`` each document, at ``2P - 1`` places at most), the pixels of those
images, and one image on ranks without image tokens. Gradients of the vision tower are each
rank's share; the data-parallel reduction over DP x SP sums them, as for every other weight.

A model with a vision tower, or ``token_type_ids``, that is not in :data:`KNOWN` is refused
by name (:func:`vision_model_error`, :func:`..data.shard_batch`). PaliGemma is one: its prefix
is a span too, but its text layers are declared non-causal (``use_bidirectional_attention``)
and take causality from the mask transformers builds, which ring_sp does not read, and its
positions start at 1; it needs more than this path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp.spans import Spans, spans_from_block_ids

from .features import UnsupportedFeatureError, model_name
from .shards import IMAGE_TOKENS_KEY


def _gemma3_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """Gemma 3: each run of image tokens (type 1) is one block (transformers' own function)."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    return get_block_sequence_ids_for_mask(token_type_ids)


@dataclass(frozen=True)
class VisionLanguageModel:
    """What the grid needs to know of one vision-language model type."""

    block_ids: Callable[[torch.Tensor], torch.Tensor]  # token_type_ids [b, N] -> block ids [b, N], -1 outside
    projector: str  # the submodule whose output is the image features [images, tokens per image, hidden]


KNOWN: dict[str, VisionLanguageModel] = {
    "gemma3": VisionLanguageModel(_gemma3_blocks, "model.multi_modal_projector"),
}
LOCAL_ENCODERS = ("siglip_vision_model",)  # vision towers of KNOWN models: attention over whole images, per rank


def known_model(config: Any) -> VisionLanguageModel | None:
    return KNOWN.get(getattr(config, "model_type", None))


def vision_model_error(config: Any) -> UnsupportedFeatureError | None:
    """A model with a vision tower this integration does not know: its images would not reach
    the shards holding their tokens (and its vision tower would run as a sequence shard)."""
    if getattr(config, "vision_config", None) is None or known_model(config) is not None:
        return None
    return UnsupportedFeatureError(
        f'{model_name(config)} has a vision tower, which attn_implementation="ring_sp" does not support yet for this '
        f"model type (how its image features reach the shard holding their tokens, and its token_type_ids masks, are "
        f"known for {sorted(KNOWN)}); train it with another attn_implementation, or on one sequence-parallel rank")


def batch_spans(model: VisionLanguageModel, token_type_ids: torch.Tensor) -> Spans:
    """GLOBAL spans of ``token_type_ids`` ``[b, N]`` laid end to end as one row of ``b * N``."""
    blocks = model.block_ids(token_type_ids)
    n = token_type_ids.shape[1]
    return tuple(x + row * n for row in range(blocks.shape[0]) for x in spans_from_block_ids(blocks[row]))


def image_ordinals(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``[b, N]``: 1 + the index of each image token among ALL image tokens of the batch in row-major
    order (the order of the model's ``masked_scatter``), 0 for other tokens: sharded like the ids."""
    is_image = input_ids == image_token_id
    return torch.where(is_image, is_image.reshape(-1).cumsum(0).view_as(input_ids), 0)


def shard_images(pixel_values: torch.Tensor, local_ordinals: torch.Tensor, total_tokens: int,
                 where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the pixel_values of the images with a token in the shard, the rows of their features
    ``[images * tokens, hidden]`` that are the shard's image tokens in local order).
    ``local_ordinals``: :func:`image_ordinals` as sharded (0: no image token)."""
    images = pixel_values.shape[0]
    if images == 0 or total_tokens % images:
        raise ValueError(f"{where}: {total_tokens} image tokens for {images} images in pixel_values; every image "
                         f"must have the same number of tokens")
    per_image = total_tokens // images
    ordinal = local_ordinals.reshape(-1)
    ordinal = ordinal[ordinal > 0] - 1
    image = ordinal // per_image
    used = torch.unique(image)
    if used.numel() == 0:  # no image token here: encode one image, keep none of it (zero gradients, not none)
        used = torch.zeros(1, dtype=torch.long, device=ordinal.device)
    rows = torch.searchsorted(used, image) * per_image + ordinal % per_image
    return pixel_values[used.to(pixel_values.device)], rows


_SELECTED: ContextVar[torch.Tensor | None] = ContextVar("ring_sp_image_tokens", default=None)


@contextmanager
def selected_tokens(rows: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, the projector hook keeps these image feature rows (None: all of them)."""
    token = _SELECTED.set(rows)
    try:
        yield
    finally:
        _SELECTED.reset(token)


def select_image_tokens(model: torch.nn.Module) -> None:
    """Install (once per model) the forward hook on a KNOWN model's projector that keeps only the
    image feature rows of :func:`selected_tokens` (see the module docstring)."""
    known = known_model(getattr(model, "config", None))
    if known is None or getattr(model, "_ring_sp_selects_image_tokens", False):
        return
    try:
        projector = model.get_submodule(known.projector)
    except AttributeError:
        return  # a text-only head of the family (no projector): nothing to select

    def keep_shard_tokens(module: torch.nn.Module, args: tuple, features: torch.Tensor) -> torch.Tensor:
        rows = _SELECTED.get()
        if rows is None:
            return features
        return features.reshape(-1, features.shape[-1])[rows.to(features.device)].unsqueeze(0)

    projector.register_forward_hook(keep_shard_tokens)
    model._ring_sp_selects_image_tokens = True


__all__ = ["IMAGE_TOKENS_KEY", "KNOWN", "LOCAL_ENCODERS", "VisionLanguageModel", "batch_spans", "image_ordinals",
           "known_model", "select_image_tokens", "selected_tokens", "shard_images", "vision_model_error"]
