"""Decoding against a KV cache sharded over a ring (issue 46's core entry, ``ring_sp.decode``).

A prompt of N tokens prefilled through the ring (its shards as the ring held them, any layout),
then T tokens decoded one at a time: each step's output equals the float64 oracle of that query
against every token so far (windows and sinks included), on every rank alike; the shards stay
balanced, gathered they are the whole cache, and each rank holds 1/R of it. Caches that differ
between ranks, or a cache too small, are one clear error on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import window_mask
from oracle import OUT_TOL, make_inputs, oracle_attention
from ring_sp.decode import ShardedKVCache, decode_attention, decode_rows, final_counts
from ring_sp.layouts import rank_positions

PROMPT, NEW = 24, 7


def decode_case(layout: str, dtype: str, window: int | None, sinks: bool, d_v: int | None, seed: int,
                grid: tuple[int, int] | None = None) -> dict:
    """``grid``: (U, R) of a topology whose SP group the cache is sharded over (the prompt's sequence shards,
    every KV head: what each rank's attention receives before Ulysses' all-to-all)."""
    topo = ring_sp.init_sequence_parallel(*grid) if grid else None
    rank, world = (topo.sp_rank, topo.sp_size) if topo else (dist.get_rank(), dist.get_world_size())
    group = topo.sp_group if topo else None
    dt = getattr(torch, dtype)
    inputs = make_inputs(seed, 2, PROMPT + NEW, 4, 2, 8, dt, d_v=d_v, sinks=sinks)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    prompt_k, prompt_v = (ring_sp.shard_sequence(x[:, :PROMPT], rank=rank, world_size=world, layout=layout) for x in (k, v))
    capacity = PROMPT // world + math.ceil(NEW / world)
    cache = ShardedKVCache.from_prefill(prompt_k, prompt_v, rank_positions(layout, world, PROMPT, rank), capacity=capacity,
                                        group=group)
    want_out, _ = oracle_attention(q, k, v, causal=True, mask=window_mask(PROMPT + NEW, window or PROMPT + NEW), sinks=inputs.get("sinks"))
    errors = []
    for t in range(PROMPT, PROMPT + NEW):
        out = decode_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, window=window, sinks=inputs.get("sinks"),
                               group=group)
        assert out.dtype == dt and out.shape == (2, 1, 4, v.shape[-1])
        errors.append((out.double() - want_out[:, t:t + 1]).abs().max().item())
    filled = cache.positions[: cache.length]
    return {"errors": errors, "out": out, "counts": cache.counts, "positions": filled.tolist(),
            "k_ok": torch.equal(cache.k[:, : cache.length], k[:, filled]), "nbytes": cache.nbytes,
            "one_rank_bytes": (k.numel() + v.numel()) * k.element_size() + (PROMPT + NEW) * 8}


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "contiguous"), (4, "striped"), (4, "zigzag")])
@pytest.mark.parametrize("window,sinks,d_v", [(None, False, None), (5, True, None), (9, False, 6)])
def test_decode_equals_the_oracle_on_every_rank(pools, world: int, layout: str, window, sinks: bool, d_v) -> None:
    results = pools.get(world).run(decode_case, layout, "float64", window, sinks, d_v, world)
    for result in results:
        assert max(result["errors"]) <= OUT_TOL[torch.float64].atol, result["errors"]
        assert torch.equal(result["out"], results[0]["out"])  # every rank alike, bit for bit
        assert result["k_ok"] and result["counts"] == results[0]["counts"]
    counts = results[0]["counts"]
    assert sum(counts) == PROMPT + NEW and max(counts) - min(counts) <= 1  # balanced
    assert sorted(p for r in results for p in r["positions"]) == list(range(PROMPT + NEW))  # the whole cache, once
    # 1/R of one rank's cache, rounded up to a whole token
    assert all(r["nbytes"] <= r["one_rank_bytes"] / world + r["one_rank_bytes"] / (PROMPT + NEW) for r in results)


def test_decode_over_a_grids_sp_group(pools) -> None:
    """U2 x R2: the cache sharded by sequence over all four SP ranks, every KV head on each."""
    results = pools.get(4).run(decode_case, "zigzag", "float64", 5, True, None, 11, (2, 2))
    assert all(max(r["errors"]) <= OUT_TOL[torch.float64].atol and r["k_ok"] for r in results)
    assert sorted(p for r in results for p in r["positions"]) == list(range(PROMPT + NEW))


def test_decode_bf16_within_its_tolerance(pools) -> None:
    results = pools.get(2).run(decode_case, "zigzag", "bfloat16", 5, False, None, 3)
    assert all(max(r["errors"]) <= 2 * OUT_TOL[torch.bfloat16].atol for r in results), [r["errors"] for r in results]


def contiguous_prefill(seed: int, seq_len: int, per_rank: int,
                       capacity: int) -> tuple[dict[str, torch.Tensor], ShardedKVCache]:
    """fp64 inputs of ``seq_len`` tokens (1 x 2 heads x 4) and this rank's cache of the prompt's
    ``per_rank`` contiguous tokens of its own (rank r: tokens r * per_rank ...), room for ``capacity``."""
    rank = dist.get_rank()
    inputs = make_inputs(seed, 1, seq_len, 2, 2, 4, torch.float64)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    cache = ShardedKVCache.from_prefill(inputs["k"][:, mine], inputs["v"][:, mine], torch.arange(seq_len)[mine],
                                        capacity=capacity)
    return inputs, cache


def disagreeing_caches() -> str:
    rank = dist.get_rank()
    inputs, cache = contiguous_prefill(1, 9, 4, capacity=8)
    k, v = inputs["k"], inputs["v"]
    if rank == 1:
        cache.counts[0] += 1  # rank 1 thinks one more token is cached (another prompt, a skipped step)
    try:
        decode_attention(inputs["q"][:, 8:], k[:, 8:], v[:, 8:], cache)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_caches_that_differ_raise_on_every_rank(pools) -> None:
    errors = pools.get(2).run(disagreeing_caches)
    assert all("KV caches disagree" in e and "rank(s) [1] differ from rank 0" in e for e in errors), errors


def full_cache() -> str:
    inputs, cache = contiguous_prefill(2, 6, 2, capacity=2 + (dist.get_rank() == 0))
    k, v = inputs["k"], inputs["v"]
    decode_attention(inputs["q"][:, 4:5], k[:, 4:5], v[:, 4:5], cache)  # fits on rank 0
    try:
        decode_attention(inputs["q"][:, 5:6], k[:, 5:6], v[:, 5:6], cache)  # rank 1 is full
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_full_cache_raises_on_every_rank_before_any_message(pools) -> None:
    errors = pools.get(2).run(full_cache)
    assert all("token 5 would go to rank 1, which holds its capacity of 2 tokens" in e for e in errors), errors


def bad_backend() -> str:
    """Window 1: only the new token's owner sees a key; the others must still refuse the backend, not wait."""
    inputs, cache = contiguous_prefill(3, 5, 2, capacity=3)
    k, v = inputs["k"], inputs["v"]
    try:
        decode_attention(inputs["q"][:, 4:5], k[:, 4:5], v[:, 4:5], cache, window=1, backend="flash")
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_bad_backend_raises_on_every_rank(pools) -> None:
    assert all("backend='flash' is not one of" in e for e in pools.get(2).run(bad_backend, timeout=60))


def test_bad_shapes_are_named() -> None:
    cache = ShardedKVCache(torch.zeros(1, 4, 2, 4), torch.zeros(1, 4, 2, 4), torch.full((4,), -1), 0, [0], [4])
    with pytest.raises(ValueError, match=r"one token each"):
        decode_attention(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), cache)
    with pytest.raises(ValueError, match=r"do not match the cache"):
        decode_attention(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), cache)
    with pytest.raises(ValueError, match=r"window=0 must be a positive int"):
        decode_attention(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), cache, window=0)
    with pytest.raises(ValueError, match=r"positions must increase"):
        ShardedKVCache.from_prefill(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), torch.tensor([0, 2, 1]), capacity=4)
    with pytest.raises(ValueError, match=r"capacity=2 is less than the 3 tokens"):
        ShardedKVCache.from_prefill(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), torch.arange(3), capacity=2)


def module_case(window: int | None) -> dict:
    """SequenceParallelAttention.prefill / .decode at U2 x R2 (the core entry): the prompt's output and every
    decoded token's equal the float64 oracle (sinks, GQA, a window across the shards)."""
    topo = ring_sp.init_sequence_parallel(2, 2)
    attn = ring_sp.SequenceParallelAttention(topo, layout="zigzag", sliding_window=window)
    inputs = make_inputs(5, 2, PROMPT + NEW, 4, 2, 8, torch.float64, sinks=True)
    q, k, v, sinks = inputs["q"], inputs["k"], inputs["v"], inputs["sinks"]
    shard = [topo.shard_sequence(x[:, :PROMPT], layout="zigzag") for x in (q, k, v)]
    out, cache = attn.prefill(*shard, capacity=PROMPT // 4 + math.ceil(NEW / 4), sinks=sinks)
    want, _ = oracle_attention(q, k, v, causal=True, mask=window_mask(PROMPT + NEW, window or PROMPT + NEW), sinks=sinks)
    errors = [(out - topo.shard_sequence(want[:, :PROMPT], layout="zigzag")).abs().max().item()]
    for t in range(PROMPT, PROMPT + NEW):
        step = attn.decode(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, sinks=sinks)
        errors.append((step - want[:, t:t + 1]).abs().max().item())
    return {"errors": errors, "counts": cache.counts, "window": cache.window}


@pytest.mark.parametrize("window", [None, 5])
def test_module_prefill_and_decode_equal_the_oracle(pools, window) -> None:
    for result in pools.get(4).run(module_case, window):
        assert max(result["errors"]) <= OUT_TOL[torch.float64].atol, result["errors"]
        assert sum(result["counts"]) == PROMPT + NEW and result["window"] == window  # the module's window cache


def test_a_growing_cache_moves_its_tokens_once_per_block() -> None:
    """grow_by: the owner of a token that finds it full grows by a block (its tokens kept); every rank counts it."""
    k = torch.arange(2 * 2 * 4, dtype=torch.float64).view(1, 2, 2, 4)
    cache = ShardedKVCache.holding(k, k + 1, torch.tensor([0, 3]), rank=0, counts=[2, 2], capacities=[2, 2], grow_by=3)
    storages = set()
    for token in range(6):  # positions 4..9 alternate between rank 0 and rank 1
        new = torch.full((1, 1, 2, 4), float(100 + token), dtype=torch.float64)
        assert cache.append(new, new + 1) == 4 + token
        storages.add(cache.k.data_ptr())
    assert cache.counts == [5, 5] and cache.capacities == [5, 5] and len(storages) == 1  # one growth of 3 slots
    assert torch.equal(cache.k[:, :2], k) and cache.positions.tolist() == [0, 3, 4, 6, 8]
    assert cache.k[0, 2:, 0, 0].tolist() == [100.0, 102.0, 104.0]


def rows_case(layout: str) -> dict:
    """Two rows with prompts of 24 and 12 tokens, each prefilled into a cache of its own, then 5 steps decoded as
    one batch (:func:`ring_sp.decode.decode_rows`): each row against the float64 oracle of its own tokens."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lengths, steps = (24, 12), 5
    rows = [make_inputs(9 + i, 1, n + steps, 4, 2, 8, torch.float64, sinks=True) for i, n in enumerate(lengths)]
    sinks = rows[0]["sinks"]
    caches = []
    for inputs, n in zip(rows, lengths):
        k, v = (ring_sp.shard_sequence(inputs[x][:, :n], rank=rank, world_size=world, layout=layout) for x in "kv")
        caches.append(ShardedKVCache.from_prefill(k, v, rank_positions(layout, world, n, rank), capacity=n + steps))
    errors = []
    for t in range(steps):
        q, k, v = (torch.cat([r[x][:, n + t: n + t + 1] for r, n in zip(rows, lengths)]) for x in "qkv")
        out = decode_rows(q, k, v, caches, sinks=sinks, window=None)
        for i, (inputs, n) in enumerate(zip(rows, lengths)):
            want, _ = oracle_attention(inputs["q"][:, : n + t + 1], inputs["k"][:, : n + t + 1], inputs["v"][:, : n + t + 1],
                                       causal=True, sinks=sinks)
            errors.append((out[i:i + 1] - want[:, -1:]).abs().max().item())
    return {"errors": errors, "out": out, "totals": [c.total for c in caches]}


@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "contiguous")])
def test_rows_with_caches_of_their_own_decode_as_one_batch(pools, world: int, layout: str) -> None:
    results = pools.get(world).run(rows_case, layout)
    for result in results:
        assert max(result["errors"]) <= OUT_TOL[torch.float64].atol, result["errors"]
        assert torch.equal(result["out"], results[0]["out"]) and result["totals"] == [29, 17]


LONG = 400  # a prompt much longer than the window


def windowed_cache_case(layout: str, window: int) -> dict:
    """A cache made for a sliding ``window`` (``from_prefill(window=)``): 24 decode steps, a chunk of 6, 24 more
    steps, each against the float64 oracle of the window; the storage each rank keeps after each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = LONG + 54
    inputs = make_inputs(4, 1, total, 2, 1, 4, torch.float64)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    prompt_k, prompt_v = (ring_sp.shard_sequence(x[:, :LONG], rank=rank, world_size=world, layout=layout) for x in (k, v))
    cache = ShardedKVCache.from_prefill(prompt_k, prompt_v, rank_positions(layout, world, LONG, rank),
                                        capacity=LONG // world + math.ceil((total - LONG) / world), window=window)
    want, _ = oracle_attention(q, k, v, causal=True, mask=window_mask(total, window))
    errors, slots, at = [], [cache.capacity], LONG
    for n in [1] * 24 + [6] + [1] * 24:
        new = slice(at, at + n)
        attend = decode_attention if n == 1 else ring_sp.chunk_attention
        out = attend(q[:, new], k[:, new], v[:, new], cache, window=window)
        errors.append((out.double() - want[:, new]).abs().max().item())
        slots.append(cache.capacity)
        at += n
    held = cache.positions[: cache.length]
    return {"errors": errors, "out": out, "counts": cache.counts, "slots": slots, "held": held.tolist(),
            "k_ok": torch.equal(cache.k[:, : cache.length], k[:, held])}


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_a_windowed_cache_keeps_about_its_share_of_the_window(pools, layout: str) -> None:
    """The keys no later token can see are dropped: every step still equals the oracle, every rank alike, the
    bookkeeping (counts: the tokens each rank was given) as without a window, and each rank's storage stays
    within twice the window plus the chunk, against the ~114 slots of its share of the sequence."""
    window, world = 12, 4
    results = pools.get(world).run(windowed_cache_case, layout, window)
    total = LONG + 54
    for result in results:
        assert max(result["errors"]) <= OUT_TOL[torch.float64].atol, result["errors"]
        assert torch.equal(result["out"], results[0]["out"]) and result["k_ok"]
        assert max(result["slots"]) <= 2 * (window + 6) + 1, result["slots"]
    counts = results[0]["counts"]
    assert sum(counts) == total and max(counts) - min(counts) <= 1
    held = sorted(p for r in results for p in r["held"])
    assert len(held) == len(set(held)) and set(range(total - window + 1, total)) <= set(held)  # what the next sees


def test_a_window_other_than_the_caches_is_refused_by_name() -> None:
    k = torch.zeros(1, 4, 1, 2, dtype=torch.float64)
    cache = ShardedKVCache.holding(k, k, torch.arange(4), rank=0, counts=[4], capacities=[6], window=3)
    assert cache.length == 2 and cache.positions[:2].tolist() == [2, 3]  # what position 4 sees with window 3
    new = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    for window in (None, 4):
        with pytest.raises(ValueError, match=f"window={window} on a cache made for window=3"):
            decode_attention(new, new, new, cache, window=window)
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        ShardedKVCache.holding(k, k, torch.arange(4), rank=0, counts=[4], capacities=[6], window=0)


def test_final_counts_follow_the_owner_rule() -> None:
    """generate()'s fixed capacities (RingSPCache(max_cache_len=)) are where the owner rule puts every token."""
    for counts, total in [([3, 3, 3, 3], 20), ([4, 4, 3, 3], 15), ([5, 1, 2, 2], 10), ([2, 2], 4), ([7, 0, 0], 8)]:
        cache = ShardedKVCache(torch.zeros(1, 0, 1, 1), torch.zeros(1, 0, 1, 1), torch.zeros(0), 0, list(counts),
                               [10**6] * len(counts))
        for _ in range(total - sum(counts)):
            cache.counts[cache.next_owner()] += 1
        assert final_counts(counts, total) == cache.counts, (counts, total)
