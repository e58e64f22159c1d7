"""Prompts of different lengths in one ``generate()`` call over the SP ranks: left padding.

transformers batches prompts of different lengths by padding each on the left and masking the
padding out (``attention_mask`` zeros; positions count from each prompt's first token). ring_sp
masks no keys, so :mod:`.generation` prefills each row alone (its prompt without the padding,
over the grid, into a cache of its own: :class:`.kv_cache.RingSPCache` ``rows``) and then decodes
the batch as one: each step runs the ``[b, 1]`` tokens through the model once, and each attention
layer attends row ``i`` to its own cache, every row's partials in ONE all-gather
(:func:`ring_sp.decode.decode_rows`). transformers' own loop does the rest (sampling from one
random stream, eos and padding of finished rows, scores, streamers), so the batch equals one
device's batched call: tokens, and logits within float rounding.

Refused by name with padding: a second turn (the first turn's cache holds the rows apart),
``prefill_chunk_size`` (a row's chunks are not cut), MLA's compressed cache (a row's shard is
returned whole to the module), and masks that are not left padding (a zero after a one, a row of
padding only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .features import UnsupportedFeatureError

# what a padded batch cannot run: (test on the generation config and keyword arguments, what)
_NOT_WITH_PADDING: tuple[tuple[Callable[[Any, dict[str, Any]], bool], str], ...] = (
    (lambda c, kw: kw.get("past_key_values") is not None and kw["past_key_values"].get_seq_length() > 0,
     "a second turn (the first turn's cache holds the rows apart)"),
    (lambda c, kw: kw.get("prefill_chunk_size") is not None, "prefill_chunk_size (each row is prefilled whole)"),
)


def prompt_mask(prompt: torch.Tensor, mask: Any, config: Any) -> torch.Tensor | None:
    """The attention mask ``generate()`` uses for ``prompt`` ``[b, n]``: the one given, or the one
    transformers infers (zeros at ``pad_token_id`` when it is in the prompt and is not an eos token);
    None when it has no zero."""
    if mask is None:
        pad = config.pad_token_id
        if pad is None or pad in _eos_ids(config) or not bool((prompt == pad).any()):
            return None
        mask = prompt != pad
    mask = torch.as_tensor(mask)
    return None if bool(mask.all()) else mask


def _eos_ids(config: Any) -> list[int]:
    """The config's eos token ids as a list (transformers takes None, one id or several)."""
    eos = config.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def left_pads(mask: torch.Tensor) -> list[int] | None:
    """Each row's padding when ``mask`` ``[b, n]`` is left padding (zeros, then at least one one), else None."""
    ones = mask.to(torch.bool)
    pads = (~ones).sum(dim=1)
    left = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) >= pads.unsqueeze(1)
    if not torch.equal(ones, left) or bool((pads == mask.shape[1]).any()):
        return None
    return pads.tolist()


def padding_error(where: str, mask: torch.Tensor | None, config: Any, kwargs: dict[str, Any],
                  latent: bool = False) -> Exception | None:
    """Why a prompt with ``mask`` cannot be generated exactly (None: it can, or it has no padding); ``latent``:
    the model caches MLA's compressed latents."""
    if mask is None:
        return None
    if mask.dim() != 2 or left_pads(mask) is None:
        return UnsupportedFeatureError(
            f"{where}: the prompt's attention_mask {tuple(mask.shape)} is not left padding (each row zeros, then "
            f"ones; or pad_token_id inside the prompt, which generate() masks out) and ring_sp does not mask keys; "
            f"pad prompts on the left (tokenizer.padding_side='left'), with a pad_token_id the prompts do not contain")
    refused = [what for test, what in _NOT_WITH_PADDING if test(config, kwargs)]
    if latent:
        refused.append("an MLA model's compressed cache (each row's shard goes back to the module whole)")
    if refused:
        return UnsupportedFeatureError(f"{where}: prompts of different lengths (left padding) on SP ranks cannot run "
                                       f"{refused[0]}; generate each prompt length as its own batch")
    return None


__all__ = ["left_pads", "padding_error", "prompt_mask"]
