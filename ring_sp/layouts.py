"""Sequence layouts: which global token positions each sequence-parallel rank holds.

With ``P`` ranks and global length ``N`` (DESIGN.md section 3):

* ``contiguous``: rank i holds ``[i*N/P, (i+1)*N/P)``.
* ``zigzag`` (the default): ``2P`` equal chunks; rank i holds chunk i then chunk
  ``2P-1-i``. This is Megatron's ``get_batch_on_this_cp_rank`` convention.
* ``striped``: rank i holds tokens ``i, i+P, i+2P, ...``.
* ``document_zigzag`` (packed sequences): zigzag applied to EVERY document, for documents
  of ANY length: each document (boundaries ``cu_seqlens``) is split into ``2P`` chunks whose
  sizes differ by at most one token, and rank i holds chunks i and ``2P-1-i`` of each,
  documents in order. A document of ``L = 2P*c + e`` tokens has ``e`` chunks of ``c + 1``;
  those extra tokens are dealt round-robin over the ranks ACROSS documents (a running
  counter, first chunks then second chunks), so every rank holds the same number of tokens
  up to one, and exactly the same once the total is a multiple of ``P`` (pad the END of the
  sequence with fewer than ``P`` tokens, as its own document: :func:`ring_sp.shard_batch`
  does). A document whose length is a multiple of ``2P`` takes no extra token and is split
  exactly as before (TransformerEngine's THD partitioning). Causal work is balanced for
  any mix of document lengths (plain zigzag can be 2-3x off).

Everything else (sharding, gathering, the post-Ulysses reorder, the schedules, work counts)
is derived from one function, :func:`shard_runs`: the runs of global positions ONE rank holds
(over the SP group, or as a ring rank after the Ulysses all-to-all), so the layout is defined
exactly once and a rank builds and keeps only its own tokens' entries: O(N/P) positions plus
O(runs) metadata (runs: one or two per shard, two per document), never one per global token.
:func:`layout_positions` and :func:`ring_positions` (every rank's, O(N)) are for tools and tests.
In every layout a rank's local order is increasing in global position, so each document
occupies one contiguous run of a shard (the packed ring schedule relies on it).

A global length must be a multiple of the layout's unit (:func:`layout_unit`: ``2P`` for
zigzag, ``P`` otherwise); :func:`ring_sp.shard_batch` pads any length to it at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Reorder and Boundaries are imported from here by the runtime (ring_sp.function, ring_sp.ulysses, ...)
from .placement import document_placement
from .runs import Boundaries, Reorder, ShardRuns, document_slot_starts, memoised, sorted_reorder

LAYOUTS = ("contiguous", "zigzag", "striped", "document_zigzag", "document_balanced")
DOCUMENT_LAYOUTS = ("document_zigzag", "document_balanced")  # defined by the documents: they need cu_seqlens
AUTO = "auto"  # a layout chosen per batch (ring_sp.plan.layout_choice.resolve_layout)
LAYOUT_CHOICES = LAYOUTS + (AUTO,)  # what the user-facing entry points take



def as_boundaries(cu_seqlens: torch.Tensor | Sequence[int] | None) -> Boundaries | None:
    """``cu_seqlens`` (int tensor or sequence ``[num_docs + 1]``) as a tuple, or None.
    A CUDA tensor costs one device-to-host copy (once per call)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        return tuple(int(x) for x in cu_seqlens.tolist())
    return tuple(int(x) for x in cu_seqlens)


def check_boundaries(cu_seqlens: Boundaries, seq_len: int, *, name: str = "cu_seqlens") -> None:
    """``cu_seqlens`` must run from 0 to the global length ``seq_len``, never decreasing
    (an empty document, a repeated boundary, is allowed: padding schemes produce them)."""
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != seq_len:
        raise ValueError(
            f"{name} must start at 0 and end at the global sequence length {seq_len} "
            f"([num_docs + 1] document boundaries of the packed sequence); got {_short(cu_seqlens)}"
        )
    bad = next((i for i in range(1, len(cu_seqlens)) if cu_seqlens[i] < cu_seqlens[i - 1]), None)
    if bad is not None:
        raise ValueError(
            f"{name} must not decrease (document boundaries in order); "
            f"{name}[{bad - 1}]={cu_seqlens[bad - 1]} > {name}[{bad}]={cu_seqlens[bad]}"
        )


def _short(values: Sequence[int]) -> str:
    values = list(values)
    return str(values) if len(values) <= 12 else f"[{', '.join(map(str, values[:6]))}, ..., {', '.join(map(str, values[-3:]))}] ({len(values)} values)"


def layout_unit(layout: str, world_size: int) -> int:
    """The global length must be a multiple of this many tokens: ``2 * world_size`` for
    ``zigzag`` (two equal chunks per rank), ``world_size`` for the others (on one rank, 1).
    Raises ``ValueError`` for an unknown layout or ``world_size < 1``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    return 2 * world_size if layout == "zigzag" and world_size > 1 else world_size


def padded_length(seq_len: int, layout: str, world_size: int) -> int:
    """``seq_len`` rounded up to a multiple of :func:`layout_unit` (adds at most unit - 1)."""
    unit = layout_unit(layout, world_size)
    return -(-seq_len // unit) * unit


def check_layout(layout: str, world_size: int, seq_len: int, *, name: str = "seq_len",
                 cu_seqlens: Boundaries | None = None) -> None:
    """Raise ``ValueError`` unless ``layout`` can split ``seq_len`` tokens over ``world_size`` ranks
    (``document_zigzag`` also needs the document boundaries ``cu_seqlens``, of any lengths)."""
    multiple = layout_unit(layout, world_size)
    if seq_len % multiple != 0 or seq_len == 0:
        raise ValueError(
            f"{name}={seq_len} must be a positive multiple of {multiple} for layout={layout!r} "
            f"over {world_size} ranks; pad the sequence at its end to {padded_length(max(seq_len, 1), layout, world_size)} "
            f"tokens (ring_sp.shard_batch does it for any length, padding as its own document)"
        )
    if cu_seqlens is not None:
        check_boundaries(cu_seqlens, seq_len)
    if layout in DOCUMENT_LAYOUTS and cu_seqlens is None:
        raise ValueError(f"layout={layout!r} needs cu_seqlens (the document boundaries); pass cu_seqlens=")


@memoised(documents=64)  # a rank's schedule asks for every ring rank's runs
def _shard_runs(layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int,
                cu_seqlens: Boundaries | None) -> ShardRuns:
    u, r, p = ulysses_size, ring_rank, ulysses_size * ring_size

    def runs(starts: list[int], lengths: list[int], stride: int = 1) -> ShardRuns:
        return ShardRuns(torch.tensor(starts), torch.tensor(lengths), stride)

    if layout == "contiguous":
        return runs([r * (seq_len // ring_size)], [seq_len // ring_size])
    if layout == "striped":  # U > 1 only with R == 1 (check_grid_layout): then all tokens, in order
        return runs([r], [seq_len // ring_size], ring_size if u == 1 else 1)
    if p == 1:
        return runs([0], [seq_len])
    # ring rank r: slots rU .. rU+U-1 of the 2P and their mirror 2P-U(r+1) .. 2P-1-rU (U = 1: r and 2P-1-r)
    slots = (r * u, (r + 1) * u, 2 * p - (r + 1) * u, 2 * p - r * u)
    if layout == "zigzag":
        chunk = seq_len // (2 * p)
        return runs([slots[0] * chunk, slots[2] * chunk], [u * chunk, u * chunk])
    assert cu_seqlens is not None  # check_layout ran
    if layout == "document_balanced":  # the ring rank holds its U members' shards (the placement's runs)
        members = document_placement(cu_seqlens, p).runs[r * u:(r + 1) * u]
        if u == 1:
            return members[0]
        start, length = torch.cat([m.start for m in members]), torch.cat([m.length for m in members])
        order = start.argsort()
        return ShardRuns(start[order], length[order])
    a, a_end, b, b_end = document_slot_starts(cu_seqlens, p, slots)
    return ShardRuns(torch.stack((a, b), 1).flatten(), torch.stack((a_end - a, b_end - b), 1).flatten())


def _checked(layout: str, ulysses_size: int, ring_size: int, seq_len: int, rank: int, rank_name: str,
             cu_seqlens: torch.Tensor | Sequence[int] | None) -> Boundaries | None:
    """Validate a shard's arguments; the boundaries as the caches key them."""
    if ulysses_size < 1:
        raise ValueError(f"ulysses_size={ulysses_size} must be >= 1")
    if not 0 <= rank < ring_size:
        raise ValueError(f"{rank_name}={rank} must be in [0, {ring_size}) (the ranks of the layout)")
    boundaries = cu_seqlens if isinstance(cu_seqlens, tuple) else as_boundaries(cu_seqlens)
    return _checked_layout(layout, ulysses_size, ring_size, seq_len, boundaries)


@memoised(plain=64, documents=64)  # the schedule asks for every ring rank's runs: check each packing once
def _checked_layout(layout: str, ulysses_size: int, ring_size: int, seq_len: int,
                    cu_seqlens: Boundaries | None) -> Boundaries | None:
    boundaries = as_boundaries(cu_seqlens)
    check_grid_layout(layout, ulysses_size, ring_size)
    check_layout(layout, ulysses_size * ring_size, seq_len, cu_seqlens=boundaries)
    return layout_key(layout, boundaries)


def shard_runs(layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int,
               cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> ShardRuns:
    """What ring rank ``ring_rank`` holds after the Ulysses all-to-all over ``ulysses_size`` ranks
    (row ``ring_rank`` of :func:`ring_positions`; ``ulysses_size=1``: SP rank ``ring_rank``'s shard,
    row of :func:`layout_positions`) as :class:`ShardRuns`: O(runs), cached, read-only."""
    key = _checked(layout, ulysses_size, ring_size, seq_len, ring_rank, "ring_rank", cu_seqlens)
    return _shard_runs(layout, ulysses_size, ring_size, seq_len, ring_rank, key)


def rank_positions(layout: str, world_size: int, seq_len: int, rank: int,
                   cu_seqlens: torch.Tensor | Sequence[int] | None = None, *, in_document: bool = False) -> torch.Tensor:
    """Row ``rank`` of :func:`layout_positions` (LongTensor ``[seq_len // world_size]``), built from the
    rank's own runs: O(N/P) plus O(documents), never the other ranks'. ``in_document``: each
    position counted from its document's start (the ``position_ids`` :func:`ring_sp.shard_batch`
    gives; needs ``cu_seqlens``)."""
    positions = shard_runs(layout, 1, world_size, seq_len, rank, cu_seqlens).positions()
    if not in_document:
        return positions
    if cu_seqlens is None:
        raise ValueError("in_document=True needs cu_seqlens (the document boundaries); pass cu_seqlens=")
    starts = torch.tensor(as_boundaries(cu_seqlens))
    return positions - starts[torch.searchsorted(starts, positions, right=True) - 1]


@memoised(plain=16, documents=2)
def _positions(layout: str, world_size: int, seq_len: int, cu_seqlens: Boundaries | None) -> torch.Tensor:
    return torch.stack([_shard_runs(layout, 1, world_size, seq_len, r, cu_seqlens).positions() for r in range(world_size)])


def layout_positions(layout: str, world_size: int, seq_len: int,
                     cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Global positions held by EVERY rank: LongTensor ``[world_size, seq_len // world_size]``,
    row i listing rank i's tokens in its local order (increasing). Read-only (cached). O(N):
    for tools and tests; a rank asks for its own row with :func:`rank_positions`.
    ``cu_seqlens`` is only used by ``document_zigzag``."""
    key = _checked(layout, 1, world_size, seq_len, 0, "rank", cu_seqlens)
    return _positions(layout, world_size, seq_len, key)


def layout_key(layout: str, boundaries: Boundaries | None) -> Boundaries | None:
    """Only the document layouts depend on the documents: keep the caches of the others small."""
    return boundaries if layout in DOCUMENT_LAYOUTS else None


@memoised()
def _rank_index(layout: str, world_size: int, seq_len: int, cu_seqlens: Boundaries | None, rank: int,
                device: torch.device) -> torch.Tensor:
    return _shard_runs(layout, 1, world_size, seq_len, rank, cu_seqlens).positions().to(device)


def layout_index(layout: str, world_size: int, seq_len: int, cu_seqlens: Boundaries | None, rank: int | None,
                 device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s global positions on ``device`` (cached, O(N/P)), or with ``rank=None`` the
    permutation that puts all ranks' concatenated shards back in global order (O(N), built for
    the call and not kept; :func:`ulysses_to_ring_reorder` over all ranks does it in runs)."""
    if rank is not None:
        return _rank_index(layout, world_size, seq_len, cu_seqlens, rank, device)
    shards = [_shard_runs(layout, 1, world_size, seq_len, r, cu_seqlens).positions() for r in range(world_size)]
    return torch.cat(shards).argsort().to(device)


def check_grid_layout(layout: str, ulysses_size: int, ring_size: int) -> None:
    """The one layout that cannot feed a true ``U x R`` grid: after the all-to-all, a striped
    shard over ``U*R`` ranks is not a striped shard over ``R`` (the tokens are striped in
    groups of U). Pure, so configs can check it before any data exists."""
    if layout == "striped" and ulysses_size > 1 and ring_size > 1:
        raise ValueError(
            f"layout={layout!r} cannot be combined with ulysses_size={ulysses_size} and "
            f"ring_size={ring_size}: after the Ulysses all-to-all a ring rank does not hold a "
            f"{layout!r} shard of the ring. Use layout='zigzag' or 'contiguous' (or ring_size=1 "
            f"or ulysses_size=1)."
        )



@memoised(plain=16, documents=2)
def _ring_positions(layout: str, ulysses_size: int, ring_size: int, seq_len: int,
                    cu_seqlens: Boundaries | None) -> torch.Tensor:
    return torch.stack([_shard_runs(layout, ulysses_size, ring_size, seq_len, r, cu_seqlens).positions()
                        for r in range(ring_size)])


def ring_positions(layout: str, ulysses_size: int, ring_size: int, seq_len: int,
                   cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Global positions EVERY ring rank holds after the Ulysses all-to-all: LongTensor
    ``[ring_size, seq_len // ring_size]``, row r the union of the shards of its ``U`` members
    (``sp_rank = r * U + u``) in increasing order (O(N): for tools and tests; one rank's is
    :func:`shard_runs`). For ``contiguous``, ``zigzag`` and ``document_zigzag`` with documents of
    multiples of ``2 x SP`` tokens this is the layout over ``R`` ranks itself; in general
    each document is at most two runs of a ring shard (a ring rank holds the consecutive
    chunks ``rU .. rU+U-1`` and their mirror), which the packed schedule relies on."""
    key = _checked(layout, ulysses_size, ring_size, seq_len, 0, "ring_rank", cu_seqlens)
    return _ring_positions(layout, ulysses_size, ring_size, seq_len, key)


def ulysses_to_ring_order(layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int,
                          cu_seqlens: Boundaries | None = None) -> torch.Tensor | None:
    """Reorder that turns the Ulysses all-to-all output into the ring's shard, token by token.

    The layout is defined over the SP group with ``sp_rank = ring_rank * U + ulysses_rank``.
    After the all-to-all, ring rank ``r`` holds its ``U`` members' shards concatenated in
    Ulysses-rank order. Returns the index ``idx`` (LongTensor, length ``U * N / (U*R)``, built
    per call from the members' shards) with ``ring_shard = gathered[idx]`` in
    :func:`ring_positions` order (increasing), or None when no reorder is needed
    (``contiguous``, or U == 1). Raises ``ValueError`` for ``striped`` with U > 1 and R > 1,
    whose ring shard is no striped shard of the ring. The runtime keeps
    :func:`ulysses_to_ring_reorder`, the same permutation in runs.
    """
    _checked(layout, ulysses_size, ring_size, seq_len, ring_rank, "ring_rank", cu_seqlens)
    sp_size = ulysses_size * ring_size
    gathered = torch.cat([rank_positions(layout, sp_size, seq_len, ring_rank * ulysses_size + u, cu_seqlens)
                          for u in range(ulysses_size)])
    index = gathered.argsort()  # positions are distinct: the ring shard is the members' tokens in order
    return None if torch.equal(index, torch.arange(index.numel())) else index


def _members_reorder(layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int,
                     cu_seqlens: Boundaries | None, device: torch.device) -> Reorder | None:
    """The members' concatenated shards (Ulysses-rank order) -> the ring shard (increasing), from
    the members' runs alone: O(U x runs)."""
    u = ulysses_size
    if layout == "striped":  # U > 1 only with R == 1: the members hold every U-th token
        empty = torch.empty(0, dtype=torch.long, device=device)
        return Reorder(0, empty, empty, interleave=u) if 1 < u < seq_len else None  # one token each: in order
    members = [_shard_runs(layout, 1, u * ring_size, seq_len, ring_rank * u + x, cu_seqlens) for x in range(u)]
    return sorted_reorder(torch.cat([m.start for m in members]), torch.cat([m.length for m in members]), 2 * u, device)


@memoised()
def ulysses_to_ring_reorder(
    layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int, device: torch.device,
    cu_seqlens: Boundaries | None = None,
) -> Reorder | None:
    """:func:`ulysses_to_ring_order` as a :class:`Reorder` of runs, cached on ``device``. Over all
    SP ranks as one Ulysses group (``ulysses_size=P, ring_size=1``) it puts concatenated shards
    back in global order (:func:`ring_sp.unshard_sequence`)."""
    key = _checked(layout, ulysses_size, ring_size, seq_len, ring_rank, "ring_rank", cu_seqlens)
    return _members_reorder(layout, ulysses_size, ring_size, seq_len, ring_rank, key, device)
