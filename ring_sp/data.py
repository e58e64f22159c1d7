"""Sharding a training batch for one sequence-parallel rank.

Labels are shifted BEFORE sharding: the target of the last token of a shard is the first
token of the next shard in global order, which only the unsharded batch still has.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .layouts import check_layout, shard_sequence

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``[b, N]`` -> ``[b, N]`` where position t holds ``labels[:, t+1]`` and the last is ignored."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def shard_batch(
    batch: Mapping[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    layout: str = "zigzag",
    shift: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, torch.Tensor]:
    """This SP rank's shard of a ``[b, N]`` token batch.

    ``batch`` holds ``input_ids`` and optionally ``labels`` (default: ``input_ids``) and
    ``position_ids`` (default: ``0..N-1``); any other ``[b, N, ...]`` tensor (a loss mask,
    say) is sharded alike. With ``shift=True`` labels are next-token targets made by
    shifting left by one on the FULL sequence (Hugging Face convention: labels equal
    input_ids); pass ``shift=False`` for labels that are already per-position targets
    (Megatron convention). Returns ``[b, N / world_size]`` tensors; ``rank`` is the SP
    layout rank (``topology.sp_rank``).
    """
    if "input_ids" not in batch:
        raise ValueError(f"batch must contain 'input_ids'; got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [batch, seq]; got shape {tuple(input_ids.shape)}")
    b, n = input_ids.shape
    check_layout(layout, world_size, n, name="batch['input_ids'].shape[1]")
    full = dict(batch)
    labels = full.get("labels", input_ids)
    full["labels"] = shift_labels(labels, ignore_index) if shift else labels
    if "position_ids" not in full:
        full["position_ids"] = torch.arange(n, device=input_ids.device).expand(b, n)
    out = {}
    for key, value in full.items():
        if value.dim() < 2 or value.shape[:2] != (b, n):
            raise ValueError(f"batch[{key!r}] must start with [batch, seq] = [{b}, {n}]; got {tuple(value.shape)}")
        out[key] = shard_sequence(value, rank=rank, world_size=world_size, layout=layout, dim=1)
    return out
