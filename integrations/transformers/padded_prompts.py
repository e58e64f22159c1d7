"""Prompts of different lengths in one ``generate()`` call over the SP ranks: left padding.

transformers batches prompts of different lengths by padding each on the left and masking the
padding out (``attention_mask`` zeros; positions count from each prompt's first token). ring_sp
masks no keys, so :mod:`.generation` runs each row of such a batch alone: its prompt without the
padding, prefilled over the grid and decoded against a sharded cache of its own, with the batch's
``max_new_tokens``; the rows are then put together as transformers returns the batch (each row's
padding on the left as given, ``pad_token_id`` after a row that stopped early, the batch as long as
its longest row). Greedy tokens equal the batched call on one device (tested); the rows cost one
prefill and one decode loop each, not one for the batch.

What would make the rows differ from the batched call is refused by name: sampling (the batch
draws every row's token from one random stream), per-step outputs (scores, logits: kept per
call), a streamer (transformers' streamers take one row), ``min_length`` (counted with the
padding), and masks that are not left padding (a zero after a one, a row of padding only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .features import UnsupportedFeatureError

# generate()'s arguments a batch of padded prompts cannot run row by row exactly: (test, what, fix)
_NOT_ROW_BY_ROW: tuple[tuple[Callable[[Any, dict[str, Any]], bool], str], ...] = (
    (lambda c, kw: bool(c.do_sample), "do_sample=True (the batch samples every row from one random stream)"),
    (lambda c, kw: bool(c.return_dict_in_generate), "return_dict_in_generate (scores and logits per step)"),
    (lambda c, kw: kw.get("streamer") is not None, "a streamer (it takes one row)"),
    (lambda c, kw: (c.min_length or 0) > 0, "min_length (it counts the padding; use min_new_tokens)"),
    (lambda c, kw: kw.get("past_key_values") is not None and kw["past_key_values"].get_seq_length() > 0,
     "a second turn (the first turn's cache holds the rows together)"),
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


def padding_error(where: str, mask: torch.Tensor | None, config: Any, kwargs: dict[str, Any]) -> Exception | None:
    """Why a prompt with ``mask`` cannot be generated row by row exactly (None: it can, or it has no padding)."""
    if mask is None:
        return None
    if mask.dim() != 2 or left_pads(mask) is None:
        return UnsupportedFeatureError(
            f"{where}: the prompt's attention_mask {tuple(mask.shape)} is not left padding (each row zeros, then "
            f"ones; or pad_token_id inside the prompt, which generate() masks out) and ring_sp does not mask keys; "
            f"pad prompts on the left (tokenizer.padding_side='left'), with a pad_token_id the prompts do not contain")
    for refused, what in _NOT_ROW_BY_ROW:
        if refused(config, kwargs):
            return UnsupportedFeatureError(f"{where}: prompts of different lengths (left padding) run row by row on SP "
                                           f"ranks, which cannot reproduce {what}; generate each prompt length as its "
                                           f"own batch")
    return None


def generate_rows(generate_row: Callable[[dict[str, Any]], torch.Tensor], prompt: torch.Tensor, pads: list[int],
                  config: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """The batch ``prompt`` ``[b, n]`` (row ``i`` padded with ``pads[i]`` on the left) generated row by row:
    ``generate_row(kwargs)`` for each row's prompt alone, the rows put together as transformers' batched
    ``generate()`` returns them ``[b, n + new]``."""
    n = prompt.shape[1]
    new = config.max_new_tokens if config.max_new_tokens is not None else max(config.max_length - n, 0)
    rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs", "attention_mask", "max_length")}
    cache = kwargs.get("past_key_values")
    rows = []
    for i, pad in enumerate(pads):
        if cache is not None:  # a cache of the same size per row (the batch's was checked against n + new)
            rest["past_key_values"] = type(cache)(cache.limit, block=cache.block, chunk_exchange=cache.chunk_exchange)
        rows.append(generate_row({**rest, "input_ids": prompt[i:i + 1, pad:], "max_new_tokens": new}))
    width = max(pad + row.shape[1] for pad, row in zip(pads, rows))
    fill = config.pad_token_id
    if fill is None and _eos_ids(config):  # as transformers pads a stopped row without a pad token
        fill = _eos_ids(config)[0]
    out = prompt.new_full((len(pads), width), -1 if fill is None else fill)
    for i, (pad, row) in enumerate(zip(pads, rows)):
        out[i, :pad] = prompt[i, :pad]
        out[i, pad: pad + row.shape[1]] = row[0]
    if bool((out < 0).any()):  # rows of unequal length without a pad token: transformers would not stop early
        raise RuntimeError(f"the rows of a padded batch stopped at different lengths ({[r.shape[1] for r in rows]}) "
                           f"without a pad_token_id or eos_token_id to fill them with")
    return out


__all__ = ["generate_rows", "left_pads", "padding_error", "prompt_mask"]
