"""Issue 30 item 2: head-chunked attention (``head_chunks``).

Ring, Ulysses and the grid run a call's heads in chunks of whole GQA groups. On gloo ranks,
over a sample of (U, R, layout, chunks, GQA, window, documents, sinks, all-gather, dtype):
outputs and every gradient equal the unchunked call's BITWISE (fp32/fp64/bf16; with ONE
query head per chunk to the last bits, see :func:`chunked_case`) and the
float64 oracle's within tests/oracle.py's tolerances, and every kind of message carries the
same bytes, forward and backward (``count_communication``). Also: recompute under
checkpointing, the "auto" rule (pure), and the argument checks (before any collective, and
ranks that disagree fail together).

Default suite: ~12 s on 2 cores (two pools: 4 and 2 ranks); ``-m slow`` adds a wider sweep.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import AttnCase, case_documents, case_mask, topology
from oracle import DTYPES, GRAD_TOL, OUT_TOL, assert_close, make_inputs, oracle_results
from ring_sp.plan.head_chunk_choice import (MIN_KERNEL_ROWS_X_HEADS, choose_head_chunks, chunk_options,
                                            working_bytes)
from ring_sp.validation import check_head_chunk_split, check_head_chunks

NAMES = ("out", "dq", "dk", "dv", "dsinks")
ULPS = {torch.float64: 2.0**-48, torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7}  # (a few last bits)


# ---- rank side ---------------------------------------------------------------------------

def _coordinates(case: AttnCase) -> tuple[int, int, dist.ProcessGroup | None]:
    """(sp_rank, sp_size, sp group) of this rank for the case's mode."""
    if case.mode == "hybrid":
        topo = topology(case.ulysses, case.ring)
        return topo.sp_rank, topo.sp_size, topo.sp_group
    return dist.get_rank(), dist.get_world_size(), None


def _attend(case: AttnCase, q, k, v, cu, sinks, chunks):
    options = dict(causal=case.causal, layout=case.layout, cu_seqlens=cu, sinks=sinks, head_chunks=chunks)
    if case.window is not None:
        options["sliding_window"] = case.window
    if case.mode == "ring":
        return ring_sp.ring_attention(q, k, v, return_lse=True, kv_exchange=case.kv_exchange, **options)
    if case.mode == "ulysses":
        return ring_sp.ulysses_attention(q, k, v, **options), None
    return ring_sp.hybrid_attention(q, k, v, topology=topology(case.ulysses, case.ring), kv_exchange=case.kv_exchange,
                                    **options), None


def _run(case: AttnCase, inputs: dict, shard, cu, chunks) -> tuple[dict, dict, dict]:
    """This rank's out, lse and gradients of one call, and the bytes it sent (fwd, bwd)."""
    q, k, v = (shard(inputs[n]).requires_grad_() for n in ("q", "k", "v"))
    sinks = inputs["sinks"].clone().requires_grad_() if "sinks" in inputs else None
    _attend(case, q, k, v, cu, sinks, chunks)  # the first call of a signature agrees on it: count the second
    with ring_sp.count_communication() as fwd:
        out, lse = _attend(case, q, k, v, cu, sinks, chunks)
    with ring_sp.count_communication() as bwd:
        out.backward(shard(inputs["dout"]))
    results = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        results["dsinks"] = sinks.grad
    if lse is not None:
        results["lse"] = lse
    return results, fwd.bytes_sent, bwd.bytes_sent


def _heads_per_chunk(case: AttnCase, chunks: int | str, sp_size: int) -> int:
    """Query heads one chunk's kernel calls see on a rank ("auto": at most the rank's)."""
    ulysses = {"hybrid": case.ulysses, "ulysses": sp_size, "ring": 1}[case.mode]
    return case.h // ulysses // (1 if chunks == "auto" else chunks)


def chunked_case(case: AttnCase, chunks: int | str) -> dict:
    """One case on this rank: chunked vs unchunked (bitwise, bytes) and vs the oracle. Raises
    AssertionError on any difference; returns the largest difference to the unchunked call."""
    sp_rank, sp_size, group = _coordinates(case)
    dtype = DTYPES[case.dtype]
    inputs = make_inputs(case.seed, case.b, case.n_local * sp_size, case.h, case.h_kv, case.d, dtype, sinks=case.sinks,
                         d_v=case.d_v)
    cu = case_documents(case, sp_size)

    def shard(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return ring_sp.shard_sequence(x, rank=sp_rank, world_size=sp_size, layout=case.layout, dim=dim, cu_seqlens=cu)

    plain, plain_fwd, plain_bwd = _run(case, inputs, shard, cu, None)
    chunked, fwd, bwd = _run(case, inputs, shard, cu, chunks)
    label = f"{case.label()} head_chunks={chunks}"
    assert (fwd, bwd) == (plain_fwd, plain_bwd), f"{label}: bytes {fwd}, {bwd} != unchunked {plain_fwd}, {plain_bwd}"
    worst = 0.0
    for name, value in plain.items():
        got = chunked[name]
        assert got.dtype == value.dtype and got.shape == value.shape, f"{label} {name}: {got.dtype} {got.shape}"
        diff = (got.double() - value.double()).abs().max().item()
        worst = max(worst, diff)
        if _heads_per_chunk(case, chunks, sp_size) > 1:
            assert torch.equal(got, value), f"{label} {name}: differs from unchunked by {diff:.3e}"
        # one query head per chunk: the CPU op's lse [b, h, s] is stored sequence-major, so the
        # merge's exp / logaddexp over it run vectorised at h = 1 and element by element for
        # h > 1: the last bit may differ, rounded at most once more to the dtype
        assert diff <= ULPS[dtype] * max(1.0, value.abs().max().item()), f"{label} {name}: {diff:.3e} off unchunked"
    mask = case_mask(case, case.n_local * sp_size, cu)
    expected = oracle_results(inputs, causal=case.causal and mask is None, mask=mask)
    for name in NAMES:
        if name not in chunked:
            continue
        tol = OUT_TOL[dtype] if name == "out" else GRAD_TOL[dtype]
        if name == "dsinks":  # each rank holds its rows' share
            total = chunked[name].double()
            dist.all_reduce(total, group=group)
            assert_close(f"{label} dsinks", total, expected[name], tol)
        else:
            assert_close(f"{label} rank {dist.get_rank()} {name}", chunked[name], shard(expected[name]), tol)
    return {"max_diff": worst, "bytes": sum(fwd.values()) + sum(bwd.values())}


def chunked_cases(cases: list[tuple[AttnCase, int | str]]) -> list[dict]:
    return [chunked_case(case, chunks) for case, chunks in cases]


# ---- the sample --------------------------------------------------------------------------

def _grid(u: int, r: int, **fields) -> AttnCase:
    return AttnCase("hybrid", ulysses=u, ring=r, n_local=8, h=8, d=8, **{"dtype": "fp32", **fields})


DEFAULT_4 = [  # (case, chunks) on 4 ranks
    (_grid(2, 2, h_kv=4), 2),
    (_grid(2, 2, h_kv=8, layout="contiguous", seed=1), 4),
    (_grid(2, 2, h_kv=4, window=5, sinks=True, seed=2), 2),
    (_grid(2, 2, h_kv=4, layout="document_zigzag", packed=True, kv_exchange="all_gather", seed=3), 2),
    (_grid(4, 1, h_kv=8, layout="striped", causal=False, seed=4), 2),
    (_grid(1, 4, h_kv=2, dtype="bf16", seed=5), 2),
    (_grid(2, 2, h_kv=4, dtype="fp64", sinks=True, packed=True, seed=6), "auto"),
    (_grid(2, 2, h_kv=4, d_v=4, seed=10), 2),  # MLA's value head size (the reference kernel)
    (AttnCase("ring", ring=4, n_local=8, h=8, h_kv=4, d=8, dtype="fp32", window=9, seed=7), 4),
]
DEFAULT_2 = [  # ulysses_attention itself, and ring_attention's lse
    (AttnCase("ulysses", ulysses=2, n_local=8, h=8, h_kv=4, d=8, dtype="fp32", sinks=True, seed=8), 2),
    (AttnCase("ring", ring=2, n_local=8, h=4, h_kv=2, d=8, dtype="fp32", packed=True, sinks=True, seed=9), 2),
    (AttnCase("ring", ring=2, n_local=32, h=2, h_kv=2, d=8, dtype="fp32", seed=12), 2),  # one head per chunk
]


def test_chunked_equals_unchunked_bitwise_and_the_oracle(pools) -> None:
    """Every sampled case: bitwise the unchunked call (one query head per chunk: to the last
    bits), within the oracle's tolerances, same bytes."""
    for world_size, cases in ((4, DEFAULT_4), (2, DEFAULT_2)):
        per_rank = pools.get(world_size).run(chunked_cases, cases, timeout=300)
        for i, results in enumerate(zip(*per_rank)):  # the ranks' results of case i
            assert sum(r["bytes"] for r in results) > 0, cases[i]


def _sweep() -> list[tuple[AttnCase, int]]:
    cases = []
    for (u, r), layout, (h_kv, chunks), window, packed, sinks, dtype in itertools.product(
            ((1, 4), (2, 2), (4, 1)), ("contiguous", "zigzag", "document_zigzag"), ((8, 2), (8, 4), (4, 2)),
            (None, 6), (False, True), (False, True), ("fp32", "bf16")):
        if layout == "document_zigzag" and not packed or h_kv // u % chunks or h_kv % u:
            continue
        cases.append((_grid(u, r, h_kv=h_kv, layout=layout, window=window, packed=packed, sinks=sinks, dtype=dtype,
                            seed=len(cases)), chunks))
    return cases


@pytest.mark.slow
def test_chunked_sweep(pools) -> None:
    """The wider sweep (~150 cases on 4 ranks), all-gather on the grids with a ring."""
    cases = _sweep()
    cases += [(replace(c, kv_exchange="all_gather"), k) for c, k in cases[::5] if c.ring > 1]
    per_rank = pools.get(4).run(chunked_cases, cases, timeout=1200)
    assert all(r["max_diff"] == 0.0 or _heads_per_chunk(case, k, 4) == 1
               for results in per_rank for r, (case, k) in zip(results, cases))
    assert len(per_rank[0]) == len(cases) > 100


# ---- recompute: a checkpoint's re-run reuses every chunk's out and lse ------------------------

def checkpointed_chunks(chunks: int, reentrant: bool) -> dict:
    """A checkpointed call with chunks: the ring runs once (no re-run of its forward), the
    gradients equal the unchecked call's, nothing is left kept after the backward."""
    from ring_sp import recompute

    topo = topology(2, 2)
    inputs = make_inputs(11, 1, 8 * topo.sp_size, 8, 4, 8, torch.float32)
    shard = lambda x: topo.shard_sequence(x, layout="zigzag")  # noqa: E731
    grads = {}
    for checkpointed in (False, True):
        q, k, v = (shard(inputs[n]).requires_grad_() for n in ("q", "k", "v"))

        def attend(q, k, v):
            return ring_sp.hybrid_attention(q * 1, k, v, topology=topo, causal=True, head_chunks=chunks)

        with ring_sp.count_communication() as sent:
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=reentrant)
            else:
                out = attend(q, k, v)
            out.backward(shard(inputs["dout"]))
        grads[checkpointed] = ([t.grad for t in (q, k, v)], dict(sent.calls))
    (plain, plain_calls), (again, calls) = grads[False], grads[True]
    assert all(torch.equal(a, b) for a, b in zip(plain, again)), "checkpointed gradients differ"
    return {"ring_kv": (plain_calls["ring_kv"], calls["ring_kv"]), "a2a_q": (plain_calls["ulysses_a2a_q"],
                                                                             calls["ulysses_a2a_q"]),
            "alive": recompute.live_entries()}


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_rerun_reuses_every_chunk(pools, reentrant: bool) -> None:
    """The re-run sends q/k/v again per chunk (as unchunked) but runs no ring: the ring's KV
    messages are those of one forward and one backward; nothing stays kept."""
    for r in pools.get(4).run(checkpointed_chunks, 2, reentrant):
        plain_kv, kv = r["ring_kv"]
        plain_q, a2a_q = r["a2a_q"]
        assert kv == plain_kv, r  # forward + backward rotations only: the re-run computed nothing
        assert a2a_q == 2 * plain_q, r  # the first run and the re-run each send q
        assert r["alive"] == 0, r


# ---- the rule and the checks (no processes) --------------------------------------------------

def test_auto_is_a_valid_count_and_chunks_long_sequences() -> None:
    """"auto" always divides the KV heads a rank holds; it leaves short shards unchunked (fixed
    costs, kernel occupancy), takes the fewest chunks whose buffers are no larger than the
    [n, hidden] activation, and the finest split where none is (the common case)."""
    for u, r, h, h_kv, n in itertools.product((1, 2, 4, 8), (1, 2, 4), (8, 32), (1, 2, 8), (512, 8192, 131072)):
        if h % u or (h_kv % u and u % h_kv):
            continue
        chunks = choose_head_chunks(ulysses=u, ring=r, batch=1, local_len=n, heads=h, kv_heads=h_kv, head_dim=128,
                                    value_head_dim=128, dtype=torch.bfloat16)
        assert chunks in chunk_options(h_kv, u), (u, r, h, h_kv, n, chunks)
        check_head_chunk_split(chunks, h, h_kv, u)
    short = dict(ulysses=2, ring=2, batch=1, heads=32, kv_heads=8, head_dim=128, value_head_dim=128,
                 dtype=torch.bfloat16)
    assert choose_head_chunks(local_len=256, **short) == 1  # fixed costs; a chunk's kernel call would be too small
    assert 256 * 32 // 2 < MIN_KERNEL_ROWS_X_HEADS
    # one rank, MHA fp32: the working set (fp32 dq, dk, dv) is 3x the [n, hidden] activation,
    # so 4 of the 32 possible chunks meet the target and "auto" takes no more
    assert choose_head_chunks(ulysses=1, ring=1, batch=1, local_len=65536, heads=32, kv_heads=32, head_dim=128,
                              value_head_dim=128, dtype=torch.float32) == 4
    long = choose_head_chunks(local_len=65536, **short)
    assert long == 4  # the 4 KV heads a rank holds at U=2: the finest split
    working = working_bytes(ulysses=2, ring=2, batch=1, local_len=65536, heads=32, kv_heads=8, head_dim=128,
                            dtype="bf16")
    assert working / long > 65536 * 32 * 128 * 2  # the [n, hidden] target asks for more than the finest split
    assert choose_head_chunks(ulysses=8, ring=1, batch=1, local_len=65536, heads=32, kv_heads=8, head_dim=128,
                              value_head_dim=128, dtype=torch.bfloat16) == 1  # one KV head per rank


@pytest.mark.parametrize("value,error,match", [
    (0, ValueError, "head_chunks=0 must be >= 1"),
    (-2, ValueError, "head_chunks=-2 must be >= 1"),
    (2.0, TypeError, "head_chunks must be a positive int, 'auto' or None"),
    (True, TypeError, "head_chunks must be a positive int"),
    ("Auto", TypeError, "got str 'Auto'"),
])
def test_bad_head_chunks_values(value, error, match) -> None:
    with pytest.raises(error, match=match):
        check_head_chunks(value)


@pytest.mark.parametrize("chunks,heads,kv_heads,u,match", [
    (4, 8, 4, 2, r"head_chunks=4 is more than the 2 KV head\(s\) a rank holds \(k/v heads=4 over ulysses_size=2\)"),
    (4, 12, 6, 1, r"does not split the 6 KV heads a rank holds \(k/v heads=6\).*use one of \[1, 2, 3, 6\]"),
    (2, 8, 2, 4, r"ulysses_size=4 > 2 k/v heads replicates each KV head to 2 ranks.*Use head_chunks=1"),
])
def test_chunks_must_split_whole_gqa_groups(chunks, heads, kv_heads, u, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_head_chunk_split(chunks, heads, kv_heads, u)
    for valid in (1, 3, 6):  # the divisors of 6 KV heads
        check_head_chunk_split(valid, 12, 6, 1)


def test_bad_chunks_are_refused_before_any_collective(single_rank) -> None:
    """On one rank (no peer to wait for) the call raises the check's error, naming the value;
    the module checks the value at construction and the split at each call."""
    q, k, v = torch.randn(1, 4, 4, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"head_chunks=4 is more than the 2 KV head"):
        ring_sp.ring_attention(q, k, v, head_chunks=4)
    with pytest.raises(TypeError, match="head_chunks must be"):
        ring_sp.ring_attention(q, k, v, head_chunks="all")
    topo = ring_sp.init_sequence_parallel(1, 1)
    with pytest.raises(ValueError, match="head_chunks=0 must be >= 1"):
        ring_sp.SequenceParallelAttention(topo, head_chunks=0)
    module = ring_sp.SequenceParallelAttention(topo, head_chunks=2)
    assert "head_chunks=2" in repr(module)
    assert torch.equal(module(q, k, v), ring_sp.SequenceParallelAttention(topo)(q, k, v))
    with pytest.raises(ValueError, match=r"head_chunks=3 is more than the 2 KV head"):
        ring_sp.SequenceParallelAttention(topo, head_chunks=3)(q, k, v)


def disagreeing_chunks() -> str:
    """Rank 0 asks for 2 chunks, rank 1 for none: both raise, naming the option."""
    q, k, v = (torch.randn(1, 4, 4, 8) for _ in range(3))
    try:
        ring_sp.ring_attention(q, k, v, causal=True, head_chunks=2 if dist.get_rank() == 0 else None)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("no error")


def test_ranks_that_disagree_on_chunks_fail_together(pools) -> None:
    for message in pools.get(2).run(disagreeing_chunks):
        assert "ranks disagree" in message and "head_chunks=2" in message and "head_chunks=None" in message
