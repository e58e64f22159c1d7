"""``document_balanced``: which rank holds each document of a packed sequence (issue 44).

A pure, deterministic function of the documents (``cu_seqlens``), the number of ranks ``P``
and the kernel's tile, computed alike on every rank from the boundaries the ranks agree on
(the agreement compares ``cu_seqlens``; so do the shard fingerprints), in integers only:

* every rank holds exactly ``N / P`` tokens, in increasing positions (static shapes; Ulysses
  and the model's per-token work need nothing else);
* a document stays WHOLE on one rank unless balance or capacity needs a cut: none of its KV
  travels, and the kernel runs it as one causal block, not ``2P`` slivers below a tile;
* a document that must be cut is cut as zigzag chunks over the fewest ranks ``k`` that
  balance it (``k`` divides ``P``), on an aligned block of ``k`` consecutive ranks: only those
  ranks exchange its KV, and under a ``U x R`` grid with ``k <= U`` (powers of two) the block is
  one Ulysses group, the document whole on its ring rank. Chunks are below a tile only when no
  wider spread fits;
* the documents that no longer fit whole where they would balance (the smallest, placed last)
  fill the ranks' remaining rows, cut where a rank is full: its last piece to the least loaded.

Balance is on what a GPU pays: score pairs rounded up to the kernel's ``(rows, keys)`` tiles
(:data:`PLACEMENT_TILE`; a shard shorter than eight tiles uses proportionally smaller ones,
so small packs balance as large ones do). Per-token work (projections, MLP, loss) is the same on
every rank, as every rank holds the same number of tokens. Documents are placed largest
share first on the rank (block) with room and the least projected load (LPT); while the result
is more than 4% off the mean, the most a rank may take of one document shrinks by a quarter
and the placement runs again (a few rounds; the first within 4% wins: the fewest documents
cut, the fewest rows read across ranks), else the best balanced of them. O(documents x P)
integer work per round, no tensor per token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .runs import Boundaries, ShardRuns, memoised
from .shapes import divisors

PLACEMENT_TILE = (128, 64)  # (query rows, keys) of a FlashAttention-2/3 or cuDNN tile on Hopper
_SMALL_SHARD_TILES = 8  # a shard shorter than this many tiles places with proportionally smaller tiles
_ACCEPT = (104, 100)  # estimated max/mean work accepted: the first placement within it (the fewest cuts) wins
_ROUNDS = 12  # at most this many placements, each allowing 3/4 of the previous share of one document


def effective_tile(shard_len: int, tile: tuple[int, int] = PLACEMENT_TILE) -> tuple[int, int]:
    """The tile the placement balances on for shards of ``shard_len`` tokens: ``tile``, scaled
    down for shards shorter than eight tiles (rows at least 1)."""
    rows, keys = tile
    cap = max(1, shard_len // _SMALL_SHARD_TILES)
    if rows <= cap:
        return tile
    return cap, max(1, keys * cap // rows)


@functools.lru_cache(maxsize=4096)  # packs repeat lengths; the placement asks for each several times
def causal_tile_pairs(n: int, tile: tuple[int, int]) -> int:
    """Score pairs a kernel computes for a causal ``n x n`` block in ``tile`` tiles (a tile
    holding any visible pair is computed whole)."""
    if n <= 0:
        return 0
    rows, keys = tile
    full, rest = divmod(n, rows)
    if rows % keys == 0:
        per = rows // keys
        tiles = per * full * (full + 1) // 2
    else:
        tiles = sum(((i + 1) * rows - 1) // keys + 1 for i in range(full))
    if rest:
        tiles += (n - 1) // keys + 1
    return tiles * rows * keys


def full_tile_pairs(nq: int, nk: int, tile: tuple[int, int]) -> int:
    """Score pairs of a full ``nq x nk`` block in ``tile`` tiles."""
    if nq <= 0 or nk <= 0:
        return 0
    rows, keys = tile
    return -(-nq // rows) * rows * (-(-nk // keys)) * keys


def zigzag_chunks(length: int, k: int) -> list[tuple[int, int]]:
    """(offset, size) of the ``2k`` chunks of a document of ``length`` tokens, sizes differing by
    at most one (the first ``length % 2k`` one longer); rank ``j`` of its block holds chunks
    ``j`` and ``2k - 1 - j``."""
    c, e = divmod(length, 2 * k)
    return [(i * c + min(i, e), c + (i < e)) for i in range(2 * k)]


def zigzag_read_rows(length: int, k: int) -> int:
    """KV rows the ``k`` ranks of a document cut into ``2k`` zigzag chunks receive from one another
    over a causal pass: rank ``j``'s later chunk reads every earlier chunk it does not hold
    (``0.75 (k - 1) length`` for even chunks)."""
    chunks = zigzag_chunks(length, k)
    return sum(sum(s for i, (_, s) in enumerate(chunks[:2 * k - 1 - j]) if i != j) for j in range(k))


def spread_shares(length: int, k: int, tile: tuple[int, int]) -> list[tuple[int, int]]:
    """(tokens, estimated work) of each rank of a block of ``k`` holding a document of ``length``
    (``k == 1``: whole): each chunk's causal square plus its block against the earlier keys."""
    if k == 1:
        return [(length, causal_tile_pairs(length, tile))]
    chunks = zigzag_chunks(length, k)
    shares = []
    for j in range(k):
        (a, s), (b, t) = chunks[j], chunks[2 * k - 1 - j]
        shares.append((s + t, causal_tile_pairs(s, tile) + full_tile_pairs(s, a, tile)
                       + causal_tile_pairs(t, tile) + full_tile_pairs(t, b, tile)))
    return shares


@dataclass(frozen=True)
class DocumentPlacement:
    """Where every document went. ``runs[p]``: rank ``p``'s shard (increasing positions);
    ``work[p]``: its estimated tile-rounded score pairs; ``spread[d]``: over how many ranks
    document ``d`` was cut (1: whole; 0: it filled rows, cut where ranks were full; empty
    documents 1); ``tile``: the tile it balanced on; ``read_rows``: the KV rows the ranks
    receive from one another over a causal pass, estimated from the cuts (each later piece
    of a document reads the earlier ones on other ranks)."""

    runs: tuple[ShardRuns, ...]
    work: tuple[int, ...]
    spread: tuple[int, ...]
    tile: tuple[int, int]
    read_rows: int

    @property
    def imbalance(self) -> float:
        """Estimated max / mean work per rank."""
        total = sum(self.work)
        return max(self.work) * len(self.work) / total if total else 1.0


class _Ranks:
    """The ranks' rows left and estimated work while documents are placed. A rank's projected
    load is its work plus its rows left at the density of the work still to place, so a rank
    that filled its rows with light documents is not mistaken for one with little to do."""

    def __init__(self, world_size: int, capacity: int, rest_rows: int, rest_work: int) -> None:
        self.read_rows = 0  # KV rows read across ranks (DocumentPlacement.read_rows)
        self.room = [capacity] * world_size
        self.work = [0] * world_size
        self.rest_rows, self.rest_work = max(1, rest_rows), rest_work  # of the documents not yet placed
        self.pieces: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]

    def take(self, rank: int, start: int, length: int, work: int) -> None:
        self.room[rank] -= length
        self.work[rank] += work
        self.pieces[rank].append((start, length))

    def placed(self, length: int, work: int) -> None:
        """A document (its estimated whole work) is no longer to place."""
        self.rest_rows = max(1, self.rest_rows - length)
        self.rest_work = max(0, self.rest_work - work)

    def load(self, rank: int) -> int:
        """Projected load, scaled by the rows still to place (integers: equal on every process)."""
        return self.work[rank] * self.rest_rows + self.room[rank] * self.rest_work

    def choose(self, length: int, ranks: range | None = None) -> int | None:
        """The rank with ``length`` rows left and the least projected load (the lowest on ties)."""
        fits = [r for r in (ranks or range(len(self.room))) if self.room[r] >= length]
        return min(fits, key=self.load) if fits else None


def _items(lengths: list[int], world_size: int, capacity: int, tile: tuple[int, int],
           limit: int) -> list[tuple[int, int, int]]:
    """(-share of work, document, spread) of every document, largest share first: the fewest
    ranks whose shares fit a rank and take at most ``limit`` estimated work each (unless even
    ``P`` ranks cannot share it so)."""
    spreads = divisors(world_size)  # the block sizes that tile the ranks
    items = []
    for doc, length in enumerate(lengths):
        if length == 0:
            continue
        work = causal_tile_pairs(length, tile)
        if length <= capacity and work <= limit:  # whole (most documents: no shares to weigh)
            items.append((-work, doc, 1))
            continue
        for k in spreads[1:]:
            shares = spread_shares(length, k, tile)
            if max(t for t, _ in shares) <= capacity and max(w for _, w in shares) <= limit:
                break
        items.append((-max(w for _, w in shares), doc, k))
    return sorted(items)


def _place(lengths: list[int], starts: list[int], world_size: int, capacity: int, tile: tuple[int, int],
           items: list[tuple[int, int, int]]) -> tuple[_Ranks, list[int]]:
    """One placement of :func:`_items`' documents, in their order."""
    spreads = divisors(world_size)  # the block sizes that tile the ranks
    ranks = _Ranks(world_size, capacity, sum(lengths), sum(causal_tile_pairs(n, tile) for n in lengths))
    spread = [1] * len(lengths)
    left = []
    for _, doc, k in items:
        placed = False
        # where the spread has no room, a wider one (chunks not below a tile), else the fill
        for wider in (s for s in spreads if s == k or (s > k and lengths[doc] // (2 * s) >= tile[0])):
            placed = _place_spread(ranks, lengths[doc], starts[doc], wider, tile)
            if placed:
                spread[doc] = wider
                ranks.placed(lengths[doc], causal_tile_pairs(lengths[doc], tile))
                break
        if not placed:
            left.append(doc)
    for doc in left:  # fill: the document's tail (its heaviest rows) to the least loaded rank with room
        spread[doc] = 0
        begin, end = starts[doc], starts[doc] + lengths[doc]
        while end > begin:
            rank = ranks.choose(1)
            assert rank is not None  # rows left equal the tokens left
            take = min(ranks.room[rank], end - begin)
            ranks.take(rank, end - take, take, causal_tile_pairs(take, tile) + full_tile_pairs(take, end - take - begin, tile))
            end -= take
            ranks.read_rows += end - begin  # this piece reads every earlier row of its document
    return ranks, spread


def _place_spread(ranks: _Ranks, length: int, start: int, k: int, tile: tuple[int, int]) -> bool:
    """Put a document on the rank (``k == 1``) or aligned block of ``k`` ranks with room for its
    shares and the least projected load (a block: its most loaded rank); False when none fits."""
    shares = spread_shares(length, k, tile)
    if k == 1:
        rank = ranks.choose(length)
        if rank is None:
            return False
        ranks.take(rank, start, length, shares[0][1])
        return True
    best, best_load = None, 0
    for first in range(0, len(ranks.room), k):
        if all(ranks.room[first + j] >= shares[j][0] for j in range(k)):
            load = max(ranks.load(first + j) for j in range(k))
            if best is None or load < best_load:
                best, best_load = first, load
    if best is None:
        return False
    chunks = zigzag_chunks(length, k)
    for j in range(k):
        (a, s), (b, t) = chunks[j], chunks[2 * k - 1 - j]
        ranks.take(best + j, start + a, s, 0)
        ranks.take(best + j, start + b, t, shares[j][1])
    ranks.read_rows += zigzag_read_rows(length, k)
    return True


@memoised(plain=1, documents=8)
def document_placement(cu_seqlens: Boundaries, world_size: int, tile: tuple[int, int] = PLACEMENT_TILE) -> DocumentPlacement:
    """The ``document_balanced`` placement of the documents ``cu_seqlens`` (their total a multiple
    of ``world_size``) over ``world_size`` ranks (module docstring). Cached per packing."""
    seq_len = cu_seqlens[-1]
    if world_size < 1 or seq_len % world_size:
        raise ValueError(f"document_balanced needs a length that is a multiple of world_size={world_size}; got {seq_len}")
    capacity = seq_len // world_size
    tile = effective_tile(capacity, tile)
    starts = list(cu_seqlens[:-1])
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    total = sum(causal_tile_pairs(n, tile) for n in lengths)
    limit = max(1, -(-total // world_size))  # first: one rank's share of the whole
    tried, last = [], None
    for _ in range(_ROUNDS):
        items = _items(lengths, world_size, capacity, tile, limit)
        if items == last:  # the same spreads: the same placement
            limit = max(1, limit * 3 // 4)
            continue
        last = items
        ranks, spread = _place(lengths, starts, world_size, capacity, tile, items)
        over = max(ranks.work) * world_size * _ACCEPT[1] - sum(ranks.work) * _ACCEPT[0]  # > 0: past the accepted
        tried.append((over / max(1, sum(ranks.work)), ranks, spread))
        if over <= 0 or limit == 1:  # within: later rounds only cut more documents, and move more rows
            break
        limit = max(1, limit * 3 // 4)
    _, ranks, spread = min(tried, key=lambda t: t[0])  # the last when it is within, else the best balanced
    runs = []
    for pieces in ranks.pieces:
        pieces.sort()
        runs.append(ShardRuns(torch.tensor([a for a, _ in pieces], dtype=torch.long),
                              torch.tensor([n for _, n in pieces], dtype=torch.long)))
    return DocumentPlacement(tuple(runs), tuple(ranks.work), tuple(spread), tile, ranks.read_rows)
