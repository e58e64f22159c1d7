"""Sequence layouts: which global token positions each sequence-parallel rank holds.

With ``P`` ranks and global length ``N`` (DESIGN.md section 3):

* ``contiguous``: rank i holds ``[i*N/P, (i+1)*N/P)``.
* ``zigzag`` (the default): ``2P`` equal chunks; rank i holds chunk i then chunk
  ``2P-1-i``. This is Megatron's ``get_batch_on_this_cp_rank`` convention.
* ``striped``: rank i holds tokens ``i, i+P, i+2P, ...``.
* ``document_zigzag`` (packed sequences): zigzag applied to EVERY document: each document
  (boundaries ``cu_seqlens``) is split into ``2P`` equal chunks and rank i holds chunks i
  and ``2P-1-i`` of each, documents in order. Every rank gets the same causal work for any
  mix of document lengths (plain zigzag can be 2-3x off); each document's length must be a
  multiple of ``2P`` (pad documents, as TransformerEngine's THD format also requires).

Everything else (sharding, gathering, the post-Ulysses reorder, work counts) is derived
from one function, :func:`layout_positions`, so the layout is defined exactly once.
In every layout a rank's local order is increasing in global position, so each document
occupies one contiguous run of a shard (the packed ring schedule relies on it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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


def check_layout(layout: str, world_size: int, seq_len: int, *, name: str = "seq_len",
                 cu_seqlens: Boundaries | None = None) -> None:
    """Raise ``ValueError`` unless ``layout`` can split ``seq_len`` tokens over ``world_size`` ranks
    (and, for ``document_zigzag``, every document of ``cu_seqlens`` into ``2 * world_size`` chunks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    # zigzag needs 2 chunks per rank; on ONE rank every layout is the identity
    multiple = 2 * world_size if layout in ("zigzag", "document_zigzag") and world_size > 1 else world_size
    if seq_len % multiple != 0 or seq_len == 0:
        raise ValueError(
            f"{name}={seq_len} must be a positive multiple of {multiple} for layout={layout!r} "
            f"over {world_size} ranks; pad the sequence to a multiple of {multiple}"
        )
    if cu_seqlens is not None:
        check_boundaries(cu_seqlens, seq_len)
    if layout == "document_zigzag":
        if cu_seqlens is None:
            raise ValueError("layout='document_zigzag' needs cu_seqlens (the document boundaries); pass cu_seqlens=")
        lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        bad = next((i for i, n in enumerate(lengths) if n % multiple), None)
        if bad is not None:
            raise ValueError(
                f"layout='document_zigzag' over {world_size} ranks needs every document length to be a "
                f"multiple of {multiple}; document {bad} has length {lengths[bad]}. Pad each document to a "
                f"multiple of {multiple} (ring_sp.pad_documents), or use layout='striped' (balanced without padding)"
            )


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
        documents = [_zigzag(torch.arange(a, b), world_size) for a, b in zip(cu_seqlens, cu_seqlens[1:]) if b > a]
        return torch.cat(documents, dim=1)
    # striped: token t lives on rank t % P at local index t // P
    return torch.arange(seq_len).view(-1, world_size).t().contiguous()


def _zigzag(tokens: torch.Tensor, world_size: int) -> torch.Tensor:
    """[P, len/P]: rank i gets chunks i and 2P-1-i of ``tokens`` split into 2P chunks."""
    if world_size == 1:
        return tokens.view(1, -1)
    chunks = tokens.view(2 * world_size, -1)
    ranks = torch.arange(world_size)
    return torch.cat([chunks[ranks], chunks[2 * world_size - 1 - ranks]], dim=1)


def layout_positions(layout: str, world_size: int, seq_len: int,
                     cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Global positions held by each rank: LongTensor ``[world_size, seq_len // world_size]``,
    row i listing rank i's tokens in its local order. Read-only (cached). ``cu_seqlens``
    is only used by ``document_zigzag``."""
    boundaries = as_boundaries(cu_seqlens)
    check_layout(layout, world_size, seq_len, cu_seqlens=boundaries)
    return _positions(layout, world_size, seq_len, _layout_key(layout, boundaries))


def _layout_key(layout: str, boundaries: Boundaries | None) -> Boundaries | None:
    """Only document_zigzag depends on the documents: keep the caches of the others small."""
    return boundaries if layout == "document_zigzag" else None


@_cached
def _index_on(layout: str, world_size: int, seq_len: int, cu_seqlens: Boundaries | None, rank: int | None,
              device: torch.device) -> torch.Tensor:
    positions = _positions(layout, world_size, seq_len, cu_seqlens)
    index = positions.reshape(-1).argsort() if rank is None else positions[rank]
    return index.to(device)


def shard_sequence(x: torch.Tensor, *, rank: int, world_size: int, layout: str = "zigzag", dim: int = 1,
                   cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """This rank's shard of a global sequence tensor.

    ``x`` has the global length ``N`` along ``dim`` (e.g. ``[b, N, h, d]`` or ``[b, N]``);
    returns the same shape with ``N / world_size`` along ``dim``, in the layout's local
    order. Differentiable (the gradient scatters back into the global positions).
    ``cu_seqlens`` (document boundaries) is required by ``document_zigzag`` only.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    dim = dim % x.dim()
    boundaries = as_boundaries(cu_seqlens)
    check_layout(layout, world_size, x.shape[dim], name=f"x.shape[{dim}]", cu_seqlens=boundaries)
    return x.index_select(dim, _index_on(layout, world_size, x.shape[dim], _layout_key(layout, boundaries), rank, x.device))


def unshard_sequence(shards: torch.Tensor, *, layout: str = "zigzag", dim: int = 1,
                     cu_seqlens: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_sequence` for all shards at once, without communication.

    ``shards`` stacks every rank's shard along a new leading dim: ``[P, ...]`` with the
    local length along ``dim + 1``; returns the global tensor in natural token order.
    """
    world_size = shards.shape[0]
    dim = dim % (shards.dim() - 1)
    concatenated = torch.cat(shards.unbind(0), dim=dim)
    seq_len = concatenated.shape[dim]
    boundaries = as_boundaries(cu_seqlens)
    check_layout(layout, world_size, seq_len, name="total sequence length", cu_seqlens=boundaries)
    index = _index_on(layout, world_size, seq_len, _layout_key(layout, boundaries), None, concatenated.device)
    return concatenated.index_select(dim, index)


class _GatherSequence(torch.autograd.Function):
    """all_gather of equal shards + reorder; backward keeps this rank's slice of the
    (identical on every rank) upstream gradient, so per-rank grads are not scaled by P."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, layout: str, dim: int,
                layout_ranks: tuple[int, ...] | None, cu_seqlens: Boundaries | None) -> torch.Tensor:
        world_size = dist.get_world_size(group)
        group_rank = dist.get_rank(group)
        ctx.rank = layout_ranks[group_rank] if layout_ranks is not None else group_rank
        ctx.world_size, ctx.layout, ctx.dim, ctx.cu_seqlens = world_size, layout, dim, cu_seqlens
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        if layout_ranks is not None:  # put the shards in layout-rank order
            by_layout_rank = [parts[0]] * world_size
            for g, part in enumerate(parts):
                by_layout_rank[layout_ranks[g]] = part
            parts = by_layout_rank
        return unshard_sequence(torch.stack(parts), layout=layout, dim=dim, cu_seqlens=cu_seqlens)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = shard_sequence(grad, rank=ctx.rank, world_size=ctx.world_size, layout=ctx.layout, dim=ctx.dim,
                              cu_seqlens=ctx.cu_seqlens)
        return mine, None, None, None, None, None


def gather_sequence(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    dim: int = 1,
    layout_ranks: tuple[int, ...] | None = None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Gather every rank's shard into the global sequence, in natural token order, on every rank.

    ``x``: this rank's shard, local length ``n`` along ``dim``; returns length
    ``n * world_size`` along ``dim``. ``group=None`` is the default group. The group rank
    is the layout rank unless ``layout_ranks[group_rank]`` says otherwise (use
    ``topology.gather_sequence``, which passes it). Differentiable: the backward returns
    this rank's slice of the gradient (all ranks are assumed to compute the same function
    of the gathered tensor, as in a replicated loss). ``cu_seqlens``: for ``document_zigzag``.
    """
    if x.dim() == 0:
        raise ValueError("x must have a sequence dimension; got a 0-d tensor")
    dim = dim % x.dim()
    return _GatherSequence.apply(x, group, layout, dim, layout_ranks, as_boundaries(cu_seqlens))


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


def ulysses_to_ring_order(layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int,
                          cu_seqlens: Boundaries | None = None) -> torch.Tensor | None:
    """Reorder that turns the Ulysses all-to-all output into the ring's layout.

    The layout is defined over the SP group with ``sp_rank = ring_rank * U + ulysses_rank``.
    After the all-to-all, ring rank ``r`` holds its ``U`` members' shards concatenated in
    Ulysses-rank order. Returns the index ``idx`` (LongTensor, length ``U * N / (U*R)``)
    with ``ring_layout_shard = gathered[idx]``, or None when no reorder is needed
    (``contiguous``, or U == 1). Raises ``ValueError`` when the gathered tokens are not a
    ring layout shard at all (``striped`` with U > 1 and R > 1).
    """
    check_grid_layout(layout, ulysses_size, ring_size)
    sp_size = ulysses_size * ring_size
    members = slice(ring_rank * ulysses_size, (ring_rank + 1) * ulysses_size)
    gathered = layout_positions(layout, sp_size, seq_len, cu_seqlens)[members].reshape(-1)
    target = layout_positions(layout, ring_size, seq_len, cu_seqlens)[ring_rank]
    if torch.equal(gathered, target):
        return None
    where = torch.full((seq_len,), -1, dtype=torch.long)
    where[gathered] = torch.arange(gathered.numel())
    index = where[target]
    if (index < 0).any():  # every layout but striped (refused above) is closed under the all-to-all
        raise AssertionError(f"layout={layout!r}: the Ulysses reorder is not a permutation (a ring_sp bug)")
    return index


@dataclass(frozen=True)
class Reorder:
    """A token permutation along the sequence dim and its inverse (both on one device)."""

    index: torch.Tensor
    inverse: torch.Tensor


@_cached
def ulysses_to_ring_reorder(
    layout: str, ulysses_size: int, ring_size: int, seq_len: int, ring_rank: int, device: torch.device,
    cu_seqlens: Boundaries | None = None,
) -> Reorder | None:
    """:func:`ulysses_to_ring_order` with its inverse, cached on ``device``."""
    index = ulysses_to_ring_order(layout, ulysses_size, ring_size, seq_len, ring_rank, _layout_key(layout, cu_seqlens))
    if index is None:
        return None
    return Reorder(index.to(device), index.argsort().to(device))
