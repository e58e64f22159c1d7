"""A shard knows where it belongs: the fingerprint :func:`shard_batch` adds, and the checks.

A malformed shard must fail, never compute a wrong number. What the attention can see of a
shard is its ``position_ids`` and ``cu_seq_lens_q/k``; what it cannot see is which batch,
rank, topology and layout the shard was cut for. So :func:`..shard_batch` adds one more
key, ``"ring_sp_shard"`` (int64 ``[7]``, passed through ``model(**shard)`` to the attention
like ``cu_seq_lens_*``), and :func:`check_shard` compares it with the call, once per
forward, before the first collective:

* the SP size and this rank's SP rank (a shard of another topology, or another rank's);
* the layout (``shard_batch`` with another layout than the registration's);
* the document boundaries (``cu_seq_lens_*`` dropped, corrupted, or added);
* the global length (a shard cut from another batch, or truncated);
* a checksum of the positions (``position_ids`` dropped, so transformers numbers the
  shard 0..n-1, shifted, or another rank's).

A shard built by hand has no fingerprint; then the positions must be exactly the GLOBAL
ones the layout puts on this rank (``0..N-1`` over the whole row, or restarting at 0 in
every document of ``cu_seq_lens``), which catches packed positions without
``cu_seq_lens``, ``cu_seq_lens`` that do not match the restarts, local positions and
another rank's shard. One host sync per forward either way.
"""

from __future__ import annotations

import torch

from ring_sp import LAYOUTS, SequenceParallelTopology
from ring_sp.agreement import _checksum
from ring_sp.data import document_positions
from ring_sp.layouts import Boundaries, layout_positions

SHARD_KEY = "ring_sp_shard"
_MAGIC = 0x525350  # "RSP": tells a fingerprint from any other int64 [7] tensor
_FIELDS = ("magic", "sp_size", "sp_rank", "layout", "global_len", "documents", "positions")
_FIX = "pass the whole shard of ring_sp.integrations.transformers.shard_batch(batch, topology): model(**shard)"


def positions_checksum(position_ids: torch.Tensor) -> torch.Tensor:
    """Order-sensitive int64 checksum of ``[b, n]`` positions (0-d, on their device; no sync)."""
    weights = torch.arange(1, position_ids.numel() + 1, device=position_ids.device, dtype=torch.int64)
    return (position_ids.reshape(-1).long() * weights).sum()  # int64 wraps alike on both sides


def fingerprint(*, sp_size: int, sp_rank: int, layout: str, global_len: int, boundaries: Boundaries | None,
                position_ids: torch.Tensor) -> torch.Tensor:
    """The ``"ring_sp_shard"`` entry: int64 ``[7]`` on the positions' device."""
    head = torch.tensor([_MAGIC, sp_size, sp_rank, LAYOUTS.index(layout), global_len, _checksum(boundaries), 0],
                        dtype=torch.int64, device=position_ids.device)
    head[6] = positions_checksum(position_ids)
    return head


def _local_positions(position_ids: torch.Tensor) -> bool:
    return bool((position_ids == torch.arange(position_ids.shape[-1], device=position_ids.device)).all())


def _positions_error(where: str, position_ids: torch.Tensor | None, what: str) -> ValueError:
    if position_ids is not None and position_ids.shape[-1] > 1 and _local_positions(position_ids):
        return ValueError(
            f"{where}: position_ids are 0..{position_ids.shape[-1] - 1}, the shard's LOCAL positions (dropped from the "
            f"shard?), so RoPE would be wrong; pass the GLOBAL positions: {_FIX} (it holds position_ids)")
    return ValueError(f"{where}: position_ids {what}; {_FIX}")


def check_shard(mark: object, position_ids: torch.Tensor | None, *, batch: int, local_len: int, layout: str,
                boundaries: Boundaries | None, topology: SequenceParallelTopology, where: str) -> None:
    """Raise ``ValueError`` unless this call's shard is the one this rank must run (module docstring).

    ``mark``: the call's ``"ring_sp_shard"`` (None for a hand-built shard); ``position_ids``
    ``[b or 1, n]`` as the attention got them; ``layout``/``boundaries``: what the call will
    run (the registered layout, document-aware with ``cu_seq_lens``). Local: no collective.
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
    if not isinstance(mark, torch.Tensor) or mark.shape != (len(_FIELDS),) or mark.dtype != torch.int64:
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
    shard_layout = LAYOUTS[got["layout"]] if 0 <= got["layout"] < len(LAYOUTS) else got["layout"]
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
    index = layout_positions(layout, topology.sp_size, global_len, boundaries)[topology.sp_rank]
    expected = index if boundaries is None else document_positions(boundaries)[index]
    if not torch.equal(position_ids, expected.to(position_ids.device).expand_as(position_ids)):
        documents = "restarting at 0 in every document of cu_seq_lens_q" if boundaries is not None else \
            "0..N-1 over the whole row (positions restarting inside the row need cu_seq_lens_q/k)"
        raise _positions_error(where, position_ids, f"are not this rank's global positions under layout={layout!r} "
                                                    f"({documents})")


__all__ = ["SHARD_KEY", "check_shard", "fingerprint", "positions_checksum"]
