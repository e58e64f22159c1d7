"""Many new tokens against a KV cache sharded over a ring: chunked prefill and a second turn (issue 46).

``c`` new tokens (a piece of a long prompt, or the next turn of a conversation) come after the
``n`` tokens a :class:`~ring_sp.decode.ShardedKVCache` holds. As in a decode step they are
computed on every rank alike (their projections and MLP replicated: meant for ``c`` small next to
``n``; a whole long prompt is prefilled over the grid). :func:`chunk_attention` stores their keys
and values, each rank a contiguous piece as the owner rule would balance them
(:meth:`~ring_sp.decode.ShardedKVCache.append_chunk`), and attends them causally to every cached
token and to each other, in one of two exchanges, exact both:

* ``"pass_q"``: every rank attends ALL ``c`` queries to its own shard (its old tokens whole, its
  piece of the chunk causally) and one all-gather brings every rank's partial ``(out, lse)``
  together, merged in fp32 as the ring merges blocks (:func:`~ring_sp.decode.merge_over_ranks`).
  Each rank receives ``R * c * h * (d_v + 1)`` fp32 values.
* ``"pass_kv"``: every shard is all-gathered (padded to the longest, in the cache's dtype), each
  rank attends its ``c / R`` queries to all of it, and one all-gather of the outputs gives every
  rank all ``c``. Each rank receives ``(R - 1) * max_shard * h_kv * (d + d_v)`` values plus the
  outputs; the gathered shards live for the call (one layer's whole cache: pass_q never holds it).
* ``"auto"``: the exchange that moves fewer bytes (:func:`choose_exchange`): pass-Q while the chunk
  is short next to the cache (below ``c / n ~ h_kv / (R * h)`` or so), pass-KV for long chunks.

Both start with one small all-gather of every rank's cached total, the chunk's position and the
``agree=`` values (:func:`~ring_sp.decode.gather_agreed`): ranks whose caches or tokens differ raise
together before anything is sized from them. Every rank returns the same bits.

A sliding ``window`` (query at position ``p`` sees keys ``p - window < j <= p``) runs by pass-Q
(``auto`` picks it; ``pass_kv`` with a window is an error: it would gather whole shards most of
which the window hides). A rank's cached keys need not be consecutive positions (zigzag's two
runs, striped's stride, decode's round-robin appends), so the window is cut on the positions: the
keys every chunk query sees are one full block, the keys none sees are skipped, and the few in
between (positions within ``c`` of the window's edge) are cut into runs of consecutive positions,
each a band (:func:`ring_sp.schedule.band_blocks`: one call with a kernel that takes windows, full,
causal and edge squares with the fused torch ops). Shapes: q ``[b, c, h, d]``, k/v
``[b, c, h_kv, d]`` / ``[b, c, h_kv, d_v]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import RingComm
from .decode import ShardedKVCache, check_fits_cache, check_window, gather_agreed, merge_over_ranks
from .kernels import AttentionKernel, get_kernel, softmax_stat_dtype
from .merge import fold_sinks, merge_block_
from .schedule import BlockTask, band_blocks, interval_blocks
from .schedule.blocks import shifted
from .schedule.documents import position_runs

EXCHANGES = ("auto", "pass_q", "pass_kv")


def choose_exchange(chunk: int, counts: list[int], heads: int, kv_heads: int, d: int, d_v: int,
                    element_size: int) -> str:
    """``"pass_q"`` or ``"pass_kv"``: the one whose messages bring a rank fewer bytes (see the module)."""
    world = len(counts)
    acc = 8 if element_size == 8 else 4
    pass_q = world * chunk * heads * (d_v + 1) * acc
    shard = max(counts)
    pass_kv = (world - 1) * shard * kv_heads * (d + d_v) * element_size + chunk * heads * d_v * acc
    return "pass_q" if pass_q <= pass_kv else "pass_kv"


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache, *,
                    group: dist.ProcessGroup | None = None, scale: float | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None, backend: str = "auto",
                    exchange: str = "auto", agree: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of ``c`` new tokens (the same on every rank of ``group``) after every cached token and
    causally among themselves, their keys and values stored first (see the module). q ``[b, c, h, d]``,
    k ``[b, c, h_kv, d]``, v ``[b, c, h_kv, d_v]`` -> ``[b, c, h, d_v]`` in q's dtype, equal on every rank.
    ``exchange``: ``"auto"``, ``"pass_q"`` or ``"pass_kv"``; ``sinks`` ``[h]``; ``agree``: values every
    rank must hold alike (the chunk's token ids). Collectives: two all-gathers (pass-Q), three (pass-KV)."""
    if q.dim() != 4 or k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be q [b, c, h, d], "
                         f"k [b, c, h_kv, d], v [b, c, h_kv, d_v] (the same c new tokens)")
    check_fits_cache(k, v, cache, "chunk")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} must be one of {EXCHANGES}")
    check_window(window, cache)
    if window is not None and exchange == "pass_kv":
        raise ValueError(f"exchange='pass_kv' with window={window}: a sliding-window layer's chunk passes queries "
                         f"(it would gather whole shards the window mostly hides); use 'pass_q' or 'auto'")
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], v.shape[-1])  # on every rank, before any message
    start, old = cache.total, list(cache.counts)
    bounds = cache.append_chunk(k, v)
    acc = softmax_stat_dtype(q.dtype)
    _agree_first(cache, start, acc, group, agree)
    if exchange == "auto" and window is not None:
        exchange = "pass_q"
    elif exchange == "auto":
        exchange = choose_exchange(q.shape[1], old, q.shape[2], k.shape[2], q.shape[-1], v.shape[-1], k.element_size())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if exchange == "pass_q":
        piece = (bounds[cache.rank], bounds[cache.rank + 1])
        return _pass_q(kernel, q, _stored_keys(cache.k, cache.v, cache, piece, start), cache, start, scale, acc,
                       group, sinks, None, window)
    return _pass_kv(kernel, q, cache, old, bounds, scale, acc, group, sinks)


def stored_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cache: ShardedKVCache,
                     piece: tuple[int, int], *, group: dist.ProcessGroup | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None, backend: str = "auto",
                     agree: torch.Tensor | None = None) -> torch.Tensor:
    """The attention of the ``c`` newest tokens, ALREADY stored in ``cache`` (:meth:`~ShardedKVCache.append`:
    ``piece`` is ``(0, 1)`` on the rank it went to, else ``(0, 0)``; :meth:`~ShardedKVCache.append_chunk`:
    ``(bounds[rank], bounds[rank + 1])``), by pass-Q, when the cache stores something the keys are computed
    from: MLA caches its compressed latents, and the model expands this rank's whole shard into ``keys``
    ``[b, held, h_kv, d]`` / ``values`` ``[b, held, h_kv, d_v]`` (slot for slot: ``cache.positions``).
    q ``[b, c, h, d]`` (the same on every rank) -> ``[b, c, h, d_v]``, equal on every rank. Collectives: one
    all-gather (``c = 1``, as :func:`~ring_sp.decode.decode_attention`), two for a chunk (the agreement
    first, as :func:`chunk_attention`)."""
    c = q.shape[1]
    if q.dim() != 4 or keys.shape[:2] != (q.shape[0], cache.length) or values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)} must be "
                         f"q [b, c, h, d] and this rank's whole shard, [b, {cache.length}, h_kv, d] / [..., d_v]")
    if not 0 <= piece[0] <= piece[1] <= c or piece[1] - piece[0] > cache.length:
        raise ValueError(f"piece={piece} is not this rank's part of the {c} newest tokens")
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], values.shape[-1])
    start, acc = cache.total - c, softmax_stat_dtype(q.dtype)
    if c > 1:  # the agreement alone first, as chunk_attention's (the partials are sized by c)
        _agree_first(cache, start, acc, group, agree)
        agree = None
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _pass_q(kernel, q, _stored_keys(keys, values, cache, piece, start), cache, start, scale, acc, group,
                   sinks, agree)


def _agree_first(cache: ShardedKVCache, start: int, acc: torch.dtype, group: dist.ProcessGroup | None,
                 agree: torch.Tensor | None) -> None:
    """The agreement alone (an empty payload, a fixed size) before a chunk's exchange: nothing after it is sized
    from counts or a chunk length ranks disagree on (pass-Q's partials are [b, c, h, d_v]: a rank with another
    c would mismatch them)."""
    gather_agreed(cache.k.new_empty(0, dtype=acc), (cache.total, start), cache.rank, group=group, agree=agree,
                  kind="chunk_agreement")


def _stored_keys(keys: torch.Tensor, values: torch.Tensor, cache: ShardedKVCache, piece: tuple[int, int],
                 start: int) -> _Keys:
    """This rank's shard (``keys`` / ``values`` slot for slot with the cache) as the chunk at ``start`` sees it:
    the slots before ``piece`` (a window's cache may have dropped some), then the piece."""
    held = cache.length - (piece[1] - piece[0])
    return _Keys(keys, values, held, piece, cache.positions[:held], start)


def _pass_q(kernel: AttentionKernel, q: torch.Tensor, keys: _Keys, cache: ShardedKVCache, start: int, scale: float,
            acc: torch.dtype, group: dist.ProcessGroup | None, sinks: torch.Tensor | None, agree: torch.Tensor | None,
            window: int | None = None) -> torch.Tensor:
    """All the chunk's queries against this rank's shard, the partials merged over the ranks (see the module)."""
    out, lse = _attend(kernel, q, keys, (0, q.shape[1]), scale, acc, window)
    return merge_over_ranks(out, lse, (cache.total, start), cache.rank, group=group, agree=agree,
                            sinks=sinks).to(q.dtype)


class _Keys(NamedTuple):
    """One shard as a chunk's queries see it: ``old`` cached tokens (all before the chunk) in the first slots of
    ``k`` / ``v``, then its ``piece`` ``[a, b)`` of the chunk (chunk coordinates). ``positions``: the old tokens'
    global positions (increasing; a host view) and ``start`` the chunk's first, needed only with a window."""

    k: torch.Tensor
    v: torch.Tensor
    old: int
    piece: tuple[int, int]
    positions: torch.Tensor | None = None
    start: int = 0


def _blocks(keys: _Keys, rows: tuple[int, int], window: int | None, native_window: bool) -> list[BlockTask]:
    """The blocks (query rows relative to ``rows[0]``, key slots of the shard) that cover exactly what chunk
    queries ``rows`` see of ``keys``: causal within the chunk, and inside ``window`` when one is given."""
    (r0, r1), a = rows, keys.piece[0]
    if window is None:
        blocks = [BlockTask(slice(0, r1 - r0), slice(0, keys.old), False)] if keys.old else []
        return blocks + [shifted(t, -r0, keys.old - a) for t in interval_blocks(rows, keys.piece, True)]
    old = keys.positions - keys.start  # chunk coordinates: negative
    seen_by_first = int(torch.searchsorted(old, r0 - window, right=True))  # slots before: seen by no row
    seen_by_all = int(torch.searchsorted(old, r1 - 1 - window, right=True))  # slots from here: seen by every row
    blocks = [BlockTask(slice(0, r1 - r0), slice(seen_by_all, keys.old), False)] if seen_by_all < keys.old else []
    for local, stop, first, _ in position_runs(old[seen_by_first: seen_by_all], None):  # runs of consecutive positions
        slot = seen_by_first + local
        blocks += [shifted(t, -r0, slot - first) for t in band_blocks(rows, (first, first + stop - local), window,
                                                                       native_window)]
    return blocks + [shifted(t, -r0, keys.old - a) for t in band_blocks(rows, keys.piece, window, native_window)]


def _attend(kernel: AttentionKernel, q: torch.Tensor, keys: _Keys, rows: tuple[int, int], scale: float,
            acc: torch.dtype, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk queries ``rows`` (chunk coordinates; ``q`` holds exactly them) against one shard (:class:`_Keys`)
    -> ``(out [b, rows, h, d_v], lse [b, h, rows])`` in ``acc``; a row seeing no key: 0, -inf."""
    b, s, h, _ = q.shape
    out = q.new_zeros(b, s, h, keys.v.shape[-1], dtype=acc)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    for t in _blocks(keys, rows, window, bool(getattr(kernel, "supports_window", False))):
        part, part_lse = kernel.forward(q[:, t.q], keys.k[:, t.kv], keys.v[:, t.kv], causal=t.causal, scale=scale,
                                        window=t.window, diagonal=t.diagonal)
        merge_block_(out[:, t.q], lse[:, :, t.q], part, part_lse)
    return out, lse


def _pass_kv(kernel: AttentionKernel, q: torch.Tensor, cache: ShardedKVCache, old: list[int], bounds: list[int],
             scale: float, acc: torch.dtype, group: dist.ProcessGroup | None,
             sinks: torch.Tensor | None) -> torch.Tensor:
    """Every shard gathered (padded to the longest), this rank's ``c / R`` queries against all of them, the
    outputs all-gathered (see the module)."""
    world, rank, comm = len(old), cache.rank, RingComm.of(group)
    b, c, h, _ = q.shape
    d_v = cache.v.shape[-1]
    longest = max(cache.counts)
    shards = []
    for t in (cache.k, cache.v):  # one all-gather each: [world, b, longest, h_kv, d]
        mine = t.new_zeros(b, longest, *t.shape[2:])
        mine[:, : cache.length] = t[:, : cache.length]
        every = mine.new_empty(world * mine.numel())
        comm.all_gather(every, mine.flatten(), "chunk_kv").wait()
        shards.append(every.view(world, *mine.shape))
    per = -(-c // world)  # this rank's queries: rows [rank * per, ...) of the chunk
    rows = (min(rank * per, c), min((rank + 1) * per, c))
    out = q.new_zeros(b, per, h, d_v, dtype=acc)
    lse = torch.full((b, h, per), float("-inf"), dtype=acc, device=q.device)
    if rows[0] < rows[1]:
        mine_q = q[:, rows[0]: rows[1]]
        for source in range(world):
            part, part_lse = _attend(kernel, mine_q, _Keys(shards[0][source], shards[1][source], old[source],
                                                           (bounds[source], bounds[source + 1])), rows, scale, acc)
            merge_block_(out[:, : rows[1] - rows[0]], lse[:, :, : rows[1] - rows[0]], part, part_lse)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    every = out.new_empty(world * out.numel())
    comm.all_gather(every, out.flatten(), "chunk_out").wait()
    return every.view(world, b, per, h, d_v).transpose(0, 1).reshape(b, world * per, h, d_v)[:, :c].to(q.dtype)


__all__ = ["EXCHANGES", "choose_exchange", "chunk_attention", "stored_attention"]
