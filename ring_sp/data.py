"""Sharding a training batch for one sequence-parallel rank, packed documents included.

Labels are shifted BEFORE sharding: the target of the last token of a shard is the first
token of the next shard in global order, which only the unsharded batch still has. With
packed documents (``cu_seqlens``) labels are shifted inside each document (a token cannot
see the next document, so its last token gets no target) and positions restart at 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .layouts import Boundaries, as_boundaries, check_boundaries, check_layout, shard_sequence

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                 cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """``[b, N]`` -> ``[b, N]`` where position t holds ``labels[:, t+1]``; the last position
    (of the sequence, or of every document when ``cu_seqlens`` is given) is ignored."""
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    boundaries = as_boundaries(cu_seqlens)
    if boundaries is not None:
        shifted[:, [end - 1 for end in boundaries[1:]]] = ignore_index
    return shifted


def document_positions(cu_seqlens: Boundaries, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[N]`` position of every token inside its document (restarts at 0 per document)."""
    starts = torch.tensor(cu_seqlens[:-1], device=device)
    lengths = torch.tensor([b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])], device=device)
    return torch.arange(cu_seqlens[-1], device=device) - starts.repeat_interleave(lengths)


def shard_batch(
    batch: Mapping[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    layout: str = "zigzag",
    shift: bool = True,
    ignore_index: int = IGNORE_INDEX,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """This SP rank's shard of a ``[b, N]`` token batch.

    ``batch`` holds ``input_ids`` and optionally ``labels`` (default: ``input_ids``) and
    ``position_ids`` (default: ``0..N-1``, or the position inside each document when
    ``cu_seqlens`` is given); any other ``[b, N, ...]`` tensor (a loss mask, say) is
    sharded alike. With ``shift=True`` labels are next-token targets made by shifting left
    by one on the FULL sequence (Hugging Face convention: labels equal input_ids), inside
    each document when ``cu_seqlens`` is given; pass ``shift=False`` for labels that are
    already per-position targets (Megatron convention). Returns ``[b, N / world_size]``
    tensors; ``rank`` is the SP layout rank (``topology.sp_rank``). ``cu_seqlens``: the
    document boundaries of the packed sequence (the same for every row of the batch).
    """
    if "input_ids" not in batch:
        raise ValueError(f"batch must contain 'input_ids'; got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [batch, seq]; got shape {tuple(input_ids.shape)}")
    b, n = input_ids.shape
    boundaries = as_boundaries(cu_seqlens)
    check_layout(layout, world_size, n, name="batch['input_ids'].shape[1]", cu_seqlens=boundaries)
    full = dict(batch)
    labels = full.get("labels", input_ids)
    full["labels"] = shift_labels(labels, ignore_index, boundaries) if shift else labels
    if "position_ids" not in full:
        positions = torch.arange(n, device=input_ids.device) if boundaries is None else document_positions(boundaries, input_ids.device)
        full["position_ids"] = positions.expand(b, n)
    out = {}
    for key, value in full.items():
        if value.dim() < 2 or value.shape[:2] != (b, n):
            raise ValueError(f"batch[{key!r}] must start with [batch, seq] = [{b}, {n}]; got {tuple(value.shape)}")
        out[key] = shard_sequence(value, rank=rank, world_size=world_size, layout=layout, dim=1, cu_seqlens=boundaries)
    return out


def pad_documents(
    batch: Mapping[str, torch.Tensor],
    cu_seqlens: torch.Tensor | Sequence[int],
    multiple: int,
    *,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """Pad every document of a packed ``[b, N]`` batch to a multiple of ``multiple`` tokens
    (``2 x SP size`` for ``layout="document_zigzag"``), padding at each document's end.

    ``input_ids`` get ``pad_id``; ``labels`` (default: ``input_ids``) get ``ignore_index``
    so padding never enters the loss (call before :func:`shard_batch`, whose in-document
    shift then gives the last real token of a document no target either); other tensors
    get zeros. Returns the padded batch and the new boundaries.
    """
    boundaries = as_boundaries(cu_seqlens)
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    check_boundaries(boundaries, batch["input_ids"].shape[1])
    source, new_boundaries = [], [0]
    for a, b in zip(boundaries, boundaries[1:]):
        padded = -(b - a) // multiple * -multiple
        source.extend(range(a, b))
        source.extend([-1] * (padded - (b - a)))
        new_boundaries.append(new_boundaries[-1] + padded)
    index = torch.tensor(source, device=batch["input_ids"].device)
    is_pad = index < 0
    full = dict(batch)
    full.setdefault("labels", batch["input_ids"])
    fill = {"input_ids": pad_id, "labels": ignore_index}
    out = {}
    for key, value in full.items():
        taken = value.index_select(1, index.clamp(min=0))
        mask = is_pad.view(1, -1, *([1] * (value.dim() - 2)))
        out[key] = taken.masked_fill(mask, fill.get(key, 0))
    return out, tuple(new_boundaries)
