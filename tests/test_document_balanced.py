"""Issue 44 on ranks: ``document_balanced`` and ``layout="auto"`` against the float64 oracle
(ring P = 2, 3, 4, Ulysses, the grid; windows, spans, sinks, GQA; an fp64 gradcheck), and
the exchange that moves only what is read: counted bytes equal the pure plan's rows, and a
batch of whole documents moves nothing."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import AttnCase, check_attention_cases, gradcheck_case
from ring_sp.schedule import exchange_plan, row_count


def _cases(mode: str, u: int, r: int, layout: str = "document_balanced", *, extras: bool = True) -> list[AttnCase]:
    shapes = itertools.cycle([(1, 16, 8), (2, 8, 12), (1, 64, 4)])
    options = [dict()]
    if extras:
        options += [dict(window=3), dict(window=11), dict(spans=True), dict(sinks=True), dict(window=5, spans=True)]
    cases = []
    for opts, dtype in itertools.product(options, ("fp64", "fp32", "bf16")):
        b, d, n = next(shapes)
        cases.append(AttnCase(mode, layout, True, b, n, 4, 2, d, dtype, seed=300 + len(cases), ulysses=u, ring=r,
                              packed=True, **opts))
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_document_balanced_ring(pools, world_size: int) -> None:
    pools.get(world_size).run(check_attention_cases, _cases("ring", 1, world_size), timeout=600)


def test_document_balanced_ulysses_and_grid(pools) -> None:
    pools.get(2).run(check_attention_cases, _cases("ulysses", 1, 1, extras=False), timeout=600)
    pools.get(4).run(check_attention_cases, _cases("hybrid", 2, 2), timeout=600)


@pytest.mark.slow
def test_document_balanced_on_eight_ranks(pools) -> None:
    pools.get(8).run(check_attention_cases, _cases("ring", 1, 8) + _cases("hybrid", 2, 4), timeout=900)


def test_auto_layout_is_exact(pools) -> None:
    cases = [AttnCase("ring", "auto", True, 1, 16, 4, 2, 8, dtype, seed=400 + i, ring=4, packed=packed)
             for i, (dtype, packed) in enumerate(itertools.product(("fp64", "bf16"), (True, False)))]
    cases += [AttnCase("hybrid", "auto", True, 1, 8, 4, 2, 8, "fp32", seed=410, ulysses=2, ring=2, packed=True,
                       window=4)]
    pools.get(4).run(check_attention_cases, cases, timeout=600)


def test_document_balanced_gradcheck(pools) -> None:
    assert pools.get(2).run(gradcheck_case, "ring", "document_balanced", True, cu_seqlens=(0, 1, 4)) == [True, True]


def bytes_against_the_plan(cu: tuple[int, ...], layout: str) -> dict:
    """Forward and backward ring bytes this rank sends, and the plan's rows (fp32, 2 KV heads of 8)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    seq_len = cu[-1]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, seq_len, h, 8, generator=g) for h in (4, 2, 2))
    shard = lambda x: ring_sp.shard_sequence(x, rank=rank, world_size=world_size, layout=layout, cu_seqlens=cu)  # noqa: E731
    q, k, v = (shard(x).requires_grad_() for x in (q, k, v))
    ring_sp.ring_attention(q, k, v, causal=True, layout=layout, cu_seqlens=cu)  # the agreement's first call
    with ring_sp.count_communication() as fwd:
        out = ring_sp.ring_attention(q, k, v, causal=True, layout=layout, cu_seqlens=cu)
    with ring_sp.count_communication() as bwd:
        out.backward(torch.ones_like(out))
    plan = exchange_plan(layout, True, rank, world_size, seq_len // world_size, cu)
    row = 1 * 2 * (8 + 8) * 4  # batch x KV heads x (d + d_v) x fp32
    return {"fwd": fwd.bytes_sent, "bwd": bwd.bytes_sent, "sent_rows": sum(map(row_count, plan.send_rows[1:])) * row,
            "read_rows": sum(map(row_count, plan.recv_rows[1:])) * row}


def test_messages_carry_what_the_plan_says_and_whole_documents_nothing(pools) -> None:
    packs = {"mixed": (0, 3, 40, 41, 90, 128), "whole": tuple(range(0, 129, 16))}
    for name, cu in packs.items():
        for layout in ("document_balanced", "document_zigzag"):
            for res in pools.get(4).run(bytes_against_the_plan, cu, layout):
                assert res["fwd"].get("ring_kv", 0) == res["sent_rows"], (name, layout, res)
                assert res["bwd"].get("ring_kv", 0) == res["sent_rows"]
                assert res["bwd"].get("ring_dkv", 0) == res["read_rows"]  # fp32 partials of the rows read, home
                if name == "whole" and layout == "document_balanced":
                    assert res["fwd"] == {} and res["bwd"] == {}, res
