"""Sharding a training batch for one sequence-parallel rank, packed documents included.

Labels are shifted BEFORE sharding: the target of the last token of a shard is the first
token of the next shard in global order, which only the unsharded batch still has. With
packed documents (``cu_seqlens``) labels are shifted inside each document (a token cannot
see the next document, so its last token gets no target) and positions restart at 0.

Any length: a batch whose length is not a multiple of the layout's unit
(:func:`ring_sp.layouts.layout_unit`) is padded at its END, and the padding is its own
document (``cu_seqlens`` gains one last boundary): no real token attends to it, its labels
are ignored, and ``gather_sequence(..., seq_len=real length)`` drops it again.

Failing together: :func:`sharded_together` runs a ``shard_batch``'s checks and sharding on this
rank, then (with an SP group) one agreement, so an error on one rank raises on every rank of
the group (the topology's ``shard_batch`` and the Hugging Face one both use it).

Checking a shard where it is used (no communication): :func:`shard_positions_error` says
whether positions are exactly those :func:`shard_batch` gives a rank (:func:`shard_positions`),
and :func:`token_checksum` fingerprints ids, labels or positions without a host sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .agreement import CallSignature, raise_together
from .layouts import (AUTO, DOCUMENT_LAYOUTS, LAYOUT_CHOICES, Boundaries, as_boundaries, check_boundaries, check_layout,
                      layout_index, layout_key, layout_unit, padded_length, rank_positions)
from .plan.layout_choice import choose_layout
from .sequence_shards import resolved_layout, shard_sequence
from .spans import as_spans, check_spans

IGNORE_INDEX = -100
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: spreads the weights of token_checksum


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


def token_checksum(values: torch.Tensor) -> torch.Tensor:
    """Order-sensitive int64 checksum of an integer tensor (ids, labels, positions): 0-d, on its
    device, no host sync. The same on every device and process (int64 arithmetic wraps alike)."""
    flat = values.reshape(-1).long() + 1  # zeros count too
    mixed = flat * (torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * _GOLDEN)
    return (mixed ^ (mixed >> 29)).sum()


@functools.lru_cache(maxsize=64)
def shard_positions(layout: str, world_size: int, global_len: int, boundaries: Boundaries | None, rank: int,
                    device: torch.device) -> torch.Tensor:
    """The ``position_ids`` :func:`shard_batch` gives ``rank`` (``[global_len / world_size]``, read-only):
    global positions in layout order, restarting at 0 in every document. Built from the rank's
    own runs, never a tensor of the whole row."""
    if boundaries is None:
        return layout_index(layout, world_size, global_len, layout_key(layout, boundaries), rank, device)
    # the rank's own positions (O(N/P)), never the whole row's document positions
    return rank_positions(layout, world_size, global_len, rank, boundaries, in_document=True).to(device)


def shard_positions_error(position_ids: torch.Tensor, *, layout: str, rank: int, world_size: int,
                          cu_seqlens: torch.Tensor | Sequence[int] | None = None, where: str = "the shard") -> ValueError | None:
    """None when ``position_ids`` ``[b, n]`` are exactly the positions :func:`shard_batch` gives SP
    rank ``rank`` of a batch of ``n x world_size`` tokens with documents ``cu_seqlens`` (global
    positions in layout order, restarting at 0 in every document), else the ``ValueError`` to
    raise: ``cu_seqlens`` dropped, added, of another batch or with a boundary moved, positions
    local or another rank's. Local (one host sync); the caller decides how to raise it
    (:func:`ring_sp.agreement.raise_at_next_agreement` for every rank)."""
    n = position_ids.shape[-1]
    boundaries = as_boundaries(cu_seqlens)
    try:
        layout = resolved_layout(layout, boundaries, n * world_size, world_size)
        check_layout(layout, world_size, n * world_size, name=f"{where}'s global length", cu_seqlens=boundaries)
        expected = shard_positions(layout, world_size, n * world_size, boundaries, rank, position_ids.device)
    except (TypeError, ValueError) as exc:
        return ValueError(f"{where}: cu_seqlens do not fit the shard of {n} tokens per rank on {world_size} ranks: {exc}")
    if position_ids.dim() == 2 and torch.equal(position_ids.long(), expected.expand_as(position_ids)):
        return None
    documents = f"restarting at 0 in each of the {len(boundaries) - 1} documents of cu_seqlens" if boundaries else \
        "0..N-1 over the whole row, as no cu_seqlens were given"
    return ValueError(
        f"{where}: position_ids are not the global positions layout={layout!r} puts on SP rank {rank} ({documents}): "
        f"cu_seqlens dropped, added, moved or of another batch, or positions local or another rank's; pass the "
        f"position_ids and cu_seqlens of this rank's shard_batch(batch, rank={rank}, world_size={world_size}, ...)")


def sharded_together(group: dist.ProcessGroup | None, batch: object, layout: object,
                     cut: Callable[[], dict[str, torch.Tensor]], *, validate: bool | None = None) -> dict[str, torch.Tensor]:
    """``cut()`` (a ``shard_batch``'s checks and sharding on this rank alone, no communication),
    its ``TypeError`` / ``ValueError`` raised on EVERY rank of ``group`` (the SP group; None or one
    rank: here alone): one agreement (:func:`ring_sp.agreement.raise_together`, the attention's)
    on the layout and the global batch's shape, so a user's error on one rank is that rank's
    message on all of them, never a peer left waiting in the model's first collective. No
    communication in a DataLoader worker (it has no process group: the loop that fetches the
    batches agrees, as the trainers do), with ``validate=False`` or ``RING_SP_VALIDATE=0``."""
    try:
        shard, error = cut(), None
    except (TypeError, ValueError) as exc:
        shard, error = None, exc
    if group is not None and dist.is_initialized() and torch.utils.data.get_worker_info() is None:
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        dims = tuple(ids.shape) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else (-1, -1)
        code = LAYOUT_CHOICES.index(layout) if layout in LAYOUT_CHOICES else -1
        signature = CallSignature.named("shard", (code, *dims), f"shard_batch(input_ids {dims}, layout={layout!r})")
        device = ids.device if isinstance(ids, torch.Tensor) else torch.device("cpu")
        raise_together(group, signature, error, validate=validate, device=device)
    elif error is not None:
        raise error
    return shard  # type: ignore[return-value]


def shard_batch(
    batch: Mapping[str, torch.Tensor],
    *,
    rank: int,
    world_size: int,
    layout: str = "zigzag",
    shift: bool = True,
    ignore_index: int = IGNORE_INDEX,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    pad_id: int = 0,
    spans: torch.Tensor | Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """This SP rank's shard of a ``[b, N]`` token batch, for ANY length ``N``.

    ``batch`` holds ``input_ids`` and optionally ``labels`` (default: ``input_ids``) and
    ``position_ids`` (default: ``0..N-1``, or the position inside each document when
    ``cu_seqlens`` is given); any other ``[b, N, ...]`` tensor (a loss mask, say) is
    sharded alike. With ``shift=True`` labels are next-token targets made by shifting left
    by one on the FULL sequence (Hugging Face convention: labels equal input_ids), inside
    each document when ``cu_seqlens`` is given; pass ``shift=False`` for labels that are
    already per-position targets (Megatron convention). ``rank`` is the SP layout rank
    (``topology.sp_rank``). ``cu_seqlens``: the document boundaries of the packed sequence
    (the same for every row of the batch), documents of any length.

    When ``N`` is not a multiple of :func:`ring_sp.layouts.layout_unit` (``2 x world_size``
    for zigzag, ``world_size`` otherwise) the batch is padded at its end to
    ``N_pad = padded_length(N, layout, world_size)``: ``input_ids`` with ``pad_id``, labels
    with ``ignore_index``, positions restarting at 0, other tensors with zeros. Returns
    ``[b, N_pad / world_size]`` tensors, plus ``"cu_seqlens"`` (int32 ``[docs + 1]``, the
    GLOBAL boundaries to pass to the attention, the padding as its own last document)
    whenever ``cu_seqlens`` was given or padding was added; for unpadded batches without
    documents there is no such key (nothing to pass).

    ``spans``: bidirectional spans of the batch (``[num_spans, 2]`` GLOBAL (start, stop) pairs
    inside the documents, the same for every row; :mod:`ring_sp.spans`), checked against
    ``N`` and ``cu_seqlens`` and returned as ``"spans"`` (int64 ``[num_spans, 2]``, unchanged by
    the tail padding) for the attention's ``spans=``.
    """
    if "input_ids" not in batch:
        raise ValueError(f"batch must contain 'input_ids'; got keys {sorted(batch)}")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be [batch, seq]; got shape {tuple(input_ids.shape)}")
    b, n = input_ids.shape
    if n == 0:
        raise ValueError("batch['input_ids'] has no tokens (shape[1] == 0); pass at least one token")
    real = boundaries = as_boundaries(cu_seqlens)  # the documents of the real tokens
    if real is not None:
        check_boundaries(real, n)
    span_pairs = as_spans(spans)
    if span_pairs is not None:
        check_spans(span_pairs, n, real)
    layout, padded, boundaries = _placed(layout, world_size, n, real)
    check_layout(layout, world_size, padded, name="batch['input_ids'].shape[1] (padded)", cu_seqlens=boundaries)
    full = dict(batch)
    labels = full.get("labels", input_ids)
    full["labels"] = shift_labels(labels, ignore_index, real) if shift else labels
    if "position_ids" not in full:
        positions = torch.arange(n, device=input_ids.device) if real is None else document_positions(real, input_ids.device)
        full["position_ids"] = positions.expand(b, n)
    fill = {"input_ids": pad_id, "labels": ignore_index}
    out = {}
    for key, value in full.items():
        if value.dim() < 2 or value.shape[:2] != (b, n):
            raise ValueError(f"batch[{key!r}] must start with [batch, seq] = [{b}, {n}]; got {tuple(value.shape)}")
        if padded > n:
            value = _pad_tail(value, padded - n, fill.get(key, 0), positions=key == "position_ids")
        out[key] = shard_sequence(value, rank=rank, world_size=world_size, layout=layout, dim=1, cu_seqlens=boundaries)
    if boundaries is not None:
        out["cu_seqlens"] = torch.tensor(boundaries, dtype=torch.int32, device=input_ids.device)
    if span_pairs is not None:
        out["spans"] = torch.tensor(span_pairs, dtype=torch.int64, device=input_ids.device).view(-1, 2)
    return out


def _placed(layout: str, world_size: int, n: int, real: Boundaries | None) -> tuple[str, int, Boundaries | None]:
    """(layout, padded length, boundaries) of a batch of ``n`` tokens with documents ``real``: the
    length rounded up to the layout's unit, the padding a document of its own. ``"auto"``:
    ``zigzag`` for a batch without documents whose length needs no padding; else the padded
    documents (the batch one document when it had none) and the placement
    :func:`ring_sp.plan.layout_choice.choose_layout` picks for them, which the attention,
    given the same ``cu_seqlens`` and ``layout="auto"``, picks alike."""
    if layout == AUTO:
        if real is None and n % layout_unit("zigzag", world_size) == 0:
            return "zigzag", n, None
        padded = padded_length(n, "document_balanced", world_size)
        boundaries = (real if real is not None else (0, n)) + ((padded,) if padded > n else ())
        return choose_layout(boundaries, world_size), padded, boundaries
    padded = padded_length(n, layout, world_size)
    if padded > n and (real is not None or layout not in DOCUMENT_LAYOUTS):  # the document layouts need documents
        return layout, padded, (real if real is not None else (0, n)) + (padded,)  # the padding: a document of its own
    return layout, padded, real


def _pad_tail(value: torch.Tensor, count: int, fill: int, *, positions: bool) -> torch.Tensor:
    """``value`` ``[b, N, ...]`` with ``count`` tokens appended along dim 1: ``fill``, or
    positions ``0..count-1`` (the padding document's own positions)."""
    tail = value.new_full((value.shape[0], count, *value.shape[2:]), fill)
    if positions:
        tail = torch.arange(count, device=value.device, dtype=value.dtype).view(1, count, *([1] * (value.dim() - 2))).expand_as(tail)
    return torch.cat((value, tail), dim=1)


def pad_documents(
    batch: Mapping[str, torch.Tensor],
    cu_seqlens: torch.Tensor | Sequence[int],
    multiple: int,
    *,
    pad_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[dict[str, torch.Tensor], tuple[int, ...]]:
    """Pad every document of a packed ``[b, N]`` batch to a multiple of ``multiple`` tokens,
    padding at each document's end. ``document_zigzag`` no longer needs it (it splits
    documents of any length); it remains for the per-document padding of TransformerEngine's
    THD format (``2 x CP``), which Megatron's THD RoPE requires.

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
