"""Issue 14 (TESTING.md C23): any length, no per-document padding.

``document_zigzag`` splits documents of ANY length (chunks differing by at most a token),
every layout takes any total length (``shard_batch`` pads the END as its own document),
and the results on the real tokens are exact against the float64 block-diagonal oracle
for ring, Ulysses and the grid, outputs and gradients.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import ring_sp
from ring_sp.layouts import layout_positions, layout_unit, padded_length, ring_positions, ulysses_to_ring_order
from ring_sp.sequence_shards import shard_sequence, unshard_sequence
from ring_sp.schedule import causal_work_per_rank, ring_step_tasks, step_tasks

PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _boundaries(lengths: list[int]) -> tuple[int, ...]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return tuple(cu)


def _with_tail(lengths: list[int], layout: str, p: int) -> tuple[int, ...]:
    """Real documents plus the padding document ``shard_batch`` appends (if any)."""
    total = sum(lengths)
    pad = padded_length(total, layout, p) - total
    return _boundaries(lengths + ([pad] if pad else []))


# ------------------------------------------------------------------ layout invariants (single process)

def _chunk_sizes(doc: range, rank_of: dict[int, int], p: int) -> list[int]:
    """Walk a document in order and read off its ``2P`` chunk sizes, assuming rank r owns
    chunk r then chunk ``2P-1-r`` (the middle rank's two chunks are adjacent: merged into its
    first). Raises if the ranks do not follow that pattern."""
    sizes = [0] * (2 * p)
    tokens = list(doc)
    i = 0
    for slot in range(2 * p):
        owner = min(slot, 2 * p - 1 - slot)
        while i < len(tokens) and rank_of[tokens[i]] == owner:
            sizes[slot] += 1
            i += 1
    assert i == len(tokens), f"document {doc} is not split in chunk order: ranks {[rank_of[t] for t in tokens]}"
    return sizes


lengths_st = st.lists(st.one_of(st.integers(1, 9), st.sampled_from(PRIMES), st.integers(0, 90)), min_size=1, max_size=8)


@settings(max_examples=250, deadline=None)
@given(st.integers(1, 12), lengths_st)
def test_document_zigzag_invariants_for_any_lengths(p: int, lengths: list[int]) -> None:
    """Equal shard sizes, every token exactly once in increasing local order, chunks of each
    document differing by at most one token, padding < P tokens at the end only, and the
    old split (zigzag inside the document) for every document of a multiple of 2P tokens."""
    if sum(lengths) == 0:
        lengths = lengths + [1]
    cu = _with_tail(lengths, "document_zigzag", p)
    n = cu[-1]
    pad = n - sum(lengths)
    assert 0 <= pad <= p - 1 <= 2 * p - 1  # at most 2 x SP - 1, at the end, as its own document
    positions = layout_positions("document_zigzag", p, n, cu)
    assert positions.shape == (p, n // p)  # equal shard sizes
    assert sorted(positions.flatten().tolist()) == list(range(n))  # each token exactly once
    assert all(positions[r].diff().gt(0).all() for r in range(p))
    rank_of = {int(t): r for r in range(p) for t in positions[r]}
    for a, b in zip(cu, cu[1:]):
        sizes = _chunk_sizes(range(a, b), rank_of, p)
        c = (b - a) // (2 * p)
        middle = sizes[p - 1] + sizes[p]  # the middle rank's adjacent chunks read as one
        assert all(s in (c, c + 1) for s in sizes[: p - 1] + sizes[p + 1:]), (a, b, sizes)
        assert 2 * c <= middle <= 2 * c + 2, (a, b, sizes)
        if (b - a) % (2 * p) == 0:  # today's split, exactly (TransformerEngine's THD partitioning)
            for r in range(p):
                mine = [t for t in range(a, b) if rank_of[t] == r]
                assert mine == list(range(a + r * c, a + (r + 1) * c)) + list(range(b - (r + 1) * c, b - r * c))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(1, 200), st.sampled_from(["contiguous", "zigzag", "striped", "document_zigzag"]))
def test_every_layout_pads_any_length_at_the_end_by_less_than_its_unit(p: int, n: int, layout: str) -> None:
    padded = padded_length(n, layout, p)
    assert padded % layout_unit(layout, p) == 0 and 0 <= padded - n < layout_unit(layout, p) <= 2 * p
    ids = torch.arange(n).view(1, n) + 1
    cu = (0, n) if layout == "document_zigzag" else None
    shards = [ring_sp.shard_batch({"input_ids": ids}, rank=r, world_size=p, layout=layout, cu_seqlens=cu, pad_id=0)
              for r in range(p)]
    assert len({s["input_ids"].shape for s in shards}) == 1
    bounds = shards[0].get("cu_seqlens")
    assert (bounds is None) == (padded == n and cu is None)
    if bounds is not None:
        assert bounds.tolist() == [0, n] + ([padded] if padded > n else [])
    gathered = unshard_sequence(torch.stack([s["input_ids"] for s in shards]), layout=layout, cu_seqlens=bounds)
    assert gathered[0, n:].eq(0).all() and torch.equal(gathered[:, :n], ids)  # padding at the end only
    real = unshard_sequence(torch.stack([s["input_ids"] for s in shards]), layout=layout, cu_seqlens=bounds, seq_len=n)
    assert torch.equal(real, ids)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), lengths_st)
def test_ring_shards_after_ulysses_are_two_runs_per_document(u: int, r: int, lengths: list[int]) -> None:
    """After the all-to-all a ring rank holds its U members' tokens in increasing order;
    each document is at most two runs of consecutive positions (chunks rU..rU+U-1 and
    their mirror), and the reorder turns the gathered shards into exactly that."""
    if sum(lengths) == 0:
        lengths = lengths + [3]
    cu = _with_tail(lengths, "document_zigzag", u * r)
    n = cu[-1]
    sp_positions = layout_positions("document_zigzag", u * r, n, cu)
    rings = ring_positions("document_zigzag", u, r, n, cu)
    doc_of = torch.searchsorted(torch.tensor(cu), torch.arange(n), right=True) - 1
    for ring_rank in range(r):
        gathered = torch.cat([sp_positions[ring_rank * u + x] for x in range(u)])
        order = ulysses_to_ring_order("document_zigzag", u, r, n, ring_rank, cu)
        assert torch.equal(gathered if order is None else gathered[order], rings[ring_rank])
        row = rings[ring_rank]
        for doc in doc_of[row].unique():
            mine = row[doc_of[row] == doc]
            assert int((mine.diff() != 1).sum()) <= 1  # at most two runs
    if all(length % (2 * u * r) == 0 for length in lengths):  # the old contract: the layout over R itself
        assert torch.equal(rings, layout_positions("document_zigzag", r, n, cu))


# --------------------------------------------------------------------------- packed schedule

def _document_truth(q_pos: torch.Tensor, k_pos: torch.Tensor, cu: tuple[int, ...], causal: bool) -> torch.Tensor:
    edges = torch.tensor(cu)
    same = torch.searchsorted(edges, q_pos, right=True).unsqueeze(1) == torch.searchsorted(edges, k_pos, right=True).unsqueeze(0)
    return same & (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)) if causal else same


def _random_lengths(seed: int, count: int, top: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([1, 2, rng.choice(PRIMES), rng.randint(1, top)]) for _ in range(count)]


@pytest.mark.parametrize("u,r", [(1, 1), (1, 2), (1, 3), (1, 4), (2, 2), (4, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_document_zigzag_schedule_covers_exactly_the_same_document_pairs(u: int, r: int, causal: bool, seed: int) -> None:
    """Every (rank, source) step of the ring: blocks cover exactly the visible same-document
    pairs of the ring shards, never overlap, masked blocks are square, and a step sharing
    no document launches nothing."""
    lengths = _random_lengths(seed, 6, 40) + [seed + 1]
    if seed == 2:
        lengths = [sum(lengths) + 5] + lengths  # one document longer than all others together
    cu = _with_tail(lengths, "document_zigzag", u * r)
    n = cu[-1]
    rings = ring_positions("document_zigzag", u, r, n, cu)
    local = n // r
    for rank in range(r):
        for source in range(r):
            got = torch.zeros(local, local, dtype=torch.bool)
            tasks = step_tasks("document_zigzag", causal, rank, source, r, local, cu, ulysses_size=u)
            for task in tasks:
                nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
                assert nq > 0 and nk > 0 and (not task.causal or task.q == task.kv)
                assert not got[task.q, task.kv].any(), "blocks must not overlap"
                got[task.q, task.kv] = torch.ones(nq, nk, dtype=torch.bool).tril() if task.causal else True
            truth = _document_truth(rings[rank], rings[source], cu, causal)
            assert torch.equal(got, truth), (rank, source, cu)
            assert bool(tasks) == bool(truth.any())  # nothing shared: no kernel call


def _old_document_zigzag_tasks(causal: bool, rank: int, source: int, p: int, cu: tuple[int, ...]) -> list:
    """The schedule before issue 14 (documents of multiples of 2P): zigzag per document."""
    tasks, offset = [], 0
    for a, b in zip(cu, cu[1:]):
        m = (b - a) // p
        for t in ring_step_tasks("zigzag", causal, rank, source, m):
            tasks.append((slice(t.q.start + offset, t.q.stop + offset), slice(t.kv.start + offset, t.kv.stop + offset), t.causal))
        offset += m
    return sorted(tasks, key=lambda x: (x[0].start, x[1].start))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_documents_of_multiples_of_2p_keep_the_old_blocks(p: int, causal: bool) -> None:
    cu = _boundaries([2 * p * m for m in (1, 3, 2, 5)])
    for rank in range(p):
        for source in range(p):
            got = [(t.q, t.kv, t.causal) for t in step_tasks("document_zigzag", causal, rank, source, p, cu[-1] // p, cu)]
            assert sorted(got, key=lambda x: (x[0].start, x[1].start)) == _old_document_zigzag_tasks(causal, rank, source, p, cu)


MIXES = {  # the three document mixes of benchmarks/document_balance.py
    "short": lambda rng, n, first: rng.randint(64, 512),
    "lognormal": lambda rng, n, first: int(rng.lognormvariate(7.0, 1.2)) + 1,
    "one long": lambda rng, n, first: n // 2 if first else rng.randint(32, 1024),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_causal_work_is_balanced_within_one_percent_on_realistic_mixes(mix: str) -> None:
    """4096 tokens per rank, unpadded documents: max/mean causal work <= 1.01; the schedule's
    pairs equal every rank's own count of (query, earlier key in its document) pairs."""
    p, per_rank = 8, 4096
    rng, cu = random.Random(0), [0]
    while cu[-1] < p * per_rank:
        cu.append(min(p * per_rank, cu[-1] + MIXES[mix](rng, p * per_rank, len(cu) == 1)))
    cu = tuple(cu)
    work = causal_work_per_rank("document_zigzag", p, per_rank, True, cu)
    assert max(work) / (sum(work) / p) <= 1.01
    in_doc = ring_sp.document_positions(cu) + 1  # keys a query sees: its index in the document + 1
    positions = layout_positions("document_zigzag", p, cu[-1], cu)
    assert work == in_doc[positions].sum(dim=1).tolist()


# ------------------------------------------------------------------------------ data helpers

def test_shard_batch_pads_the_tail_as_its_own_document_with_ignored_labels() -> None:
    ids = torch.arange(100, 111).view(1, 11)  # 11 tokens, 3 ranks: 1 token of padding (document_zigzag)
    cu = [0, 1, 6, 11]  # lengths 1, 5, 5: none a multiple of 6
    shards = [ring_sp.shard_batch({"input_ids": ids, "loss_mask": torch.ones(1, 11)}, rank=r, world_size=3,
                                  layout="document_zigzag", cu_seqlens=cu, pad_id=7) for r in range(3)]
    bounds = shards[0]["cu_seqlens"]
    assert bounds.dtype == torch.int32 and bounds.tolist() == [0, 1, 6, 11, 12]
    assert all(s["input_ids"].shape == (1, 4) for s in shards)
    full = {k: unshard_sequence(torch.stack([s[k] for s in shards]), layout="document_zigzag", cu_seqlens=bounds)[0].tolist()
            for k in ("input_ids", "labels", "position_ids", "loss_mask")}
    assert full["input_ids"] == list(range(100, 111)) + [7]
    assert full["labels"] == [-100, 102, 103, 104, 105, -100, 107, 108, 109, 110, -100, -100]
    assert full["position_ids"] == [0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]
    assert full["loss_mask"] == [1.0] * 11 + [0.0]


def test_invalid_lengths_still_raise_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"x.shape\[1\]=10 must be a positive multiple of 8 for layout='zigzag'.*pad "
                                         r"the sequence at its end to 16 tokens.*shard_batch"):
        shard_sequence(torch.zeros(1, 10), rank=0, world_size=4, layout="zigzag")
    with pytest.raises(ValueError, match=r"needs cu_seqlens"):
        ring_sp.shard_batch({"input_ids": torch.zeros(1, 5, dtype=torch.long)}, rank=0, world_size=2, layout="document_zigzag")
    with pytest.raises(ValueError, match=r"seq_len=9 must be an int in \[1, 8\]"):
        unshard_sequence(torch.zeros(2, 1, 4), layout="contiguous", seq_len=9)
    with pytest.raises(ValueError, match=r"no tokens"):
        ring_sp.shard_batch({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, rank=0, world_size=2)


# --------------------------------------------------------- distributed, against the float64 oracle

def any_length_case(mode: str, u: int, r: int, lengths: tuple[int, ...] | None, total: int, layout: str, causal: bool,
                    dtype_name: str, seed: int, pass_boundaries: bool = True) -> dict[str, float]:
    """Real tokens only: the oracle runs on the unpadded sequence (block-diagonal mask when
    ``lengths`` are given); the distributed path gets ``shard_batch``'s padded shards (dout 0
    on the padding, as an ignored label gives) and ``gather_sequence(seq_len=)`` drops it.
    The padding's gradients must be exactly 0: no real token attended to it."""
    from dist_cases import _single_device, document_mask, topology
    from oracle import DTYPES, GRAD_TOL, LSE_ATOL, OUT_TOL, RATIO_FLOOR, assert_close, assert_lse_close, make_inputs, max_abs_error, oracle_results

    dtype = DTYPES[dtype_name]
    cu = _boundaries(list(lengths)) if lengths is not None else None
    inputs = make_inputs(seed, 1, total, 4, 2, 8, dtype)
    expected = oracle_results(inputs, causal=causal and cu is None, mask=None if cu is None else document_mask(cu, causal))
    if mode == "hybrid":
        topo = topology(u, r)
        sp_rank, sp_size = topo.sp_rank, topo.sp_size
    else:
        topo, sp_rank, sp_size = None, dist.get_rank(), dist.get_world_size()
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.long), **inputs}
    shard = ring_sp.shard_batch(batch, rank=sp_rank, world_size=sp_size, layout=layout, cu_seqlens=cu, shift=False)
    bounds = shard.get("cu_seqlens")
    q, k, v = (shard[n].requires_grad_() for n in ("q", "k", "v"))
    attn_cu = bounds if pass_boundaries else None
    common = dict(causal=causal, layout=layout, cu_seqlens=attn_cu)
    lse = None
    if mode == "ring":
        out, lse = ring_sp.ring_attention(q, k, v, return_lse=True, **common)
    elif mode == "ulysses":
        out = ring_sp.ulysses_attention(q, k, v, **common)
    else:
        out = ring_sp.hybrid_attention(q, k, v, topology=topo, **common)
    out.backward(shard["dout"])

    def gather(x: torch.Tensor, dim: int = 1, seq_len: int | None = total) -> torch.Tensor:
        if topo is not None:
            return topo.gather_sequence(x.detach(), layout=layout, dim=dim, cu_seqlens=bounds, seq_len=seq_len)
        return ring_sp.gather_sequence(x.detach(), layout=layout, dim=dim, cu_seqlens=bounds, seq_len=seq_len)

    errors = {}
    single = _single_device(inputs, _Case(causal), cu) if dtype in RATIO_FLOOR else None
    for name, value in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        full = gather(value, seq_len=None)
        assert full.shape[1] == padded_length(total, layout, sp_size)
        if name != "out":
            assert full[:, total:].eq(0).all(), f"{name}: the padding got a gradient"
        tol = OUT_TOL[dtype] if name == "out" else GRAD_TOL[dtype]
        errors[name] = assert_close(f"{mode} {layout} {name}", gather(value), expected[name], tol)
        if single is not None:  # no worse than 2x the same kernel's own error on one device
            own = max_abs_error(single[name], expected[name])
            floor = RATIO_FLOOR[dtype] * max(1.0, expected[name].abs().max().item())
            assert errors[name] <= 2 * own + floor, (name, errors[name], own)
    if lse is not None:
        errors["lse"] = assert_lse_close("lse", gather(lse, dim=2), expected["lse"], LSE_ATOL[dtype])
    return errors


class _Case:
    """What ``dist_cases._single_device`` reads of a case."""

    backend = "auto"
    window = None

    def __init__(self, causal: bool) -> None:
        self.causal = causal


# Document mixes (real lengths; the totals are mostly NOT multiples of the SP size):
DOCS = {
    "ones": (1, 1, 1, 1, 1),                 # every document shorter than the SP size
    "primes": (2, 3, 5, 7, 11, 13),          # 41 tokens
    "long": (37, 1, 3, 2, 5),                # one document longer than all others together
    "mixed": (1, 17, 4, 1, 9, 2, 23),        # 57 tokens
}


def _matrix(mode: str, u: int, r: int) -> list[tuple]:
    """A small, fixed sample over mixes x causal x dtype, plus unpacked any-length rows."""
    cases = []
    dtypes = itertools.cycle(("fp64", "fp32", "bf16"))
    for i, (name, causal) in enumerate(itertools.product(sorted(DOCS), (True, False))):
        lengths = DOCS[name]
        cases.append((mode, u, r, lengths, sum(lengths), "document_zigzag", causal, next(dtypes), 10 + i))
    for layout in ("zigzag", "contiguous"):  # unpacked, 29 tokens: causal needs no boundaries, non-causal does
        cases.append((mode, u, r, None, 29, layout, True, "fp64", 3, False))
        cases.append((mode, u, r, None, 29, layout, False, "fp32", 4, True))
    return cases


def _run_all(cases: list[tuple]) -> list[dict[str, float]]:
    return [any_length_case(*case) for case in cases]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_any_length_ring(pools, world_size: int) -> None:
    pools.get(world_size).run(_run_all, _matrix("ring", 1, world_size), timeout=600)


def test_any_length_ulysses(pools) -> None:
    pools.get(4).run(_run_all, _matrix("ulysses", 4, 1), timeout=600)


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4), (4, 1)])
def test_any_length_grid(pools, u: int, r: int) -> None:
    pools.get(4).run(_run_all, _matrix("hybrid", u, r), timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("u,r", [(1, 2), (2, 2), (1, 4), (4, 1)])
def test_any_length_random_sweep(pools, u: int, r: int) -> None:
    """Slow: random document mixes (seeded) over every dtype and both masks."""
    cases = []
    for seed in range(12):
        lengths = tuple(_random_lengths(seed, 1 + seed % 7, 30))
        for causal, dtype in itertools.product((True, False), ("fp64", "fp32", "bf16")):
            cases.append(("hybrid", u, r, lengths, sum(lengths), "document_zigzag", causal, dtype, seed))
    pools.get(4 if u * r == 4 else 2).run(_run_all, cases, timeout=900)


# ----------------------------------------------------------------------- Megatron THD helper

def test_megatron_thd_batch_without_per_document_padding(single_rank) -> None:
    """``thd_batch_on_this_cp_rank(per_document_padding=False)``: documents unpadded, only
    the row's end (its own document); the default still pads every document to 2 x CP,
    which megatron-core's THD RoPE needs (LayoutRotaryEmbedding refuses the unpadded batch)."""
    pytest.importorskip("megatron.core")
    import types

    import ring_sp.integrations.megatron as rsm
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from ring_sp.integrations.megatron.packed import packed_attention_args

    tokens = torch.arange(1, 24).view(1, 23)  # 23 tokens: documents 1, 7, 2, 13 over CP = 3
    cu = [0, 1, 8, 10, 23]
    shards = [rsm.thd_batch_on_this_cp_rank(tokens, cu, cp_rank=r, cp_size=3, per_document_padding=False) for r in range(3)]
    params = shards[0][1]
    assert params.cu_seqlens_q.tolist() == [0, 1, 8, 10, 23, 24] and params.cu_seqlens_q_padded is None
    assert params.max_seqlen_q == 13 and all(s["tokens"].shape == (1, 8) for s, _ in shards)
    full = {k: unshard_sequence(torch.stack([s[k] for s, _ in shards]), layout="document_zigzag",
                                cu_seqlens=params.cu_seqlens_q, seq_len=23)[0].tolist()
            for k in ("tokens", "labels", "loss_mask", "position_ids")}
    assert full["tokens"] == list(range(1, 24))
    assert full["loss_mask"] == [0.0] + [1.0] * 6 + [0.0, 1.0, 0.0] + [1.0] * 12 + [0.0]
    assert full["position_ids"] == [0, *range(7), 0, 1, *range(13)]
    padded_shard, padded = rsm.thd_batch_on_this_cp_rank(tokens, cu, cp_rank=0, cp_size=3)
    assert padded.cu_seqlens_q_padded.tolist() == [0, 6, 18, 24, 42] and padded_shard["tokens"].shape == (1, 14)
    # CP = 1 (this process): the unpadded params reach ring_sp's attention unchanged
    one, one_params = rsm.thd_batch_on_this_cp_rank(tokens, cu, cp_rank=0, cp_size=1, per_document_padding=False)
    args = dict(local_len=23, batch=1, sp_group=single_rank, layout="document_zigzag", causal=False)
    assert packed_attention_args(one_params, **args) == ((0, 1, 8, 10, 23), "document_zigzag")

    class Group:  # the rank and size LayoutRotaryEmbedding reads of a CP group
        def __init__(self, size: int) -> None:
            self._size = size

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return 0

    rope = rsm.LayoutRotaryEmbedding(RotaryEmbedding(16, 1.0, use_cpu_initialization=True, cp_group=Group(3)),
                                     layout="document_zigzag", cp_group=Group(3), device="cpu")
    config = types.SimpleNamespace(sequence_parallel=False)
    assert rope.get_rotary_seq_len(None, None, None, config, padded) == 18
    with pytest.raises(ValueError, match=r"document 0 has 1 tokens, not a multiple of 2 x context-parallel size = 6.*"
                                         r"per_document_padding=True.*position_embedding_type"):
        rope.get_rotary_seq_len(None, None, None, config, params)


# --------------------------------------------------------------------- DeepSpeed collators

def collators_case() -> list[list[int]]:
    """Rows of 61 tokens over U2 x R2 (zigzag: padded to 64); packed documents of 5, 1, 29
    and 26 tokens (document_zigzag: to 64, no document padded). Gathered back with
    ``seq_len``: the rows, next-token labels, and the attention's boundaries."""
    from dist_cases import topology
    from ring_sp.integrations.deepspeed.data import PackingCollator, ShardingCollator

    topo = topology(2, 2)
    rows = [torch.arange(61) + 100 * i for i in range(2)]
    plain = ShardingCollator(topo)(rows)
    gather = lambda x, cu=None, layout="zigzag": topo.gather_sequence(x, layout=layout, cu_seqlens=cu, seq_len=61)  # noqa: E731
    assert plain["input_ids"].shape == (2, 16) and plain["cu_seqlens"].tolist() == [0, 61, 64]
    assert torch.equal(gather(plain["input_ids"]), torch.stack(rows))
    assert gather(plain["labels"])[:, :-1].tolist() == torch.stack(rows)[:, 1:].tolist()
    sample = {"input_ids": torch.arange(61), "cu_seqlens": torch.tensor([0, 5, 6, 35, 61])}
    packed = PackingCollator(topo)([sample])
    cu = packed["cu_seqlens"]
    assert torch.equal(gather(packed["input_ids"], cu, "document_zigzag")[0], sample["input_ids"])
    return [cu.tolist(), gather(packed["position_ids"], cu, "document_zigzag")[0].tolist()]


def test_deepspeed_collators_take_any_length(pools) -> None:
    for cu, positions in pools.get(4).run(collators_case, timeout=240):
        assert cu == [0, 5, 6, 35, 61, 64]  # the documents unpadded, 3 tokens at the end as their own
        assert positions == [*range(5), 0, *range(29), *range(26)]
