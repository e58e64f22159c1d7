"""A shard knows where it belongs: the fingerprint :func:`shard_batch` adds, and the checks.

A malformed shard must fail, never compute a wrong number. What the attention can see of a
shard is its ``position_ids``, ``cu_seq_lens_q/k`` and bidirectional spans (``"ring_sp_spans"``);
what it cannot see is which batch, rank, topology and layout the shard was cut for, nor its
tokens and labels. So :func:`..shard_batch` adds one more key, ``"ring_sp_shard"`` (int64
``[12]``, passed through ``model(**shard)`` to the attention like ``cu_seq_lens_*``), which the
checks compare:

* in the attention (:func:`check_shard`, once per forward, before the first collective):
  the SP size and this rank's SP rank (a shard of another topology, or another rank's), the
  layout, the document boundaries (``cu_seq_lens_*`` dropped, corrupted, or added), the spans
  (dropped, added, another batch's), the global length (a shard cut from another batch, or
  truncated), a checksum of the positions (``position_ids`` dropped, shifted, or another rank's);
* in the attention's agreement, on every call (:func:`agreed_values`): the global batch the
  shard was cut from, the same on every rank (a rank fed another batch);
* in the model's forward (:func:`inputs_error`, installed by ``register``): a checksum of
  the shard's ``input_ids`` and, when given, ``shift_labels`` (another rank's, or unshifted),
  and of a vision-language shard's images (the shape of ``pixel_values`` and the image token
  rows: dropped, or another rank's);
* in ``causal_lm_loss`` (:func:`loss_labels_error` with the fingerprint of the forward that made
  the logits, :func:`fingerprint_of`): the labels' checksum.

A shard built by hand has no fingerprint; then the positions must be exactly the GLOBAL
ones the layout puts on this rank (``0..N-1`` over the whole row, or restarting at 0 in
every document of ``cu_seq_lens``), which catches packed positions without
``cu_seq_lens``, ``cu_seq_lens`` that do not match the restarts, local positions and
another rank's shard. One host sync per forward either way.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch

from ring_sp import LAYOUT_CHOICES, SequenceParallelTopology
from ring_sp.agreement import _checksum
from ring_sp.data import shard_positions, token_checksum
from ring_sp.layouts import Boundaries, check_layout
from ring_sp.spans import Spans

SHARD_KEY = "ring_sp_shard"
SPANS_KEY = "ring_sp_spans"  # the batch's bidirectional spans, int64 [num_spans, 2] GLOBAL (start, stop)
IMAGE_TOKENS_KEY = "ring_sp_image_tokens"  # int64 [image tokens of the shard]: rows of the local images' features
_MAGIC = 0x525350  # "RSP": tells a fingerprint from any other int64 tensor
_FIELDS = ("magic", "sp_size", "sp_rank", "layout", "global_len", "documents", "positions", "tokens", "labels", "batch",
           "spans", "images")
_AGREED = [_FIELDS.index(name) for name in ("global_len", "layout", "batch")]  # ring_sp.agreement.SHARD_WIDTH values
_FIX = "pass the whole shard of ring_sp.integrations.transformers.shard_batch(batch, topology): model(**shard)"
_recent: deque[tuple[weakref.ref, torch.Tensor]] = deque(maxlen=16)  # (logits, fingerprint) of recent forwards


def positions_checksum(position_ids: torch.Tensor) -> torch.Tensor:
    """Order-sensitive int64 checksum of ``[b, n]`` positions (0-d, on their device; no sync)."""
    return token_checksum(position_ids)


def batch_checksum(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The checksum of a GLOBAL batch (its ids and unshifted labels): equal on every rank given it."""
    return token_checksum(input_ids) * 1000003 + token_checksum(labels)


def images_checksum(pixel_values: object, rows: object) -> torch.Tensor | None:
    """Checksum of a shard's images: the shape of ``pixel_values`` (how many images, their size)
    and the image token ``rows`` (0-d, no host sync); None when the call has neither. Not the
    pixels themselves: a cast to the model's dtype (the Trainer's under DeepSpeed) must pass."""
    if not isinstance(pixel_values, torch.Tensor) and not isinstance(rows, torch.Tensor):
        return None
    shape = torch.tensor(pixel_values.shape if isinstance(pixel_values, torch.Tensor) else (-1,))
    rows_sum = token_checksum(rows).cpu() if isinstance(rows, torch.Tensor) else torch.tensor(-1)
    return token_checksum(shape) * 1000003 + rows_sum


def fingerprint(*, sp_size: int, sp_rank: int, layout: str, global_len: int, boundaries: Boundaries | None,
                position_ids: torch.Tensor, input_ids: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, batch: torch.Tensor | None = None,
                spans: Spans | None = None, images: torch.Tensor | None = None) -> torch.Tensor:
    """The ``"ring_sp_shard"`` entry: int64 ``[12]`` on the positions' device (-1: not recorded)."""
    head = torch.tensor([_MAGIC, sp_size, sp_rank, LAYOUT_CHOICES.index(layout), global_len, _checksum(boundaries), 0, -1, -1, -1,
                         _checksum(spans), -1], dtype=torch.int64, device=position_ids.device)
    head[6] = positions_checksum(position_ids)
    for field, value in (("tokens", input_ids), ("labels", shift_labels)):
        if value is not None:
            head[_FIELDS.index(field)] = token_checksum(value)
    if images is not None:
        head[_FIELDS.index("images")] = images
    if batch is not None:
        head[_FIELDS.index("batch")] = batch
    return head


def _valid(mark: object) -> bool:
    return isinstance(mark, torch.Tensor) and mark.shape == (len(_FIELDS),) and mark.dtype == torch.int64


def agreed_values(mark: object) -> torch.Tensor | None:
    """What every rank's fingerprint must share (global length, layout, global batch), for
    :func:`ring_sp.agreement.shard_values`; None without a (well-formed) fingerprint."""
    return mark[_AGREED] if _valid(mark) else None


def remember(logits: object, mark: object) -> None:
    """Note that ``logits`` came from a forward on the shard of fingerprint ``mark``."""
    if isinstance(logits, torch.Tensor) and _valid(mark):
        _recent.append((weakref.ref(logits), mark))


def fingerprint_of(logits: torch.Tensor) -> torch.Tensor | None:
    """The fingerprint of the shard a recent forward made ``logits`` from (the same tensor), or None."""
    return next((mark for ref, mark in reversed(_recent) if ref() is logits), None)


def _local_positions(position_ids: torch.Tensor) -> bool:
    return bool((position_ids == torch.arange(position_ids.shape[-1], device=position_ids.device)).all())


def _positions_error(where: str, position_ids: torch.Tensor | None, what: str) -> ValueError:
    if position_ids is not None and position_ids.shape[-1] > 1 and _local_positions(position_ids):
        return ValueError(
            f"{where}: position_ids are 0..{position_ids.shape[-1] - 1}, the shard's LOCAL positions (dropped from the "
            f"shard?), so RoPE would be wrong; pass the GLOBAL positions: {_FIX} (it holds position_ids)")
    return ValueError(f"{where}: position_ids {what}; {_FIX}")


def inputs_error(mark: object, input_ids: object, shift_labels: object, where: str,
                 images: torch.Tensor | None = None) -> ValueError | None:
    """The model-level check: ``input_ids`` (and ``shift_labels`` when given to the model, and the
    :func:`images_checksum` of its images) are the ones the fingerprint was cut with. None
    without a fingerprint. One host sync."""
    if not _valid(mark) or not isinstance(input_ids, torch.Tensor):
        return None
    seen = {"tokens": token_checksum(input_ids), "images": torch.tensor(-1) if images is None else images}
    if isinstance(shift_labels, torch.Tensor):
        seen["labels"] = token_checksum(shift_labels)
    values = torch.cat((mark, torch.stack([v.to(mark.device) for v in seen.values()]))).tolist()  # the one host sync
    got, seen = dict(zip(_FIELDS, values)), dict(zip(seen, values[len(_FIELDS):]))
    if got["global_len"] != input_ids.shape[-1] * got["sp_size"]:
        return None  # a shard of another length: the attention's check_shard names it better
    if got["tokens"] != -1 and seen["tokens"] != got["tokens"]:
        return ValueError(f"{where}: input_ids are not the shard's: its {SHARD_KEY!r} was cut for other tokens (input_ids "
                          f"of another rank's shard, or of another batch); {_FIX}")
    if seen["images"] != got["images"]:
        return ValueError(f"{where}: pixel_values and {IMAGE_TOKENS_KEY!r} are not the shard's (dropped, or another rank's: "
                          f"its image features would land on other tokens); {_FIX}")
    return None if "labels" not in seen else _labels_mismatch(got, seen["labels"], "given to the model", where)


def loss_labels_error(mark: torch.Tensor, shift_labels: torch.Tensor, where: str) -> ValueError | None:
    """``shift_labels`` passed to the loss are those of the shard (fingerprint ``mark``) the logits
    were made from. One host sync."""
    values = torch.cat((mark, token_checksum(shift_labels).view(1).to(mark.device))).tolist()  # the one host sync
    return _labels_mismatch(dict(zip(_FIELDS, values)), values[-1], "given to the loss", where)


def _labels_mismatch(got: dict[str, int], seen: int, role: str, where: str) -> ValueError | None:
    if got["labels"] == -1 or seen == got["labels"]:
        return None
    if seen == got["tokens"]:
        return ValueError(
            f"{where}: the shift_labels {role} equal the shard's input_ids: UNSHIFTED labels (shift_labels[t] must be the "
            f"token at t + 1, shifted on the whole sequence before sharding); pass shard['shift_labels'] of shard_batch")
    return ValueError(f"{where}: the shift_labels {role} are not the shard's (another rank's shard's, another batch's, or "
                      f"shifted differently); pass shard['shift_labels'] of the same shard_batch as the model's inputs")


def check_shard(mark: object, position_ids: torch.Tensor | None, *, batch: int, local_len: int, layout: str,
                boundaries: Boundaries | None, topology: SequenceParallelTopology, where: str,
                spans: Spans | None = None) -> None:
    """Raise ``ValueError`` unless this call's shard is the one this rank must run (module docstring).

    ``mark``: the call's ``"ring_sp_shard"`` (None for a hand-built shard); ``position_ids``
    ``[b or 1, n]`` as the attention got them; ``layout``/``boundaries``/``spans``: what the call
    will run (the registered layout, document-aware with ``cu_seq_lens``). Local: no collective.
    """
    sp_size, sp_rank = topology.sp_size, topology.sp_rank
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[-1] != local_len):
        position_ids = None  # not [b, n] (e.g. 3-D multimodal RoPE ids): nothing to compare
    if position_ids is not None:
        position_ids = position_ids.expand(batch, local_len)
    if mark is None:
        if sp_size > 1 and position_ids is not None:
            _check_hand_built(position_ids, layout, boundaries, topology, where)
        return
    if not _valid(mark):
        raise TypeError(f"{where}: {SHARD_KEY!r} must be the int64 [{len(_FIELDS)}] tensor shard_batch makes; got "
                        f"{type(mark).__name__}; {_FIX}")
    if position_ids is not None:  # one host sync for everything
        mark = torch.cat((mark, positions_checksum(position_ids).view(1).to(mark.device)))
    got = dict(zip(_FIELDS + ("seen",), mark.tolist()))
    if got["magic"] != _MAGIC:
        raise ValueError(f"{where}: {SHARD_KEY!r} is not a shard fingerprint; {_FIX}")
    if got["sp_size"] != sp_size:
        raise ValueError(
            f"{where}: the shard was cut for {got['sp_size']} sequence-parallel ranks (shard_batch with another "
            f"topology) but ring_sp runs on {sp_size} (ulysses x ring = {topology.ulysses_size} x "
            f"{topology.ring_size}); shard with the registered topology")
    if got["sp_rank"] != sp_rank:
        raise ValueError(
            f"{where}: this rank (SP rank {sp_rank}) was given the shard of SP rank {got['sp_rank']} (shards swapped "
            f"between ranks?); every rank passes shard_batch(batch, topology) of the SAME global batch")
    documents = _checksum(boundaries)
    if got["documents"] != documents:
        if boundaries is None:
            raise ValueError(f"{where}: the shard holds packed documents but cu_seq_lens_q/k were not passed (without "
                             f"them documents would see each other); {_FIX}")
        if got["documents"] == -1:
            raise ValueError(f"{where}: cu_seq_lens_q/k were passed but the shard was cut without documents; {_FIX}")
        raise ValueError(f"{where}: cu_seq_lens_q/k do not match the documents the shard was cut with; {_FIX}")
    if got["spans"] != _checksum(spans):
        what = ("holds bidirectional spans (images) but the attention got none" if spans is None else
                "holds no bidirectional spans but the attention got some" if got["spans"] == -1 else
                "was cut with other bidirectional spans than the attention got")
        raise ValueError(f"{where}: the shard {what} ({SPANS_KEY!r} dropped, added or of another batch); {_FIX}")
    shard_layout = LAYOUT_CHOICES[got["layout"]] if 0 <= got["layout"] < len(LAYOUT_CHOICES) else got["layout"]
    if shard_layout != layout:
        raise ValueError(
            f"{where}: the shard was cut with layout={shard_layout!r} but the attention runs layout={layout!r} "
            f"(register() was given another layout); shard with the layout given to register()")
    if got["global_len"] != local_len * sp_size:
        raise ValueError(
            f"{where}: the shard holds {local_len} tokens per rank, so {local_len * sp_size} in all, but it was cut from "
            f"a batch of {got['global_len']} (inputs truncated, or taken from another shard); {_FIX}")
    if position_ids is not None and got["seen"] != got["positions"]:
        raise _positions_error(where, position_ids, "are not the shard's (GLOBAL, in layout order): dropped, shifted "
                                                    "or another rank's")


def _check_hand_built(position_ids: torch.Tensor, layout: str, boundaries: Boundaries | None,
                      topology: SequenceParallelTopology, where: str) -> None:
    """A shard without fingerprint: the positions must be exactly the global ones of this rank."""
    global_len = position_ids.shape[-1] * topology.sp_size
    check_layout(layout, topology.sp_size, global_len, cu_seqlens=boundaries)
    expected = shard_positions(layout, topology.sp_size, global_len, boundaries, topology.sp_rank, position_ids.device)
    if not torch.equal(position_ids.long(), expected.expand_as(position_ids)):
        documents = "restarting at 0 in every document of cu_seq_lens_q" if boundaries is not None else \
            "0..N-1 over the whole row (positions restarting inside the row need cu_seq_lens_q/k)"
        raise _positions_error(where, position_ids, f"are not this rank's global positions under layout={layout!r} "
                                                    f"({documents})")


__all__ = ["IMAGE_TOKENS_KEY", "SHARD_KEY", "SPANS_KEY", "images_checksum", "agreed_values", "batch_checksum", "check_shard", "fingerprint", "fingerprint_of", "inputs_error",
           "loss_labels_error", "positions_checksum", "remember"]
