"""Decoding against a KV cache sharded over a ring (issue 46, the core entry).

After a prefill through the ring (any layout), each ring rank keeps the keys and values of
the tokens it holds: :class:`ShardedKVCache`, ``1/R`` of one device's cache. A new token is
then computed on every rank alike (decode is replicated: one token's projections cost little),
and :func:`decode_attention`

* stores its key and value on ONE rank, the one with the fewest cached tokens (ties: the lowest
  rank), which every rank computes alike from the same counts, so the shards stay balanced;
* attends its query to this rank's shard with the local kernel (with a sliding ``window``, the
  suffix of the slots it leaves visible, a view; no key: ``lse = -inf``);
* all-gathers every rank's partial ``(out, lse)`` in float32 (float64 for float64) over the ring
  group in ONE collective, which also carries each rank's cached-token count and position, and
  merges them in one pass (:func:`ring_sp.merge.merge_partials`, the ring's online-softmax
  formula; attention sinks folded in once, last).

Every rank returns the same output, bit for bit: each merges the same gathered partials alike. Ranks whose caches or positions differ raise one error on every rank,
naming the odd rank. Shapes: q ``[b, 1, h, d]``, k/v of the new token ``[b, 1, h_kv, d]`` /
``[b, 1, h_kv, d_v]``, the cache ``[b, capacity, h_kv, d]`` per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm import RingComm
from .kernels import AttentionKernel, get_kernel, softmax_stat_dtype
from .merge import fold_sinks, merge_partials


@dataclass
class ShardedKVCache:
    """One attention layer's cache on one ring rank: this rank's keys ``k`` ``[b, capacity, h_kv, d]``
    and values ``v`` ``[b, capacity, h_kv, d_v]`` (the first ``length`` slots filled), their global
    positions ``positions`` ``[capacity]`` (int64 on the host, increasing, -1 where empty: a window's
    visible keys are a suffix found without touching the device), and every rank's filled count
    ``counts`` and room ``capacities`` (the same lists on every rank: they decide where each new token
    goes, and every rank can tell that it does not fit before anything is sent)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    rank: int
    counts: list[int] = field(default_factory=list)
    capacities: list[int] = field(default_factory=list)
    grow_by: int = 0  # 0: a full rank is an error; else a full owner gets this many more slots (every rank counts it)
    # a sliding window's layer: keys no later token can see (position <= next - window) are dropped, so the storage
    # holds about this rank's share of the window, not of the sequence (counts and capacities stay the tokens given)
    window: int | None = None
    held: int = -1  # slots filled (-1: counts[rank], all of them; a window's cache holds fewer)

    def __post_init__(self) -> None:
        if self.held < 0:
            self.held = self.counts[self.rank]

    @property
    def length(self) -> int:
        """Slots filled: ``k[:, :length]`` (every token given to this rank; with a window, those not dropped)."""
        return self.held

    @property
    def capacity(self) -> int:
        """Slots of storage on this rank."""
        return self.k.shape[1]

    @property
    def total(self) -> int:
        """Tokens cached over all ranks: the position of the next token."""
        return sum(self.counts)

    @property
    def nbytes(self) -> int:
        """This rank's cache storage in bytes (keys, values and positions)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.positions))

    @staticmethod
    def from_prefill(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *, capacity: int,
                     group: dist.ProcessGroup | None = None, window: int | None = None) -> ShardedKVCache:
        """The cache of this rank after a prefill: ``k`` ``[b, n, h_kv, d]`` / ``v`` of the ``n`` tokens
        this rank held (its shard, as the ring attention saw it), their global ``positions`` ``[n]``
        (:func:`ring_sp.layouts.rank_positions`), room for ``capacity`` tokens on this rank. ``window``: the
        layer's sliding window (see the field; every call on the cache then takes that window). Every rank
        of ``group`` (None: the default group) calls it: one all-gather of the shard lengths and capacities."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [b, n, h_kv, d] with equal b, n, h_kv")
        if positions.shape != (k.shape[1],):
            raise ValueError(f"positions {tuple(positions.shape)} must be [n] = [{k.shape[1]}] (one per cached token)")
        if capacity < k.shape[1]:
            raise ValueError(f"capacity={capacity} is less than the {k.shape[1]} tokens this rank's prefill holds; "
                             f"size it for the prompt's share plus the tokens to generate")
        positions = positions.cpu()
        if k.shape[1] > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError("positions must increase along the shard (the layouts' local order does)")
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        sizes = torch.zeros(size * 2, dtype=torch.int64)
        RingComm.of(group).all_gather(sizes, torch.tensor([k.shape[1], capacity]), "decode_cache_sizes").wait()
        sizes = sizes.view(size, 2)
        return ShardedKVCache.holding(k, v, positions, rank=rank, counts=sizes[:, 0].tolist(),
                                      capacities=sizes[:, 1].tolist(), window=window)

    @staticmethod
    def holding(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *, rank: int, counts: list[int],
                capacities: list[int], grow_by: int = 0, window: int | None = None) -> ShardedKVCache:
        """A cache holding ``k`` ``[b, n, h_kv, d]`` / ``v`` at ``positions`` ``[n]`` (host, increasing) on
        ring rank ``rank``, when every rank's ``counts`` and ``capacities`` are known without asking (no
        communication; ``counts[rank]`` must be ``n``). ``grow_by``, ``window``: see the fields (with a
        window only the keys the next token can see are copied in)."""
        if counts[rank] != k.shape[1] or capacities[rank] < k.shape[1] or positions.shape != (k.shape[1],):
            raise ValueError(f"rank {rank} holds {k.shape[1]} tokens at {tuple(positions.shape)} positions, but its count "
                             f"is {counts[rank]} and its capacity {capacities[rank]}")
        check_window(window)
        positions, size = positions.cpu(), capacities[rank]
        if window is not None:  # the next token (at sum(counts)) sees positions > sum(counts) - window: a suffix
            first = int(torch.searchsorted(positions, sum(counts) - window, right=True))
            k, v, positions = k[:, first:], v[:, first:], positions[first:]
            size = min(size, _with_room(k.shape[1]))
        return ShardedKVCache(*_slots(k, v, positions, size), rank, list(counts), list(capacities), grow_by, window,
                              held=k.shape[1])

    def next_owner(self) -> int:
        """The rank the next token's key and value go to: the fewest cached tokens, ties the lowest rank."""
        return min(range(len(self.counts)), key=lambda r: (self.counts[r], r))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store one token's ``k`` ``[b, 1, h_kv, d]`` / ``v`` on :meth:`next_owner` (every rank calls it
        with the same token); returns its position."""
        owner, position = self.next_owner(), self.total
        if self.counts[owner] == self.capacities[owner]:
            self._make_room(owner, 1, position)
        if owner == self.rank:
            self._fit(1, position)
            self.k[:, self.held] = k[:, 0]
            self.v[:, self.held] = v[:, 0]
            self.positions[self.held] = position
            self.held += 1
        self.counts[owner] += 1
        return position

    def append_chunk(self, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        """Store ``c`` new tokens' ``k`` ``[b, c, h_kv, d]`` / ``v`` (every rank calls it with the same tokens):
        each rank takes a contiguous piece, in rank order, as many as the owner rule would give it one by one
        (:func:`final_counts`: the shards stay balanced). Returns the pieces' bounds in the chunk, ``R + 1``
        of them: rank ``r`` holds tokens ``[bounds[r], bounds[r + 1])``."""
        start, c = self.total, k.shape[1]
        final = final_counts(self.counts, start + c)
        bounds = [0]
        for r, (before, after) in enumerate(zip(self.counts, final)):
            bounds.append(bounds[-1] + after - before)
            if after > self.capacities[r]:
                self._make_room(r, after - self.capacities[r], start + bounds[r] + self.capacities[r] - before)
        a, b = bounds[self.rank], bounds[self.rank + 1]
        self._fit(b - a, start)
        n = self.held
        self.k[:, n: n + b - a], self.v[:, n: n + b - a] = k[:, a:b], v[:, a:b]
        self.positions[n: n + b - a] = torch.arange(start + a, start + b)
        self.counts, self.held = final, n + b - a
        return bounds

    def _make_room(self, owner: int, missing: int, token: int) -> None:
        """Rank ``owner`` lacks ``missing`` slots, ``token`` the first position that does not fit (every rank
        calls it alike, from the same counts): with ``grow_by`` its capacity grows by whole blocks (its
        storage too, on that rank), else every rank raises, none waits."""
        if not self.grow_by:
            raise ValueError(f"the KV cache is full: token {token} would go to rank {owner}, which holds its capacity "
                             f"of {self.capacities[owner]} tokens; the caches were sized for fewer tokens than this "
                             f"generation needs (pass a larger capacity to ShardedKVCache.from_prefill)")
        self.capacities[owner] += -(-missing // self.grow_by) * self.grow_by
        if owner == self.rank and self.window is None:  # (a window's storage is sized by _fit)
            self._move(0, self.capacities[owner])

    def _fit(self, n: int, position: int) -> None:
        """Storage for ``n`` more tokens on this rank, the first at ``position``. Without a window it was sized
        with the capacity (:meth:`_make_room`). With one, once full: the keys no token from ``position`` on can
        see are dropped (``<= position - window``) and the rest moved (one copy) into storage with room for an
        eighth more (:func:`_with_room`; within the capacity): a copy per ``live / 8`` tokens appended, at most."""
        if self.held + n <= self.capacity or self.window is None:
            return
        dead = int(torch.searchsorted(self.positions[: self.held], position - self.window, right=True))
        live = self.held - dead
        self._move(dead, min(self.capacities[self.rank], max(self.capacity, _with_room(live + n))))

    def _move(self, first: int, size: int) -> None:
        """Slots ``[first, held)`` moved into new storage of ``size`` slots (a copy)."""
        n = self.held
        self.k, self.v, self.positions = _slots(self.k[:, first:n], self.v[:, first:n], self.positions[first:n], size)
        self.held = n - first


def _with_room(tokens: int) -> int:
    """Slots for a window's cache holding ``tokens``: an eighth more (16 at least) to append into before it must
    move them again (a window held whole on one rank, zigzag's tail, stays within 1/8 of the window's bytes)."""
    return tokens + max(16, tokens // 8)


def check_fits_cache(k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache, what: str) -> None:
    """New tokens' ``k`` / ``v`` have the cache's batch, KV heads and head sizes (``what``: "token", "chunk")."""
    if k.shape[2:] != cache.k.shape[2:] or v.shape[2:] != cache.v.shape[2:] or k.shape[0] != cache.k.shape[0]:
        raise ValueError(f"the {what}'s k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache's "
                         f"k {tuple(cache.k.shape)} / v {tuple(cache.v.shape)} (batch, KV heads, head sizes)")


def check_window(window: int | None, cache: ShardedKVCache | None = None) -> None:
    """``window`` is a positive int or None, and, for a call on ``cache``, the window the cache was made for
    (a cache with a window dropped the keys outside it)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r} must be a positive int (keys a token sees, itself included) or None")
    if cache is not None and cache.window is not None and window != cache.window:
        raise ValueError(f"window={window} on a cache made for window={cache.window} (ShardedKVCache.window: it kept "
                         f"only the keys that window can see); pass window={cache.window}")


def final_counts(counts: list[int], total: int) -> list[int]:
    """Every rank's cached tokens once ``total`` are cached, each new token on the rank with the fewest
    (ties: the lowest), as :meth:`ring_sp.decode.ShardedKVCache.next_owner` assigns them."""
    extra = total - sum(counts)

    def needed(level: int) -> int:  # new tokens that bring every rank up to ``level``
        return sum(max(0, level - c) for c in counts)

    low, high = min(counts), max(counts) + extra
    while low < high:  # the highest level the new tokens fill on every rank
        mid = (low + high + 1) // 2
        low, high = (mid, high) if needed(mid) <= extra else (low, mid - 1)
    final, left = [max(c, low) for c in counts], extra - needed(low)
    for r, count in enumerate(final):  # the rest, one each, to the lowest ranks at that level
        if left and count == low:
            final[r], left = count + 1, left - 1
    return final


def _slots(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
           capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Storage for ``capacity`` tokens holding ``k`` ``[b, n, h_kv, d]`` / ``v`` at host ``positions`` ``[n]``
    in its first ``n`` slots (the rest empty: position -1)."""
    n = k.shape[1]
    keys, values = k.new_empty(k.shape[0], capacity, *k.shape[2:]), v.new_empty(v.shape[0], capacity, *v.shape[2:])
    slots = torch.full((capacity,), -1, dtype=torch.int64)
    keys[:, :n], values[:, :n], slots[:n] = k, v, positions
    return keys, values, slots


def _visible(cache: ShardedKVCache, position: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's cached keys/values the token at ``position`` sees: all of them, or those inside
    ``window`` (``position - window < p <= position``): a suffix of the slots (positions increase), a view."""
    start = 0
    if window is not None:
        start = int(torch.searchsorted(cache.positions[: cache.length], position - window, right=True))
    return cache.k[:, start: cache.length], cache.v[:, start: cache.length]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache, *,
                     group: dist.ProcessGroup | None = None, scale: float | None = None,
                     window: int | None = None, sinks: torch.Tensor | None = None,
                     backend: str = "auto", agree: torch.Tensor | None = None) -> torch.Tensor:
    """One new token's attention over the whole sharded cache, after storing its own key and value
    (:meth:`ShardedKVCache.append`). q ``[b, 1, h, d]``, k ``[b, 1, h_kv, d]``, v ``[b, 1, h_kv, d_v]``
    (the same on every rank of ``group``, the ring the cache is sharded over) -> out ``[b, 1, h, d_v]``
    in q's dtype, equal on every rank. ``window``: a sliding window (the token sees ``window`` keys,
    itself included); ``sinks`` ``[h]``: attention sinks. ``agree``: values every rank must hold alike (the
    step's token ids: a rank that sampled another token raises with the others), compared with the cache's
    count and position. Collective: one all-gather."""
    if q.dim() != 4 or q.shape[1] != 1 or k.shape[:2] != q.shape[:2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: one token each, "
                         f"q [b, 1, h, d], k [b, 1, h_kv, d], v [b, 1, h_kv, d_v]")
    check_fits_cache(k, v, cache, "token")
    check_window(window, cache)
    # resolved on every rank, whether or not it sees a key: a bad backend raises everywhere, before any message
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], v.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse, position = _stored_partial(kernel, q, k, v, cache, window, scale)
    return merge_over_ranks(out, lse, (cache.total, position), cache.rank, group=group, agree=agree,
                            sinks=sinks).to(q.dtype)


def decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[ShardedKVCache], *,
                group: dist.ProcessGroup | None = None, scale: float | None = None, window: int | None = None,
                sinks: torch.Tensor | None = None, backend: str = "auto",
                agree: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode_attention` for a batch whose rows have caches of their own (prompts of different lengths,
    each prefilled alone): row ``i`` of q ``[B, 1, h, d]`` / k / v against ``caches[i]`` (batch 1 each). One
    kernel call per row, ONE all-gather for the batch (every row's partials and cached total). -> ``[B, 1, h,
    d_v]``, equal on every rank."""
    if q.dim() != 4 or q.shape[1] != 1 or k.shape[:2] != q.shape[:2] or q.shape[0] != len(caches):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: one token per row, one cache per row "
                         f"({len(caches)} caches)")
    for i, cache in enumerate(caches):
        check_fits_cache(k[i:i + 1], v[i:i + 1], cache, "token")
        check_window(window, cache)
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[-1], v.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    parts = [_stored_partial(kernel, q[i:i + 1], k[i:i + 1], v[i:i + 1], cache, window, scale)
             for i, cache in enumerate(caches)]
    totals = [cache.total for cache in caches]
    mine = torch.tensor(totals, device=q.device)  # every row's cached total joins the agreement
    agree = mine if agree is None else torch.cat([agree.flatten().to(mine), mine])
    out, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    stamp = (sum(totals), sum(p[2] for p in parts))
    return merge_over_ranks(out, lse, stamp, caches[0].rank, group=group, agree=agree, sinks=sinks).to(q.dtype)


def _stored_partial(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache,
                    window: int | None, scale: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One token stored (:meth:`ShardedKVCache.append`) and its query attended to this rank's shard:
    ``(out [b, 1, h, d_v], lse [b, h, 1], position)``; no visible key here: 0 and -inf (contributes nothing)."""
    position = cache.append(k, v)
    keys, values = _visible(cache, position, window)
    if keys.shape[1]:
        return (*kernel.forward(q, keys, values, causal=False, scale=scale), position)
    b, _, h, _ = q.shape
    lse = torch.full((b, h, 1), float("-inf"), dtype=softmax_stat_dtype(q.dtype), device=q.device)
    return q.new_zeros(b, 1, h, v.shape[-1]), lse, position


def merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, stamp: tuple[int, int], rank: int, *,
                     group: dist.ProcessGroup | None, agree: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's partial ``out`` ``[b, s, h, d_v]`` / ``lse`` ``[b, h, s]`` of the same queries, merged:
    ONE all-gather (in the softmax statistics' dtype) that also carries ``stamp`` (cached tokens, position)
    and ``agree`` for the agreement (:func:`gather_agreed`), then the ring's merge, sinks folded in last.
    -> ``[b, s, h, d_v]`` in that dtype, the same bits on every rank (each merges the same parts alike)."""
    b, s, h, d_v = out.shape
    gathered = gather_agreed(torch.cat([out.to(lse.dtype).flatten(), lse.flatten()]), stamp, rank, group=group,
                             agree=agree, kind="decode_partials")
    world, split = gathered.shape[0], b * s * h * d_v  # every rank merges the same parts alike: the same bits
    merged_out, merged_lse = merge_partials(gathered[:, :split].view(world, b, s, h, d_v),
                                            gathered[:, split:].view(world, b, h, s))
    if sinks is not None:
        merged_out, merged_lse = fold_sinks(merged_out, merged_lse, sinks)
    return merged_out


def gather_agreed(payload: torch.Tensor, stamp: tuple[int, int], rank: int, *, group: dist.ProcessGroup | None,
                  agree: torch.Tensor | None, kind: str) -> torch.Tensor:
    """Every rank's flat ``payload`` (float32/64) in ONE all-gather that also carries ``stamp`` (cached tokens,
    position, from the host's counts: a rank that counted otherwise must show it) and ``agree``, compared
    on every rank (:func:`_check_agreement`: one error everywhere) -> ``[world, payload.numel()]``."""
    acc = payload.dtype
    # the stamp pinned on CUDA (torch caches pinned blocks) so the copy does not wait for the GPU
    stamps = torch.tensor(stamp, dtype=acc, pin_memory=payload.is_cuda).to(payload.device, non_blocking=True)
    extra = agree.to(acc).flatten() if agree is not None else stamps[:0]
    mine = torch.cat([payload, extra, stamps])
    world = dist.get_world_size(group)
    gathered = mine.new_empty(world * mine.numel())
    RingComm.of(group).all_gather(gathered, mine, kind).wait()
    gathered = gathered.view(world, mine.numel())
    _check_agreement(gathered[:, payload.numel():], rank, extra.numel())
    return gathered[:, : payload.numel()]


def _check_agreement(stamps: torch.Tensor, rank: int, extra: int) -> None:
    """Every rank cached the same number of tokens, decodes the same position and holds the same ``extra``
    values (the agree= ones, first), else one error everywhere."""
    differs = (stamps != stamps[0]).any(dim=1)
    if bool(differs.any()):  # the one host read of the call
        odd = differs.nonzero().flatten().tolist()
        seen = {r: (int(stamps[r, -2]), int(stamps[r, -1])) for r in range(stamps.shape[0])}
        if all(s == seen[0] for s in seen.values()):
            raise RuntimeError(f"rank {rank}: the ranks decode different tokens: rank(s) {odd} hold other values than "
                               f"rank 0 ({stamps[:, :extra].tolist()}); every rank must sample alike (the same "
                               f"generation arguments and the same seed on every rank: transformers.set_seed)")
        raise RuntimeError(f"rank {rank}: the ranks' KV caches disagree (cached tokens, position) per rank: {seen}; "
                           f"rank(s) {odd} differ from rank 0: every rank must prefill the same prompt and decode the "
                           f"same tokens")


__all__ = ["ShardedKVCache", "decode_attention", "decode_rows", "final_counts", "gather_agreed", "merge_over_ranks"]
