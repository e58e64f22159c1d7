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

Everything else (sharding, gathering, the post-Ulysses reorder, work counts) is derived
from one function, :func:`layout_positions`, so the layout is defined exactly once.
In every layout a rank's local order is increasing in global position, so each document
occupies one contiguous run of a shard (the packed ring schedule relies on it).

A global length must be a multiple of the layout's unit (:func:`layout_unit`: ``2P`` for
zigzag, ``P`` otherwise); :func:`ring_sp.shard_batch` pads any length to it at the end.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag", "striped", "document_zigzag")

# Document boundaries of the global packed sequence, as a hashable tuple (0, ..., N).
Boundaries = tuple[int, ...]


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
    if layout == "document_zigzag" and cu_seqlens is None:
        raise ValueError("layout='document_zigzag' needs cu_seqlens (the document boundaries); pass cu_seqlens=")


def _cached(fn):
    """Memoise ``fn``: plain layouts in a roomy cache, entries keyed by document boundaries
    (a new packing can arrive every step, each entry O(N)) in a small one."""
    plain, documents = functools.lru_cache(maxsize=256)(fn), functools.lru_cache(maxsize=8)(fn)

    @functools.wraps(fn)
    def call(*args):
        return (documents if any(isinstance(a, tuple) for a in args) else plain)(*args)

    return call


@_cached
def _positions(layout: str, world_size: int, seq_len: int, cu_seqlens: Boundaries | None) -> torch.Tensor:
    if layout == "contiguous":
        return torch.arange(seq_len).view(world_size, -1)
    if layout == "zigzag":
        return _zigzag(torch.arange(seq_len), world_size)
    if layout == "document_zigzag":
        assert cu_seqlens is not None  # check_layout ran
        return _document_zigzag(cu_seqlens, world_size)
    # striped: token t lives on rank t % P at local index t // P
    return torch.arange(seq_len).view(-1, world_size).t().contiguous()


def _zigzag(tokens: torch.Tensor, world_size: int) -> torch.Tensor:
    """[P, len/P]: rank i gets chunks i and 2P-1-i of ``tokens`` split into 2P chunks."""
    if world_size == 1:
        return tokens.view(1, -1)
    chunks = tokens.view(2 * world_size, -1)
    ranks = torch.arange(world_size)
    return torch.cat([chunks[ranks], chunks[2 * world_size - 1 - ranks]], dim=1)


def _document_zigzag(cu_seqlens: Boundaries, world_size: int) -> torch.Tensor:
    """[P, N/P]: every document split into ``2P`` chunks of ``c`` or ``c + 1`` tokens, rank
    i holding chunks i and ``2P-1-i`` of each (module docstring). Vectorised over documents."""
    p2 = 2 * world_size
    lengths = torch.tensor(cu_seqlens).diff()
    base, extra = lengths // p2, lengths % p2
    # The k-th extra token of the whole sequence goes to slot order[k % 2P]: the first chunks
    # of ranks 0..P-1, then their second chunks, so rank(order[k]) = k % P (counts differ by
    # at most one at every point) and a document's extras land in distinct chunks (e < 2P).
    start = extra.cumsum(0) - extra  # extras dealt before each document
    k = torch.arange(p2)
    order = torch.where(k < world_size, k, 3 * world_size - 1 - k)  # k-th slot of the cycle
    in_window = (k.unsqueeze(0) - start.unsqueeze(1)) % p2 < extra.unsqueeze(1)  # [docs, 2P], by cycle index
    sizes = base.unsqueeze(1).expand(-1, p2).clone()
    sizes[:, order] += in_window.long()  # [docs, 2P] chunk sizes, by slot
    slot = torch.arange(p2).repeat(len(lengths)).repeat_interleave(sizes.reshape(-1))  # slot of every token
    rank = torch.minimum(slot, p2 - 1 - slot)
    # tokens of one rank keep their global order (stable sort): chunk i, then chunk 2P-1-i, per document
    return torch.sort(rank, stable=True).indices.view(world_size, -1)


def layout_positions(layout: str, world_size: int, seq_len: int,
                     cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Global positions held by each rank: LongTensor ``[world_size, seq_len // world_size]``,
    row i listing rank i's tokens in its local order (increasing). Read-only (cached).
    ``cu_seqlens`` is only used by ``document_zigzag``."""
    boundaries = as_boundaries(cu_seqlens)
    check_layout(layout, world_size, seq_len, cu_seqlens=boundaries)
    return _positions(layout, world_size, seq_len, layout_key(layout, boundaries))


def layout_key(layout: str, boundaries: Boundaries | None) -> Boundaries | None:
    """Only document_zigzag depends on the documents: keep the caches of the others small."""
    return boundaries if layout == "document_zigzag" else None


@_cached
def layout_index(layout: str, world_size: int, seq_len: int, cu_seqlens: Boundaries | None, rank: int | None,
                 device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s global positions on ``device`` (cached), or with ``rank=None`` the
    permutation that puts all ranks' concatenated shards back in global order."""
    positions = _positions(layout, world_size, seq_len, cu_seqlens)
    index = positions.reshape(-1).argsort() if rank is None else positions[rank]
    return index.to(device)


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


@_cached
def _ring_positions(layout: str, ulysses_size: int, ring_size: int, seq_len: int,
                    cu_seqlens: Boundaries | None) -> torch.Tensor:
    sp_positions = _positions(layout, ulysses_size * ring_size, seq_len, cu_seqlens)
    if ulysses_size == 1:
        return sp_positions
    return sp_positions.reshape(ring_size, -1).sort(dim=1).values


def ring_positions(layout: str, ulysses_size: int, ring_size: int, seq_len: int,
                   cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Global positions each RING rank holds after the Ulysses all-to-all: LongTensor
    ``[ring_size, seq_len // ring_size]``, row r the union of the shards of its ``U`` members
    (``sp_rank = r * U + u``) in increasing order. Derived from :func:`layout_positions` over
    the SP group. For ``contiguous``, ``zigzag`` and ``document_zigzag`` with documents of
    multiples of ``2 x SP`` tokens this is the layout over ``R`` ranks itself; in general
    each document is at most two runs of a ring shard (a ring rank holds the consecutive
    chunks ``rU .. rU+U-1`` and their mirror), which the packed schedule relies on."""
    boundaries = as_boundaries(cu_seqlens)
    check_grid_layout(layout, ulysses_size, ring_size)
    check_layout(layout, ulysses_size * ring_size, seq_len, cu_seqlens=boundaries)
    return _ring_positions(layout, ulysses_size, ring_size, seq_len, layout_key(layout, boundaries))


def ulysses_to_ring_order(layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int,
                          cu_seqlens: Boundaries | None = None) -> torch.Tensor | None:
    """Reorder that turns the Ulysses all-to-all output into the ring's shard.

    The layout is defined over the SP group with ``sp_rank = ring_rank * U + ulysses_rank``.
    After the all-to-all, ring rank ``r`` holds its ``U`` members' shards concatenated in
    Ulysses-rank order. Returns the index ``idx`` (LongTensor, length ``U * N / (U*R)``)
    with ``ring_shard = gathered[idx]`` in :func:`ring_positions` order (increasing), or
    None when no reorder is needed (``contiguous``, or U == 1). Raises ``ValueError`` for
    ``striped`` with U > 1 and R > 1, whose ring shard is no striped shard of the ring.
    """
    check_grid_layout(layout, ulysses_size, ring_size)
    sp_size = ulysses_size * ring_size
    members = slice(ring_rank * ulysses_size, (ring_rank + 1) * ulysses_size)
    gathered = layout_positions(layout, sp_size, seq_len, cu_seqlens)[members].reshape(-1)
    index = gathered.argsort()  # positions are distinct: the ring shard is the members' tokens in order
    return None if torch.equal(index, torch.arange(index.numel())) else index


@dataclass(frozen=True)
class Reorder:
    """A token permutation along the sequence dim, moving runs of ``chunk`` tokens.

    ``index`` / ``inverse`` ``[tokens // chunk]``: ``apply`` puts run ``index[j]`` at run j,
    ``undo`` reverses it. The plain layouts permute whole chunks of the sequence, so their
    reorder is a few entries, not one per token (an index of every token, and its inverse,
    cached per length and device, cost 8 bytes per global token at U2xR2: what the grid's
    step held beyond ALST's); document layouts fall back to ``chunk == 1``.
    """

    chunk: int
    index: torch.Tensor
    inverse: torch.Tensor

    def _select(self, x: torch.Tensor, runs: torch.Tensor, dim: int) -> torch.Tensor:
        if self.chunk == 1:
            return x.index_select(dim, runs)
        shape = x.shape
        split = x.reshape(*shape[:dim], shape[dim] // self.chunk, self.chunk, *shape[dim + 1:])
        return split.index_select(dim, runs).reshape(shape)

    def apply(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``x`` in the permuted order along ``dim`` (a new tensor)."""
        return self._select(x, self.index, dim)

    def undo(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The inverse of :meth:`apply`."""
        return self._select(x, self.inverse, dim)


def _run_length(index: torch.Tensor) -> int:
    """The largest ``c`` such that ``index`` moves aligned runs of ``c`` consecutive tokens: the
    gcd of the length and of every maximal run's position and source (a chunk of ``c`` may
    neither straddle a run's start nor begin off a multiple of ``c`` on either side)."""
    starts = torch.cat((torch.zeros(1, dtype=torch.long), (index.diff() != 1).nonzero().flatten() + 1))
    return math.gcd(index.numel(), *starts.tolist(), *index[starts].tolist())


@_cached
def ulysses_to_ring_reorder(
    layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int, device: torch.device,
    cu_seqlens: Boundaries | None = None,
) -> Reorder | None:
    """:func:`ulysses_to_ring_order` as a :class:`Reorder` of the longest aligned runs, cached on ``device``."""
    index = ulysses_to_ring_order(layout, ulysses_size, ring_size, seq_len, ring_rank, layout_key(layout, cu_seqlens))
    if index is None:
        return None
    chunk = _run_length(index)
    runs = index[::chunk] // chunk
    return Reorder(chunk, runs.to(device), runs.argsort().to(device))
