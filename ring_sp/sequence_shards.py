"""Whole sequence tensors between the global order and a layout's shards.

:func:`shard_sequence` takes one rank's shard, :func:`unshard_sequence` puts every shard
back without communication, and :func:`gather_sequence` all-gathers the shards of a group
(differentiable: the backward keeps this rank's slice). Which positions a shard holds is
:mod:`ring_sp.layouts`' one definition: a rank's shard indexes its own positions
(:func:`~ring_sp.layouts.layout_index`, O(N/P)), and putting shards back moves runs
(:func:`~ring_sp.layouts.ulysses_to_ring_reorder` over all ranks), never an index of every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .layouts import (AUTO, Boundaries, as_boundaries, check_boundaries, check_layout, layout_index, layout_key,
                      ulysses_to_ring_reorder)
from .plan.layout_choice import choose_layout


def resolved_layout(layout: str, boundaries: Boundaries | None, global_len: int, world_size: int) -> str:
    """``layout``, or the placement ``"auto"`` stands for with these documents (checked first):
    ``zigzag`` without, else :func:`ring_sp.plan.layout_choice.choose_layout`'s."""
    if layout != AUTO:
        return layout
    if boundaries is not None:
        check_boundaries(boundaries, global_len)
    return choose_layout(boundaries, world_size)


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
    layout = resolved_layout(layout, boundaries, x.shape[dim], world_size)
    check_layout(layout, world_size, x.shape[dim], name=f"x.shape[{dim}]", cu_seqlens=boundaries)
    return x.index_select(dim, layout_index(layout, world_size, x.shape[dim], layout_key(layout, boundaries), rank, x.device))


def unshard_sequence(shards: torch.Tensor, *, layout: str = "zigzag", dim: int = 1,
                     cu_seqlens: torch.Tensor | Sequence[int] | None = None, seq_len: int | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_sequence` for all shards at once, without communication.

    ``shards`` stacks every rank's shard along a new leading dim: ``[P, ...]`` with the
    local length along ``dim + 1``; returns the global tensor in natural token order, its
    first ``seq_len`` tokens when given (dropping the padding :func:`ring_sp.shard_batch` added).
    """
    world_size = shards.shape[0]
    dim = dim % (shards.dim() - 1)
    concatenated = torch.cat(shards.unbind(0), dim=dim)
    total = concatenated.shape[dim]
    boundaries = as_boundaries(cu_seqlens)
    layout = resolved_layout(layout, boundaries, total, world_size)
    check_layout(layout, world_size, total, name="total sequence length", cu_seqlens=boundaries)
    # all ranks as one Ulysses group: the same reorder of runs (O(P x runs), no index per token)
    order = ulysses_to_ring_reorder(layout, world_size, 1, total, 0, concatenated.device, layout_key(layout, boundaries))
    full = concatenated if order is None else order.apply(concatenated, dim)
    return full if seq_len is None else full.narrow(dim, 0, _real_length(seq_len, total)).contiguous()


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
    seq_len: int | None = None,
) -> torch.Tensor:
    """Gather every rank's shard into the global sequence, in natural token order, on every rank.

    ``x``: this rank's shard, local length ``n`` along ``dim``; returns length
    ``n * world_size`` along ``dim``, or the first ``seq_len`` tokens when given (the real
    length of a batch :func:`ring_sp.shard_batch` padded at its end: the padding is dropped).
    ``group=None`` is the default group. The group rank is the layout rank unless
    ``layout_ranks[group_rank]`` says otherwise (use ``topology.gather_sequence``, which
    passes it). Differentiable: the backward returns this rank's slice of the gradient (all
    ranks are assumed to compute the same function of the gathered tensor, as in a
    replicated loss; padding gets a zero gradient). ``cu_seqlens``: the boundaries the
    shards were made with (padding document included), for ``document_zigzag``.
    """
    if x.dim() == 0:
        raise ValueError("x must have a sequence dimension; got a 0-d tensor")
    dim = dim % x.dim()
    full = _GatherSequence.apply(x, group, layout, dim, layout_ranks, as_boundaries(cu_seqlens))
    return full if seq_len is None else full.narrow(dim, 0, _real_length(seq_len, full.shape[dim]))


def _real_length(seq_len: object, padded: int) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= padded:
        raise ValueError(f"seq_len={seq_len!r} must be an int in [1, {padded}] (the real length before padding)")
    return seq_len
