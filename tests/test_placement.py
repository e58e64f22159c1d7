"""Issue 44: the ``document_balanced`` placement (pure) and the exchange that moves only the
rows a receiver reads, for every layout (pure: no processes)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dist_cases import random_documents
from ring_sp.layouts import layout_positions, ring_positions, shard_runs
from ring_sp.placement import (PLACEMENT_TILE, causal_tile_pairs, document_placement, effective_tile,
                               full_tile_pairs, zigzag_chunks)
from ring_sp.schedule import exchange_plan, message_rows, rank_pair_count, row_count


def lognormal_pack(seq_len: int, seed: int, median: int = 2500, p99: int = 20000) -> tuple[int, ...]:
    """Documents drawn from a lognormal of the given median and 99th percentile, packed until
    ``seq_len`` (the last one cut to fit)."""
    import math

    rng, sigma = random.Random(seed), math.log(p99 / median) / 2.326
    cuts = [0]
    while cuts[-1] < seq_len:
        cuts.append(min(seq_len, cuts[-1] + max(1, int(median * math.exp(sigma * rng.gauss(0, 1))))))
    return tuple(cuts)


def short_pack(seq_len: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    cuts = [0]
    while cuts[-1] < seq_len:
        cuts.append(min(seq_len, cuts[-1] + rng.randint(64, 512)))
    return tuple(cuts)


def tiled_causal_reference(n: int, tile: tuple[int, int]) -> int:
    rows, keys = tile
    return sum((min(a + rows, n) - 1) // keys + 1 for a in range(0, n, rows)) * rows * keys


def test_tile_pairs_count_whole_tiles() -> None:
    for n, tile in itertools.product((1, 63, 64, 65, 128, 129, 1000, 4096), ((128, 64), (64, 64), (96, 64), (4, 2))):
        assert causal_tile_pairs(n, tile) == tiled_causal_reference(n, tile)
    assert full_tile_pairs(129, 65, (128, 64)) == 256 * 128 and full_tile_pairs(0, 5, (128, 64)) == 0
    assert effective_tile(16384) == PLACEMENT_TILE and effective_tile(64) == (8, 4) and effective_tile(3) == (1, 1)


def test_zigzag_chunks_tile_the_document() -> None:
    for length, k in itertools.product((8, 9, 17, 100), (1, 2, 3, 4)):
        chunks = zigzag_chunks(length, k)
        assert sum(s for _, s in chunks) == length and [a for a, _ in chunks] == list(
            itertools.accumulate([0] + [s for _, s in chunks[:-1]]))
        assert max(s for _, s in chunks) - min(s for _, s in chunks) <= 1


PACKS = {
    "random": lambda n, seed: random_documents(n, seed),
    "lognormal": lognormal_pack,
    "short": short_pack,
    "one document": lambda n, seed: (0, n),
    "equal documents": lambda n, seed: tuple(range(0, n + 1, n // 8)),
}


@pytest.mark.parametrize("pack", sorted(PACKS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_token_once_equal_shards_increasing(pack: str, world_size: int) -> None:
    for seq_len, seed in ((48, 0), (96, 1), (1536, 2), (24576, 3)):
        seq_len -= seq_len % world_size
        cu = PACKS[pack](seq_len, seed)
        positions = layout_positions("document_balanced", world_size, seq_len, cu)
        assert positions.shape == (world_size, seq_len // world_size)
        assert torch.equal(positions.flatten().sort().values, torch.arange(seq_len))
        assert bool((positions.diff(dim=1) > 0).all())
        # under any grid the ring shard is its members' union, in increasing order
        for u in (d for d in (2, 4) if world_size % d == 0):
            ring = ring_positions("document_balanced", u, world_size // u, seq_len, cu)
            for r in range(world_size // u):
                assert torch.equal(ring[r], positions[r * u:(r + 1) * u].flatten().sort().values)


def test_placement_is_deterministic_and_cached() -> None:
    cu = lognormal_pack(131072, 7)
    first = document_placement(cu, 8)
    document_placement.cache_clear()
    again = document_placement(tuple(int(x) for x in torch.tensor(cu).tolist()), 8)
    assert first.spread == again.spread and first.work == again.work
    assert all(torch.equal(a.start, b.start) and torch.equal(a.length, b.length) for a, b in zip(first.runs, again.runs))
    assert document_placement(cu, 8) is again


def test_short_documents_stay_whole_and_long_ones_are_cut_on_aligned_blocks() -> None:
    cu = short_pack(131072, 0)
    placed = document_placement(cu, 8)
    assert all(s in (0, 1) for s in placed.spread)  # nothing zigzag-cut
    assert sum(s == 0 for s in placed.spread) <= 8  # at most a few documents fill the ranks' last rows
    cu = lognormal_pack(131072, 2)
    placed = document_placement(cu, 8)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert any(s > 1 for s in placed.spread) and sum(s == 1 for s in placed.spread) > len(lengths) // 2
    for doc, (start, k) in enumerate(zip(cu, placed.spread)):
        if k <= 1:
            continue
        holders = [p for p in range(8) if any(a <= start < a + n or start <= a < start + lengths[doc]
                                              for a, n in zip(placed.runs[p].start.tolist(), placed.runs[p].length.tolist()))]
        assert len(holders) == k and holders[0] % k == 0 and holders == list(range(holders[0], holders[0] + k))
        assert lengths[doc] // (2 * k) >= placed.tile[0]  # never a chunk below a tile here


@pytest.mark.parametrize("seq_len,world_size", [(131072, 4), (131072, 8), (1 << 20, 8)])
def test_balance_on_real_length_distributions(seq_len: int, world_size: int) -> None:
    """Estimated tile-rounded work per rank within 5% of the mean on lognormal packs of the
    published medians and 99th percentiles (2-3K, 16-26K)."""
    for seed, (median, p99) in enumerate([(1900, 16000), (2500, 20000), (3200, 26000)]):
        placed = document_placement(lognormal_pack(seq_len, seed, median, p99), world_size)
        assert placed.imbalance <= 1.05, (seed, placed.imbalance)


def test_the_schedule_computes_what_the_placement_weighed() -> None:
    """The ring's tile-rounded pairs per rank (from its schedule) are balanced too, and short
    documents cost at most 5% over keeping every one whole."""
    seq_len, world_size, tile = 32768, 4, (128, 64)
    for cu in (lognormal_pack(seq_len, 1), short_pack(seq_len, 3)):
        counts = [rank_pair_count("document_balanced", True, r, world_size, seq_len // world_size, cu, tile=tile)
                  for r in range(world_size)]
        computed = [c.computed for c in counts]
        assert max(computed) * world_size / sum(computed) <= 1.05
        whole = sum(causal_tile_pairs(b - a, tile) for a, b in zip(cu, cu[1:]))
        assert sum(computed) <= 1.05 * whole


# ---- the exchange: what moves is what is read -------------------------------------------

def _configs():
    yield "zigzag", None, None, 1
    yield "contiguous", None, None, 1
    yield "striped", None, None, 1
    yield "zigzag", (0, 5, 9, 30, 31, 64), None, 1
    yield "document_zigzag", (0, 5, 9, 30, 31, 64), None, 1
    yield "document_balanced", (0, 5, 9, 30, 31, 64), None, 1
    yield "document_balanced", (0, 5, 9, 30, 31, 64), 4, 1
    yield "document_balanced", random_documents(64, 3), None, 2
    yield "zigzag", None, 5, 1
    yield "document_zigzag", random_documents(64, 4), 3, 2


@pytest.mark.parametrize("layout,cu,window,u", list(_configs()))
def test_both_ends_of_every_message_agree_and_it_holds_what_is_read(layout, cu, window, u) -> None:
    ring, seq_len = 4, 64
    local_len = seq_len // ring
    plans = [exchange_plan(layout, True, r, ring, local_len, cu, window, ulysses_size=u) for r in range(ring)]
    for r, t in itertools.product(range(ring), range(1, ring)):
        assert plans[r].recv_rows[t] == plans[(r - t) % ring].send_rows[t]
        read = {i for task in plans[r].schedule[t] for i in range(task.kv.start, task.kv.stop)}
        carried = {i for a, b in plans[r].recv_rows[t] or () for i in range(a, b)}
        assert read <= carried and (len(carried) <= len(read) * 10 // 9 + 1 or carried == read)
        assert (plans[r].recv_rows[t] is None) == (not plans[r].schedule[t])


def test_message_rows_merge_and_send_whole_shards_as_they_are() -> None:
    from ring_sp.schedule import BlockTask

    tasks = (BlockTask(slice(0, 4), slice(2, 5), False), BlockTask(slice(0, 4), slice(5, 6), False),
             BlockTask(slice(4, 8), slice(10, 12), True))
    assert message_rows(tasks, 100) == ((2, 6), (10, 12)) and row_count(((2, 6), (10, 12))) == 6
    assert message_rows(tasks, 12) == ((2, 6), (10, 12))  # half the shard: its ranges
    assert message_rows((BlockTask(slice(0, 1), slice(0, 9), False),), 10) == ((0, 10),)
    assert message_rows((), 10) is None


def test_whole_documents_exchange_nothing() -> None:
    """A pack whose documents all stay whole (equal documents of N / P) posts no ring message."""
    ring, seq_len = 4, 4096
    cu = tuple(range(0, seq_len + 1, seq_len // 8))
    for r in range(ring):
        plan = exchange_plan("document_balanced", True, r, ring, seq_len // ring, cu)
        assert not any(plan.receives[1:]) and not any(plan.sends[1:])
        assert shard_runs("document_balanced", 1, ring, seq_len, r, cu).length.tolist() == [512, 512]
