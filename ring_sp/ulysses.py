"""DeepSpeed-Ulysses all-to-all: trade a sequence shard for a head shard, and back.

Inside a Ulysses group of ``U`` ranks, ``[b, n, H, d]`` (n local tokens, all H heads)
becomes ``[b, U*n, H/U, d]`` (the group's U*n tokens, this rank's H/U heads): rank u
sends head group j to rank j and receives rank j's tokens of head group u. The gathered
tokens come in Ulysses-rank order; an optional ``Reorder`` then puts them in the ring's
layout (:func:`ring_sp.layouts.ulysses_to_ring_order`). The backward of one all-to-all
is the other, which :mod:`ring_sp.function` calls explicitly; the backward uses the pieces
(:func:`head_send_buffer`, :func:`exchange`, :func:`seq_from_recv`) to drop each buffer as
soon as the next exists.

KV heads: with ``h_kv % U == 0`` each rank receives its ``h_kv / U`` heads. With
``U % h_kv == 0`` each rank needs ONE KV head (``u * h_kv // U``) and we send exactly
that: KV heads are replicated to the ranks that use them and never further. k and v
travel in one all-to-all, flattened per destination, so v's head size may differ (MLA).

Storage: the received q, k, v (and dout) are copied once into ``[b, H/U, U*n, d]`` storage
when the kernel is ``head_major`` (the CPU op: dense rows per head make its backward 3-16%
faster and spare its forward three copies), else returned as views of the receive buffer.

Head chunks (``chunk`` of ``chunks``, :mod:`ring_sp.function`): every function that reads or
writes the sequence-layout side takes one chunk of each destination's heads, rank ``j``'s
heads ``j*H/U + chunk*H/(U*chunks) + [0, H/(U*chunks))`` (:func:`chunk_heads`): each rank keeps
the heads it has unchunked, so results and gradients are the unchunked ones, and a chunk's
all-to-all moves exactly its share of the bytes. The default (chunk 0 of 1) is the whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_to_all_equal
from .layouts import Reorder
from .shapes import kv_heads_per_rank


def chunk_heads(x: torch.Tensor, ulysses_size: int, chunk: int = 0, chunks: int = 1) -> torch.Tensor:
    """``[b, n, H, d]`` -> the view ``[b, n, U, H/(U*chunks), d]`` of each destination rank's
    heads of chunk ``chunk`` (destination ``j``: heads ``j*H/U + chunk*H/(U*chunks) + i``).
    A view whenever x's head and head-size dims can be split (always for a dense last dim)."""
    b, n, heads, d = x.shape
    return x.reshape(b, n, ulysses_size, chunks, heads // (ulysses_size * chunks), d)[:, :, :, chunk]


def seq_to_head(x: torch.Tensor, group: dist.ProcessGroup, order: Reorder | None, kind: str,
                head_major: bool = False, chunk: int = 0, chunks: int = 1) -> torch.Tensor:
    """[b, n, H, d] -> [b, U*n, H/U, d] (tokens reordered by ``order`` if given; ``head_major``:
    see :func:`head_from_recv`); with ``chunks``: chunk ``chunk``'s heads only, ``H/(U*chunks)``."""
    u = dist.get_world_size(group)
    send = chunk_heads(x, u, chunk, chunks).permute(2, 0, 1, 3, 4).contiguous()  # [dst, b, n, H/U, d]
    recv = exchange(send, group, kind)
    del send  # before head_from_recv's copy
    return head_from_recv(recv, order, head_major)


def head_from_recv(recv: torch.Tensor, order: Reorder | None, head_major: bool = False) -> torch.Tensor:
    """[src, b, n, H/U, d] -> [b, U*n, H/U, d] in ``order``: a view of ``recv`` when b == 1 and
    no reorder, else one copy. ``head_major`` (the kernel's preference, see
    :mod:`ring_sp.kernels.base`): always one copy, into ``[b, H/U, U*n, d]`` storage, which the
    reorder writes directly (a view of it is returned)."""
    u, b, n, heads_local, d = recv.shape
    if head_major:
        gathered = recv.permute(1, 3, 0, 2, 4).reshape(b, heads_local, u * n, d)  # a view when b == 1
        stored = gathered.contiguous() if order is None else order.apply(gathered, dim=2)
        return stored.transpose(1, 2)
    gathered = recv.transpose(0, 1).reshape(b, u * n, heads_local, d)
    return gathered if order is None else order.apply(gathered)


def head_to_seq(y: torch.Tensor, group: dist.ProcessGroup, order: Reorder | None, kind: str,
                into: torch.Tensor | None = None, chunk: int = 0, chunks: int = 1) -> torch.Tensor:
    """Inverse of :func:`seq_to_head`: [b, U*n, H/U, d] -> [b, n, H, d]; with ``into``, written
    into chunk ``chunk`` of ``chunks`` of its heads (see :func:`seq_from_recv`)."""
    u = dist.get_world_size(group)
    return seq_from_recv(exchange(head_send_buffer(y, u, order), group, kind), into, chunk, chunks)


def head_send_buffer(y: torch.Tensor, ulysses_size: int, order: Reorder | None) -> torch.Tensor:
    """[b, U*n, H/U, d] -> the all-to-all's send buffer [dst, b, n, H/U, d], tokens back in
    Ulysses-rank order. No copy when y already is that buffer (b == 1, no reorder, contiguous)."""
    if order is not None:
        y = order.undo(y)
    b, un, heads_local, d = y.shape
    return y.reshape(b, ulysses_size, un // ulysses_size, heads_local, d).transpose(0, 1).contiguous()


def exchange(send: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """One all-to-all of equal chunks along dim 0 into a new buffer of send's shape."""
    recv = torch.empty_like(send)
    all_to_all_equal(recv, send, group, kind)
    return recv


def seq_from_recv(recv: torch.Tensor, into: torch.Tensor | None = None, chunk: int = 0,
                  chunks: int = 1) -> torch.Tensor:
    """[src = head group, b, n, H/U, d] -> [b, n, H, d] (one copy); with ``into`` (``[b, n,
    H*chunks, d]``), the copy goes to its chunk ``chunk`` (:func:`chunk_heads`) and ``into`` is returned."""
    u, b, n, heads_local, d = recv.shape
    if into is not None:
        chunk_heads(into, u, chunk, chunks).copy_(recv.permute(1, 2, 0, 3, 4))
        return into
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n, u * heads_local, d)


def _replication_index(kv_heads: int, ulysses_size: int, device: torch.device) -> torch.Tensor | None:
    """KV head each destination needs when U % h_kv == 0 (rank u: ``u * h_kv // U``), else None."""
    if kv_heads % ulysses_size == 0:
        return None
    return torch.arange(ulysses_size, device=device) * kv_heads // ulysses_size


def pack_kv(k: torch.Tensor, v: torch.Tensor, ulysses_size: int, chunk: int = 0, chunks: int = 1) -> torch.Tensor:
    """k ``[b, n, h_kv, d]``, v ``[b, n, h_kv, d_v]`` -> the all-to-all's send buffer
    ``[dst, b, n, m*(d + d_v)]``: per destination rank its m k heads then its m v heads,
    flattened, so ONE all-to-all moves both whatever ``d_v`` is (``m = kv_heads_per_rank``;
    with ``chunks``, chunk ``chunk``'s ``m / chunks`` of them, never replicated).
    k and v are copied once, straight into place."""
    b, n, kv_heads, d = k.shape
    index = _replication_index(kv_heads, ulysses_size, k.device)
    if index is not None:
        k, v = k.index_select(2, index), v.index_select(2, index)
    m = kv_heads_per_rank(kv_heads, ulysses_size) // chunks
    u = ulysses_size
    split = m * d
    send = torch.empty((u, b, n, split + m * v.shape[3]), dtype=k.dtype, device=k.device)
    send[..., :split].unflatten(-1, (m, d)).copy_(chunk_heads(k, u, chunk, chunks).permute(2, 0, 1, 3, 4))
    send[..., split:].unflatten(-1, (m, -1)).copy_(chunk_heads(v, u, chunk, chunks).permute(2, 0, 1, 3, 4))
    return send


def unpack_kv(packed: torch.Tensor, kv_heads_local: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The received ``[src, b, n, m*(d + d_v)]`` -> k ``[src, b, n, m, d]``, v ``[src, b, n, m, d_v]``
    (views; ``m = kv_heads_local``, ``d = head_dim``), each for :func:`head_from_recv`."""
    split = kv_heads_local * head_dim
    return (packed[..., :split].unflatten(-1, (kv_heads_local, head_dim)),
            packed[..., split:].unflatten(-1, (kv_heads_local, -1)))


def kv_grads_send_buffer(dk: torch.Tensor, dv: torch.Tensor, ulysses_size: int, order: Reorder | None,
                         dtype: torch.dtype) -> torch.Tensor:
    """Adjoint of :func:`unpack_kv` and the head-to-sequence send in one step: dk ``[b, U*n, m, d]``,
    dv ``[b, U*n, m, d_v]`` (ring order) -> ``[dst, b, n, m*(d + d_v)]`` in ``dtype``, each
    destination's m k heads then its m v heads (the layout :func:`pack_kv` sent). Written
    straight into the buffer: no ``cat`` of dk and dv, no separate cast."""
    if order is not None:
        dk, dv = order.undo(dk), order.undo(dv)
    b, un, m, d = dk.shape
    u = ulysses_size
    split = m * d
    send = torch.empty((u, b, un // u, split + m * dv.shape[3]), dtype=dtype, device=dk.device)
    # per head (no flattening of m and d: head-major dk/dv would need a copy for it)
    send[..., :split].unflatten(-1, (m, d)).copy_(dk.reshape(b, u, un // u, m, d).transpose(0, 1))
    send[..., split:].unflatten(-1, (m, -1)).copy_(dv.reshape(b, u, un // u, m, -1).transpose(0, 1))
    return send


def kv_grads_from_recv(recv: torch.Tensor, kv_heads: int, head_dim: int,
                       into: tuple[torch.Tensor, torch.Tensor] | None = None, chunk: int = 0,
                       chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Adjoint of :func:`pack_kv` on the received ``[src, b, n, m*(d + d_v)]``: dk ``[b, n, h_kv, d]``,
    dv ``[b, n, h_kv, d_v]``, summing the gradients of replicated heads (in ``recv``'s dtype:
    pass float32 to sum exactly). With ``into`` (dk, dv; no replication): written into chunk
    ``chunk`` of ``chunks`` of their heads, and returned."""
    u, b, n, width = recv.shape
    m = kv_heads_per_rank(kv_heads, u) // chunks
    split = m * head_dim
    d_v = (width - split) // m
    if into is not None:
        dk_all, dv_all = into
        chunk_heads(dk_all, u, chunk, chunks).copy_(recv[..., :split].unflatten(-1, (m, head_dim)).permute(1, 2, 0, 3, 4))
        chunk_heads(dv_all, u, chunk, chunks).copy_(recv[..., split:].unflatten(-1, (m, d_v)).permute(1, 2, 0, 3, 4))
        return dk_all, dv_all
    dk = recv[..., :split].reshape(u, b, n, m, head_dim).permute(1, 2, 0, 3, 4).reshape(b, n, u * m, head_dim)
    dv = recv[..., split:].reshape(u, b, n, m, d_v).permute(1, 2, 0, 3, 4).reshape(b, n, u * m, d_v)
    index = _replication_index(kv_heads, u, recv.device)
    if index is None:
        return dk, dv
    summed_k = torch.zeros((b, n, kv_heads, head_dim), dtype=dk.dtype, device=dk.device).index_add_(2, index, dk)
    summed_v = torch.zeros((b, n, kv_heads, d_v), dtype=dv.dtype, device=dv.device).index_add_(2, index, dv)
    return summed_k, summed_v
