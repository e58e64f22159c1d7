"""kv_exchange="all_gather": the ring group's KV gathered once, dK/dV reduce-scattered.

Oracle cases as for the ring (outputs AND gradients against full attention on one rank,
tolerances of TESTING.md through dist_cases), the bytes counted against the planner's
formula, the collectives called, validation before any collective, and the planner's choice.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import AttnCase, check_attention_cases
from ring_sp.plan import Cluster, ModelShape, Workload, choose_kv_exchange, layer_bytes, plan

AG = "all_gather"
# the collectives' torch names (torch 2.13 renamed them)
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def _ring_cases(world_size: int) -> list[AttnCase]:
    """Every layout x causal, windows, packed documents of odd lengths, GQA/MQA, MLA, sinks."""
    shapes = itertools.cycle([(1, 8, 4, 4, 2), (2, 16, 8, 2, 6), (1, 8, 4, 1, 4)])  # b, d, h, h_kv, n_local
    cases = []
    for layout, causal in itertools.product(("contiguous", "zigzag", "striped"), (True, False)):
        b, d, h, h_kv, n = next(shapes)
        cases.append(AttnCase("ring", layout, causal, b, n, h, h_kv, d, "fp64", seed=len(cases), ring=world_size,
                              kv_exchange=AG))
    cases += [
        AttnCase("ring", "document_zigzag", True, 1, 7, 4, 2, 8, "fp64", seed=11, ring=world_size, packed=True,
                 kv_exchange=AG),
        AttnCase("ring", "striped", True, 1, 5, 4, 1, 8, "fp64", seed=12, ring=world_size, packed=True,
                 kv_exchange=AG),
        AttnCase("ring", "striped", True, 1, 6, 4, 2, 8, "fp64", seed=13, ring=world_size, window=5, kv_exchange=AG),
        AttnCase("ring", "contiguous", True, 1, 6, 4, 2, 8, "fp64", seed=14, ring=world_size, window=4,
                 packed=True, kv_exchange=AG),
        AttnCase("ring", "zigzag", True, 1, 6, 4, 1, 8, "fp64", seed=15, ring=world_size, d_v=12, sinks=True,
                 kv_exchange=AG),
        AttnCase("ring", "zigzag", True, 2, 6, 8, 2, 16, "fp32", seed=16, ring=world_size, kv_exchange=AG),
        AttnCase("ring", "striped", False, 1, 6, 8, 2, 16, "bf16", seed=17, ring=world_size, kv_exchange=AG),
    ]
    return cases


def _grid_cases() -> list[AttnCase]:
    """U2xR2: the ring group gathers the h_kv/U heads after the all-to-all (and a replicated one)."""
    grid = dict(mode="hybrid", ulysses=2, ring=2, kv_exchange=AG)
    return [
        AttnCase(layout="zigzag", causal=True, b=1, n_local=4, h=4, h_kv=2, d=8, seed=21, **grid),
        AttnCase(layout="contiguous", causal=False, b=2, n_local=2, h=4, h_kv=4, d=8, seed=22, **grid),
        AttnCase(layout="document_zigzag", causal=True, b=1, n_local=5, h=4, h_kv=1, d=8, seed=23, packed=True,
                 **grid),
        AttnCase(layout="zigzag", causal=True, b=1, n_local=6, h=4, h_kv=2, d=8, seed=24, window=7, **grid),
        AttnCase(layout="zigzag", causal=True, b=1, n_local=4, h=8, h_kv=2, d=16, dtype="bf16", seed=25, **grid),
    ]


def test_all_gather_equals_full_attention_on_two_ranks(pools) -> None:
    cases = _ring_cases(2)
    assert all(len(r) == len(cases) for r in pools.get(2).run(check_attention_cases, cases, timeout=600))


def test_all_gather_equals_full_attention_in_the_grid(pools) -> None:
    cases = _grid_cases()
    assert all(len(r) == len(cases) for r in pools.get(4).run(check_attention_cases, cases, timeout=600))


@pytest.mark.slow
def test_all_gather_equals_full_attention_on_four_ranks(pools) -> None:
    cases = _ring_cases(4) + [AttnCase("ring", "zigzag", True, 1, 6, 8, 2, 16, dt, seed=30 + i, ring=4,
                                       kv_exchange=AG) for i, dt in enumerate(("fp32", "bf16"))]
    assert all(len(r) == len(cases) for r in pools.get(4).run(check_attention_cases, cases, timeout=600))


def _broken_gather_case(case: AttnCase) -> str:
    """Negative control: the gathered KV of the wrong source must fail the oracle check."""
    from ring_sp.ring import kv_exchange

    original = kv_exchange.GatheredKV.received

    def wrong(self, step):
        return original(self, (step + 1) % self.spec.world_size)

    kv_exchange.GatheredKV.received = wrong
    try:
        check_attention_cases([case])
    except AssertionError as exc:
        return str(exc)
    finally:
        kv_exchange.GatheredKV.received = original
    raise AssertionError("a wrong gathered shard went unnoticed")


def test_a_wrong_gathered_shard_is_caught(pools) -> None:
    case = AttnCase("ring", "zigzag", True, 1, 4, 4, 2, 8, "fp64", seed=40, ring=2, kv_exchange=AG)
    assert all("kv_exchange=all_gather" in m for m in pools.get(2).run(_broken_gather_case, case, timeout=300))


def _measure(u: int, r: int, h: int, h_kv: int, dtype: str, d_v: int | None, window: int | None,
             layout: str) -> dict:
    from test_comm import _count_torch_collectives

    topo = ring_sp.init_sequence_parallel(u, r)
    b, n, d = 2, 8, 16
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(b, n, h, d, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(b, n, h_kv, d, dtype=dt, generator=g).requires_grad_()
    v = torch.randn(b, n, h_kv, d if d_v is None else d_v, dtype=dt, generator=g).requires_grad_()
    kw = dict(topology=topo, causal=True, layout=layout, sliding_window=window, kv_exchange=AG)
    ring_sp.hybrid_attention(q, k, v, **kw)  # the first call of a shape agrees on it
    with _count_torch_collectives() as fwd_calls, ring_sp.count_communication() as fwd:
        out = ring_sp.hybrid_attention(q, k, v, **kw)
    with _count_torch_collectives() as bwd_calls, ring_sp.count_communication() as bwd:
        out.backward(torch.randn_like(out))
    return {"fwd": fwd.bytes_sent, "bwd": bwd.bytes_sent, "fwd_calls": dict(fwd_calls), "bwd_calls": dict(bwd_calls)}


@pytest.mark.parametrize("u,r,h,h_kv,dtype,d_v,window,layout", [
    (1, 4, 8, 2, "bfloat16", None, None, "zigzag"),
    (2, 2, 8, 1, "float32", 24, None, "zigzag"),  # MLA, a replicated KV head: one packed message
    (1, 4, 8, 1, "bfloat16", None, 9, "striped"),  # a window's halo is every rank: the same gather
])
def test_bytes_and_calls_match_the_planner(pools, u, r, h, h_kv, dtype, d_v, window, layout) -> None:
    results = pools.get(4).run(_measure, u, r, h, h_kv, dtype, d_v, window, layout, timeout=300)
    fwd, bwd = layer_bytes(ulysses=u, ring=r, batch=2, local_len=8, heads=h, kv_heads=h_kv, head_dim=16,
                           dtype="bf16" if dtype == "bfloat16" else "fp32", value_head_dim=d_v, layout=layout,
                           sliding_window=window, kv_exchange=AG)
    # by hand: 2 x 8 x U tokens per ring shard, (16 + d_v) per KV head after the all-to-all
    shard = 2 * 8 * u * max(h_kv // u, 1) * (16 + (d_v or 16))
    elem = 2 if dtype == "bfloat16" else 4
    assert fwd["allgather_kv"] == (r - 1) * shard * elem and bwd["reduce_scatter_dkv"] == (r - 1) * shard * 4
    a2a = 3 if u > 1 else 0
    for res in results:
        assert res["fwd"] == fwd and res["bwd"] == bwd
        # one gather forward; one gather and one reduce-scatter backward; no point-to-point at all
        assert res["fwd_calls"] == {GATHER: 1, "all_gather": 1,  # the per-call agreement (issue 31)
                                    **({"all_to_all_single": a2a} if a2a else {})}
        assert res["bwd_calls"] == {GATHER: 1, SCATTER: 1,
                                    **({"all_to_all_single": a2a} if a2a else {})}


def _validation(rank_choice: bool) -> str:
    from test_comm import _count_torch_collectives

    q = torch.randn(1, 4, 4, 8)
    value = ("ring" if dist.get_rank() == 0 else AG) if rank_choice else "allgather"
    with _count_torch_collectives() as calls:
        try:
            # a bad value fails locally (no collective); a mismatch only the agreement can see
            ring_sp.ring_attention(q, q, q, causal=True, kv_exchange=value, validate=rank_choice)
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError("no error")
    if not rank_choice and calls:
        raise AssertionError(f"collectives before the error: {dict(calls)}")
    return message


def test_a_bad_or_mismatched_kv_exchange_is_refused(pools) -> None:
    pool = pools.get(2)
    for message in pool.run(_validation, False, timeout=120):
        assert "kv_exchange='allgather'" in message and "all_gather" in message
    for message in pool.run(_validation, True, timeout=120):
        assert "kv_exchange='all_gather'" in message and "disagree" in message


def test_planner_bytes_by_hand_and_its_choice() -> None:
    # MLA-like: 1 KV head, d = 192, d_v = 128, bf16, R = 4 of 2048 tokens each
    fwd, bwd = layer_bytes(ulysses=1, ring=4, batch=1, local_len=2048, heads=16, kv_heads=1, head_dim=192,
                           dtype="bf16", value_head_dim=128, kv_exchange=AG)
    shard = 2048 * 1 * (192 + 128)
    assert fwd == {"allgather_kv": 3 * shard * 2}
    assert bwd == {"allgather_kv": 3 * shard * 2, "reduce_scatter_dkv": 3 * shard * 4}
    common = dict(ulysses=1, batch=1, heads=32, head_dim=128, value_head_dim=128, dtype=torch.bfloat16,
                  layout="zigzag", causal=True, sliding_window=None)
    # few KV heads and short chunks: 7 synchronising ring steps cost more than the gather's exposed share
    assert choose_kv_exchange(ring=8, local_len=1024, kv_heads=1, **common) == AG
    # MHA over long chunks: the ring hides every transfer, the gather's reduce-scatter would not hide
    assert choose_kv_exchange(ring=8, local_len=16384, kv_heads=32, **common) == "ring"
    # a sliding window striped over every rank: each ring step's block is a thin band, every step synchronises
    window = {**common, "sliding_window": 256}
    assert choose_kv_exchange(ring=8, local_len=1024, kv_heads=8, **{**window, "layout": "striped"}) == AG
    # contiguous: the ring's halo is one partner, gathering everything loses
    assert choose_kv_exchange(ring=8, local_len=1024, kv_heads=8, **{**window, "layout": "contiguous"}) == "ring"
    # the CLI's plan lists both; its pick for the pinned grid agrees with choose_kv_exchange
    cluster = Cluster(8, 8, 494.5e12, 450e9, 50e9, latency=10e-6)
    model = ModelShape(32, 1, 128, 4096, 1)
    result = plan(cluster, model, Workload(8192), ulysses=1, kv_exchange="auto")
    assert {c.kv_exchange for c in result.candidates} == {"ring", AG}
    assert result.recommended.kv_exchange == choose_kv_exchange(ring=8, local_len=1024, kv_heads=1, cluster=cluster,
                                                                **common) == AG
    ring, gather = (next(c for c in result.candidates if c.kv_exchange == x) for x in ("ring", AG))
    assert gather.working_bytes > ring.working_bytes  # it holds every KV shard and fp32 partial in backward
