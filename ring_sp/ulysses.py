"""DeepSpeed-Ulysses all-to-all: trade a sequence shard for a head shard, and back.

Inside a Ulysses group of ``U`` ranks, ``[b, n, H, d]`` (n local tokens, all H heads)
becomes ``[b, U*n, H/U, d]`` (the group's U*n tokens, this rank's H/U heads): rank u
sends head group j to rank j and receives rank j's tokens of head group u. The gathered
tokens come in Ulysses-rank order; an optional ``Reorder`` then puts them in the ring's
layout (:func:`ring_sp.layouts.ulysses_to_ring_order`). The backward of one all-to-all
is the other, which :mod:`ring_sp.function` calls explicitly.

KV heads: with ``h_kv % U == 0`` each rank receives its ``h_kv / U`` heads. With
``U % h_kv == 0`` each rank needs ONE KV head (``u * h_kv // U``) and we send exactly
that: KV heads are replicated to the ranks that use them and never further. k and v
travel in one all-to-all, flattened per destination, so v's head size may differ (MLA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_to_all_equal
from .layouts import Reorder


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, order: Reorder | None, kind: str) -> torch.Tensor:
    """[b, n, H, d] -> [b, U*n, H/U, d] (tokens reordered by ``order`` if given)."""
    u = dist.get_world_size(group)
    b, n, heads, d = x.shape
    send = x.reshape(b, n, u, heads // u, d).permute(2, 0, 1, 3, 4).contiguous()  # [dst, b, n, H/U, d]
    recv = torch.empty_like(send)  # [src, b, n, H/U, d]
    all_to_all_equal(recv, send, group, kind)
    gathered = recv.permute(1, 0, 2, 3, 4).reshape(b, u * n, heads // u, d)
    return gathered if order is None else gathered.index_select(1, order.index)


def head_to_seq(y: torch.Tensor, group: dist.ProcessGroup, order: Reorder | None, kind: str) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: [b, U*n, H/U, d] -> [b, n, H, d]."""
    u = dist.get_world_size(group)
    if order is not None:
        y = y.index_select(1, order.inverse)
    b, un, heads_local, d = y.shape
    n = un // u
    send = y.reshape(b, u, n, heads_local, d).permute(1, 0, 2, 3, 4).contiguous()  # [dst, b, n, H/U, d]
    recv = torch.empty_like(send)  # [src = head group, b, n, H/U, d]
    all_to_all_equal(recv, send, group, kind)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, u * heads_local, d)


def kv_heads_per_rank(kv_heads: int, ulysses_size: int) -> int:
    """KV heads each Ulysses rank receives: ``h_kv / U`` when U divides h_kv, else 1."""
    return kv_heads // ulysses_size if kv_heads % ulysses_size == 0 else 1


def _replication_index(kv_heads: int, ulysses_size: int, device: torch.device) -> torch.Tensor | None:
    """KV head each destination needs when U % h_kv == 0 (rank u: ``u * h_kv // U``), else None."""
    if kv_heads % ulysses_size == 0:
        return None
    return torch.arange(ulysses_size, device=device) * kv_heads // ulysses_size


def pack_kv(k: torch.Tensor, v: torch.Tensor, ulysses_size: int) -> torch.Tensor:
    """k ``[b, n, h_kv, d]``, v ``[b, n, h_kv, d_v]`` -> ``[b, n, U, m*(d + d_v)]``: per destination
    rank its m k heads then its m v heads, flattened, so ONE all-to-all moves both whatever
    ``d_v`` is (``m = kv_heads_per_rank``; the U destinations play the role of heads)."""
    b, n, kv_heads, _ = k.shape
    index = _replication_index(kv_heads, ulysses_size, k.device)
    if index is not None:
        k, v = k.index_select(2, index), v.index_select(2, index)
    u = ulysses_size
    return torch.cat((k.reshape(b, n, u, -1), v.reshape(b, n, u, -1)), dim=3)


def unpack_kv(packed: torch.Tensor, kv_heads_local: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """After the all-to-all: ``[b, U*n, 1, m*(d + d_v)]`` -> k ``[b, U*n, m, d]``, v ``[b, U*n, m, d_v]``
    (views; ``m = kv_heads_local``, ``d = head_dim``)."""
    b, un, _, width = packed.shape
    split = kv_heads_local * head_dim
    return (packed[..., :split].reshape(b, un, kv_heads_local, head_dim),
            packed[..., split:].reshape(b, un, kv_heads_local, (width - split) // kv_heads_local))


def pack_kv_grads(dk: torch.Tensor, dv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dk ``[b, U*n, m, d]``, dv ``[b, U*n, m, d_v]`` -> ``[b, U*n, 1, m*(d + d_v)]`` in ``dtype``:
    the layout :func:`unpack_kv` split, ready for the inverse all-to-all."""
    b, un = dk.shape[:2]
    return torch.cat((dk.reshape(b, un, 1, -1), dv.reshape(b, un, 1, -1)), dim=3).to(dtype)


def unpack_kv_grads(d_packed: torch.Tensor, kv_heads: int, ulysses_size: int,
                    head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Adjoint of :func:`pack_kv`: ``[b, n, U, m*(d + d_v)]`` -> dk ``[b, n, h_kv, d]``, dv
    ``[b, n, h_kv, d_v]``, summing the gradients of replicated heads (in ``d_packed``'s dtype:
    pass float32 to sum exactly)."""
    b, n, u, width = d_packed.shape
    m = kv_heads_per_rank(kv_heads, u)
    split = m * head_dim
    d_v = (width - split) // m
    dk = d_packed[..., :split].reshape(b, n, u * m, head_dim)
    dv = d_packed[..., split:].reshape(b, n, u * m, d_v)
    index = _replication_index(kv_heads, u, d_packed.device)
    if index is None:
        return dk, dv
    summed_k = torch.zeros((b, n, kv_heads, head_dim), dtype=dk.dtype, device=dk.device).index_add_(2, index, dk)
    summed_v = torch.zeros((b, n, kv_heads, d_v), dtype=dv.dtype, device=dv.device).index_add_(2, index, dv)
    return summed_k, summed_v
