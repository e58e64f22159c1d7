"""Many new tokens against a KV cache sharded over a ring (issue 46: chunked prefill, a second turn).

A prompt prefilled through the ring (any layout), then chunks of new tokens alternating with
decode steps: each chunk's output equals the float64 oracle of its queries against every token
so far, by pass-Q and by pass-KV alike (and ``auto``), on every rank bit for bit; the shards stay
balanced and gathered they are the whole cache. Sliding windows (pass-Q) against the windowed oracle,
striped, zigzag and contiguous. Ranks whose chunks differ raise together.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import window_mask
from oracle import OUT_TOL, make_inputs, oracle_attention
from ring_sp.chunk_prefill import choose_exchange
from ring_sp.decode import ShardedKVCache, decode_attention
from ring_sp.layouts import rank_positions

PROMPT = 24
STEPS = (("chunk", 9), ("decode", 1), ("chunk", 5), ("decode", 1), ("chunk", 1))  # 17 tokens after the prompt


def chunk_case(layout: str, exchanges: tuple[str, str], sinks: bool, d_v: int | None, dtype: str = "float64",
               grid: tuple[int, int] | None = None, window: int | None = None, backend: str = "auto") -> dict:
    """The prompt prefilled, then :data:`STEPS`; the chunks alternate ``exchanges``; ``window``: a sliding
    window in every call. Errors per step against the oracle, the last output, the cache's counts and positions."""
    topo = ring_sp.init_sequence_parallel(*grid) if grid else None
    rank, world = (topo.sp_rank, topo.sp_size) if topo else (dist.get_rank(), dist.get_world_size())
    group = topo.sp_group if topo else None
    dt = getattr(torch, dtype)
    total = PROMPT + sum(n for _, n in STEPS)
    inputs = make_inputs(7, 2, total, 4, 2, 8, dt, d_v=d_v, sinks=sinks)
    q, k, v, s = inputs["q"], inputs["k"], inputs["v"], inputs.get("sinks")
    prompt_k, prompt_v = (ring_sp.shard_sequence(x[:, :PROMPT], rank=rank, world_size=world, layout=layout) for x in (k, v))
    cache = ShardedKVCache.from_prefill(prompt_k, prompt_v, rank_positions(layout, world, PROMPT, rank),
                                        capacity=PROMPT // world + math.ceil((total - PROMPT) / world), group=group)
    want, _ = oracle_attention(q, k, v, causal=True, sinks=s, mask=None if window is None else window_mask(total, window))
    errors, at, chunks = [], PROMPT, 0
    for kind, n in STEPS:
        new = slice(at, at + n)
        if "stored" in exchanges and (kind == "decode" or exchanges[chunks % 2] == "stored"):
            out = _stored(q[:, new], k[:, new], v[:, new], cache, s, group)  # the MLA form: stored, then attended
            chunks += kind == "chunk"
        elif kind == "decode":
            out = decode_attention(q[:, new], k[:, new], v[:, new], cache, sinks=s, group=group, window=window,
                                   backend=backend)
        else:
            out = ring_sp.chunk_attention(q[:, new], k[:, new], v[:, new], cache, sinks=s, group=group,
                                          exchange=exchanges[chunks % 2], window=window, backend=backend)
            chunks += 1
        assert out.dtype == dt and out.shape == (2, n, 4, v.shape[-1])
        errors.append((out.double() - want[:, new]).abs().max().item())
        at += n
    filled = cache.positions[: cache.length]
    return {"errors": errors, "out": out, "counts": cache.counts, "positions": filled.tolist(),
            "k_ok": torch.equal(cache.k[:, : cache.length], k[:, filled])}


def _stored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache, sinks: torch.Tensor | None,
            group: dist.ProcessGroup | None) -> torch.Tensor:
    """The new tokens stored first (append / append_chunk, as RingSPCache.update does for MLA's latents), then
    attended by :func:`ring_sp.stored_attention` with the shard as the keys (here stored as they are)."""
    if q.shape[1] == 1:
        owner = cache.next_owner()
        cache.append(k, v)
        piece = (0, int(owner == cache.rank))
    else:
        bounds = cache.append_chunk(k, v)
        piece = (bounds[cache.rank], bounds[cache.rank + 1])
    held = cache.length
    return ring_sp.stored_attention(q, cache.k[:, :held], cache.v[:, :held], cache, piece, sinks=sinks, group=group)


@pytest.mark.parametrize("world,layout,exchanges,sinks,d_v", [
    (2, "zigzag", ("pass_q", "pass_kv"), False, None),
    (3, "contiguous", ("pass_kv", "pass_q"), True, None),
    (4, "zigzag", ("auto", "pass_kv"), False, 6),
    (3, "zigzag", ("stored", "pass_q"), True, 6),  # stored_attention: decode steps and every other chunk
])
def test_chunks_equal_the_oracle_on_every_rank(pools, world: int, layout: str, exchanges, sinks: bool, d_v) -> None:
    results = pools.get(world).run(chunk_case, layout, exchanges, sinks, d_v)
    total = PROMPT + sum(n for _, n in STEPS)
    for result in results:
        assert max(result["errors"]) <= OUT_TOL[torch.float64].atol, result["errors"]
        assert torch.equal(result["out"], results[0]["out"])  # every rank alike, bit for bit
        assert result["k_ok"] and result["counts"] == results[0]["counts"]
    counts = results[0]["counts"]
    assert sum(counts) == total and max(counts) - min(counts) <= 1  # balanced
    assert sorted(p for r in results for p in r["positions"]) == list(range(total))  # the whole cache, once


@pytest.mark.parametrize("window", [None, 7])
def test_chunks_over_a_grids_sp_group_in_bf16(pools, window: int | None) -> None:
    """U2 x R2, bf16 (fp32 partials and merge): within bf16's tolerance of the oracle; with a window by pass-Q."""
    exchanges = ("pass_q", "pass_kv") if window is None else ("auto", "pass_q")
    results = pools.get(4).run(chunk_case, "zigzag", exchanges, True, None, "bfloat16", (2, 2), window)
    assert all(max(r["errors"]) <= OUT_TOL[torch.bfloat16].atol and r["k_ok"] for r in results), \
        [r["errors"] for r in results]


def test_auto_passes_q_for_short_chunks_and_kv_for_long_ones() -> None:
    """Llama-3-8B's heads (32 query, 8 KV of 128), bf16, 8 ranks: pass-Q for a turn of 512 tokens after 128K
    cached, pass-KV for a chunk as long as the cache."""
    counts = [16384] * 8
    assert choose_exchange(512, counts, 32, 8, 128, 128, 2) == "pass_q"
    assert choose_exchange(131072, counts, 32, 8, 128, 128, 2) == "pass_kv"


def disagreeing_chunks() -> str:
    """Rank 1 brings other token ids: every rank raises, naming it."""
    rank = dist.get_rank()
    inputs = make_inputs(3, 1, 12, 2, 1, 4, torch.float64)
    k, v = inputs["k"], inputs["v"]
    cache = ShardedKVCache.from_prefill(k[:, rank * 4: rank * 4 + 4], v[:, rank * 4: rank * 4 + 4],
                                        torch.arange(rank * 4, rank * 4 + 4), capacity=8)
    ids = torch.arange(4) + (rank == 1)
    try:
        ring_sp.chunk_attention(inputs["q"][:, 8:], k[:, 8:], v[:, 8:], cache, agree=ids, exchange="pass_kv")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_chunks_that_differ_raise_on_every_rank(pools) -> None:
    for error in pools.get(2).run(disagreeing_chunks):
        assert "the ranks decode different tokens: rank(s) [1]" in error, error


@pytest.mark.parametrize("world,layout,window,backend,sinks", [
    (4, "striped", 7, "auto", False),       # strided keys: the window's edge cuts runs of one token
    (3, "zigzag", 13, "reference", True),   # a kernel that takes bands whole; the edge inside decoded tokens
    (2, "contiguous", 1, "auto", False),    # each token sees itself alone
])
def test_chunks_of_a_sliding_window_layer_equal_the_oracle(pools, world: int, layout: str, window: int, backend: str,
                                                           sinks: bool) -> None:
    """Chunks against a window's layer (pass-Q: ``auto`` picks it), decode steps between them: float64 oracle
    of the causal sliding window, on every rank alike."""
    results = pools.get(world).run(chunk_case, layout, ("auto", "pass_q"), sinks, None, "float64", None, window, backend)
    for result in results:
        assert max(result["errors"]) <= OUT_TOL[torch.float64].atol, result["errors"]
        assert torch.equal(result["out"], results[0]["out"]) and result["k_ok"]


def test_a_window_with_pass_kv_or_a_bad_window_is_refused_by_name() -> None:
    inputs = make_inputs(0, 1, 4, 2, 1, 4, torch.float32)
    cache = ShardedKVCache.holding(inputs["k"][:, :2], inputs["v"][:, :2], torch.arange(2), rank=0, counts=[2],
                                   capacities=[4])
    new = [inputs[x][:, 2:] for x in ("q", "k", "v")]
    with pytest.raises(ValueError, match="exchange='pass_kv' with window=3: a sliding-window layer's chunk passes q"):
        ring_sp.chunk_attention(*new, cache, window=3, exchange="pass_kv")
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        ring_sp.chunk_attention(*new, cache, window=0)
    assert cache.counts == [2]  # refused before anything was stored


def test_stored_attention_and_decode_rows_name_malformed_input() -> None:
    """What a caller builds by hand: keys that are not the whole shard, a piece not within the newest tokens,
    one cache too few for the rows, a row whose KV heads are not its cache's."""
    from ring_sp.decode import decode_rows

    inputs = make_inputs(1, 1, 6, 2, 1, 4, torch.float64)
    cache = ShardedKVCache.holding(inputs["k"][:, :5], inputs["v"][:, :5], torch.arange(5), rank=0, counts=[5],
                                   capacities=[6])
    q = inputs["q"][:, 4:5]
    with pytest.raises(ValueError, match=r"this rank's whole shard, \[b, 5, h_kv, d\]"):
        ring_sp.stored_attention(q, cache.k[:, :4], cache.v[:, :4], cache, (0, 1))
    with pytest.raises(ValueError, match=r"piece=\(0, 2\) is not this rank's part of the 1 newest tokens"):
        ring_sp.stored_attention(q, cache.k[:, :5], cache.v[:, :5], cache, (0, 2))
    new = [inputs[x][:, 5:] for x in ("q", "k", "v")]
    with pytest.raises(ValueError, match=r"one token per row, one cache per row \(2 caches\)"):
        decode_rows(*new, [cache, cache])
    with pytest.raises(ValueError, match=r"the token's k .* do not match the cache's"):
        decode_rows(new[0], new[1].expand(1, 1, 2, 4), new[2].expand(1, 1, 2, 4), [cache])
    assert cache.counts == [5]  # refused before anything was stored
