"""Issue 45 item 2: the double ring (``kv_exchange="double_ring"``, ring_sp/schedule/ring_order.py).

Pure: every step's source, sender and reader agree between the two ends of every message; the
rows a holder forwards are the rows its reader reads; the blocks of a pass are the flat ring's,
in another order; bytes per link class by the pure count. Distributed: outputs and dq/dk/dv
against the float64 oracle and an fp64 gradcheck, with the nodes emulated by ``node_size``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_cases import AttnCase, check_attention_cases, gradcheck_case, nodes_of
import torch.distributed as dist

import ring_sp
from ring_sp.plan import layer_bytes
from ring_sp.nodes import ring_inner_size
from ring_sp.schedule import RingOrder, exchange_plan, pass_link_rows, row_count

ORDERS = [(4, 2), (8, 2), (8, 4), (6, 3), (6, 2)]


def _unwithin(rows, held):
    """Rows of a held message mapped back to the shard's rows."""
    flat = [i for a, b in held for i in range(a, b)]
    return {flat[i] for a, b in rows for i in range(a, b)}


def _set(rows):
    return {i for a, b in rows or () for i in range(a, b)}


@pytest.mark.parametrize("world_size,inner", ORDERS)
def test_each_step_reads_one_shard_and_both_ends_agree(world_size: int, inner: int) -> None:
    order = RingOrder(world_size, inner)
    for rank in range(world_size):
        sources = [order.source(rank, t) for t in range(world_size)]
        assert sorted(sources) == list(range(world_size)) and sources[0] == rank
        for t in range(1, world_size):
            sender = order.sender(rank, t)
            if order.inner_step(t):  # inside the node, from the rank holding the source's shard
                assert sender // inner == rank // inner and order.reader(sender, t) == rank
                assert order.held(sender, t) == sources[t]
            else:  # the inter-node message: the owner, in another node, same local rank
                assert sender == sources[t] and sender // inner != rank // inner and sender % inner == rank % inner
                assert order.inter_peer(sender, t // inner) == rank
    flat = RingOrder.flat(5)
    assert not flat.double and [flat.source(3, t) for t in range(5)] == [3, 2, 1, 0, 4]
    assert not RingOrder(4, 1).double and not RingOrder(4, 4).double


CASES = [("zigzag", None, None), ("contiguous", None, 5), ("zigzag", None, 6), ("document_zigzag", (0, 40, 41, 100, 128), None),
         ("document_balanced", (0, 3, 50, 60, 61, 90, 128), None), ("zigzag", (0, 30, 128), 9)]


@pytest.mark.parametrize("world_size,inner", [(4, 2), (8, 2), (8, 4)])
@pytest.mark.parametrize("layout,cu,window", CASES)
def test_messages_carry_what_their_readers_read(world_size: int, inner: int, layout: str, cu, window) -> None:
    """Both ends of every message compute the same rows; the held message has every row its node
    reads of the shard; the blocks of each (query rank, key rank) pair are the flat ring's."""
    seq_len = 128 if world_size != 6 else 96
    local = seq_len // world_size
    order = RingOrder(world_size, inner)
    plans = [exchange_plan(layout, True, r, world_size, local, cu, window, inner_size=inner) for r in range(world_size)]
    flats = [exchange_plan(layout, True, r, world_size, local, cu, window) for r in range(world_size)]
    for r, t in itertools.product(range(world_size), range(world_size)):
        plan, source = plans[r], order.source(r, t)
        assert plan.schedule[t] == flats[r].schedule[(r - source) % world_size]
        read = {i for task in plan.schedule[t] for i in range(task.kv.start, task.kv.stop)}
        if t == 0:
            continue
        sender = order.sender(r, t)
        if order.inner_step(t):
            held = plans[sender].recv_rows[t - order.inner_step(t)]
            sent = plans[sender].send_rows[t]
            assert (sent is None) == (plan.recv_rows[t] is None)
            if sent is not None:
                assert _unwithin(sent, held) == _set(plan.recv_rows[t]) >= read
        else:
            outer = t // inner
            assert plans[sender].inter_send[outer] == plan.recv_rows[t]
            node_reads = {i for q in order.inter_readers(sender, outer) for task in
                          flats[q].schedule[(q - sender) % world_size] for i in range(task.kv.start, task.kv.stop)}
            assert _set(plan.recv_rows[t]) >= node_reads
            if plan.recv_rows[t] is not None and row_count(plan.recv_rows[t]) < local:
                assert _set(plan.recv_rows[t]) == node_reads  # a part: exactly what the node reads


@pytest.mark.parametrize("world_size,inner", [(4, 2), (8, 2), (8, 4)])
def test_inter_node_rows_are_no_more_than_the_flat_rings(world_size: int, inner: int) -> None:
    """Per rank and pass, by the pure count: never more inter-node rows than the flat ring; ``R_in`` times
    fewer when every rank reads every shard (causal, no window: ``R_out - 1`` shards against ``R - R_in``)."""
    local = 128 // world_size

    def rows(layout, cu, window, causal=True, **inner_size):
        return [pass_link_rows(exchange_plan(layout, causal, rank, world_size, local, cu, window, **inner_size), rank,
                               inner) for rank in range(world_size)]

    for layout, cu, window in CASES:
        double, flat = rows(layout, cu, window, inner_size=inner), rows(layout, cu, window)
        for rank in range(world_size):
            assert double[rank]["inter"] <= flat[rank]["inter"], (layout, cu, window, rank, double, flat)
        if (layout, cu, window) == ("zigzag", None, None):  # causal zigzag: half or whole shards, R_in times fewer
            assert sum(d["inter"] for d in double) * inner == sum(f["inter"] for f in flat)
    for rank, (double, flat) in enumerate(zip(rows("zigzag", None, None, False, inner_size=inner),
                                              rows("zigzag", None, None, False))):  # every shard read whole
        assert double == {"inter": (world_size // inner - 1) * local, "intra": world_size // inner * (inner - 1) * local}
        assert flat == {"inter": (world_size - inner) * local, "intra": (inner - 1) * local}


def test_flat_plans_are_unchanged_by_the_order() -> None:
    """inner_size = R (one node) and inner_size = 1 (one rank per node) give the flat ring's plan."""
    for inner in (None, 4, 1):
        for layout, cu, window in CASES:
            plans = [exchange_plan(layout, True, r, 4, 32, cu, window, inner_size=inner) for r in range(4)]
            flats = [exchange_plan(layout, True, r, 4, 32, cu, window) for r in range(4)]
            assert plans == flats


def _double_cases(mode: str, u: int, r: int, node_size: int) -> list[AttnCase]:
    """Causal zigzag, document_zigzag, document_balanced, windows, spans, sinks, GQA; fp64, fp32, bf16."""
    rows = [("zigzag", {}), ("zigzag", dict(window=5)), ("document_zigzag", dict(packed=True)),
            ("document_balanced", dict(packed=True, window=7)), ("document_balanced", dict(packed=True, spans=True)),
            ("zigzag", dict(sinks=True)), ("contiguous", dict(window=3, spans=True, packed=True))]
    dtypes = itertools.cycle(("fp64", "fp32", "bf16", "fp64"))
    shapes = itertools.cycle([(1, 8, 8), (2, 4, 12), (1, 16, 4)])
    cases = []
    for layout, opts in rows:
        b, n, d = next(shapes)
        cases.append(AttnCase(mode, layout, True, b, n, 4, 2, d, next(dtypes), seed=500 + len(cases), ulysses=u,
                              ring=r, kv_exchange="double_ring", node_size=node_size, **opts))
    return cases


def test_double_ring_2x2_matches_the_oracle(pools) -> None:
    """R = 2 x 2: two emulated nodes of two ring ranks (nodes of 2 ranks)."""
    pools.get(4).run(check_attention_cases, _double_cases("ring", 1, 4, 2), timeout=600)


def test_double_ring_3x2_matches_the_oracle(pools) -> None:
    """R = 3 x 2 (three emulated nodes of two ranks): held slots and sums reused across outer steps."""
    cases = _double_cases("ring", 1, 6, 2)
    pools.get(6).run(check_attention_cases, [cases[0], cases[2], cases[3], cases[6]], timeout=600)


def test_double_ring_on_the_grid_and_2x4(pools) -> None:
    """U2 x (2 x 2) (nodes of 4 ranks: each Ulysses pair and two ring ranks per node) and R = 2 x 4."""
    pools.get(8).run(check_attention_cases, _double_cases("hybrid", 2, 4, 4) + _double_cases("ring", 1, 8, 4),
                     timeout=900)


@pytest.mark.parametrize("layout,window,cu", [pytest.param("zigzag", None, None, marks=pytest.mark.slow),
                                              ("document_zigzag", 3, (0, 3, 8))])
def test_double_ring_float64_gradcheck(pools, layout: str, window, cu) -> None:
    assert all(pools.get(4).run(gradcheck_case, "ring", layout, True, 1, 4, window, cu_seqlens=cu,
                                kv_exchange="double_ring", node_size=2, timeout=300))


def bytes_against_the_count(layout: str, cu, window, node_size: int) -> dict:
    """This rank's forward and backward bytes by kind, and the pure count's (fp32, 2 KV heads of 8)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    seq_len = 64
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, seq_len, h, 8, generator=g) for h in (4, 2, 2))
    shard = lambda x: ring_sp.shard_sequence(x, rank=rank, world_size=world_size, layout=layout, cu_seqlens=cu)  # noqa: E731
    q, k, v = (shard(x).requires_grad_() for x in (q, k, v))
    options = dict(causal=True, layout=layout, cu_seqlens=cu, sliding_window=window, kv_exchange="double_ring")
    with nodes_of(node_size):
        ring_sp.ring_attention(q, k, v, **options)  # the agreement's first call
        with ring_sp.count_communication() as fwd:
            out = ring_sp.ring_attention(q, k, v, **options)
        with ring_sp.count_communication() as bwd:
            out.backward(torch.ones_like(out))
    plan = exchange_plan(layout, True, rank, world_size, seq_len // world_size, cu, window, inner_size=node_size)
    row = 1 * 2 * (8 + 8) * 4  # batch x KV heads x (d + d_v) x fp32
    inner = [t for t in range(1, world_size) if t % node_size]
    modelled = layer_bytes(ulysses=1, ring=world_size, batch=1, local_len=seq_len // world_size, heads=4, kv_heads=2,
                           head_dim=8, dtype="fp32", layout=layout, sliding_window=window, ring_rank=rank,
                           kv_exchange="double_ring", inner_size=node_size) if cu is None else None
    return {"fwd": fwd.bytes_sent, "bwd": bwd.bytes_sent, "modelled": modelled,
            "count": {kind: rows * row for kind, rows in pass_link_rows(plan, rank, node_size).items()},
            "read_inner": sum(row_count(plan.recv_rows[t]) for t in inner) * row,
            "held": sum(row_count(plan.recv_rows[t]) for t in range(node_size, world_size, node_size)) * row}


def test_bytes_on_each_link_are_the_pure_counts(pools) -> None:
    """Counted on 4 ranks as 2 x 2: KV inside the node (``ring_kv``) and across (``ring_kv_inter``) as the
    pure count says, forward and again in backward; the partials go back the way their KV came."""
    for layout, cu, window in [("zigzag", None, None), ("document_balanced", (0, 3, 20, 21, 50, 64), None),
                               ("contiguous", None, 5)]:
        for res in pools.get(4).run(bytes_against_the_count, layout, cu, window, 2):
            for counted in (res["fwd"], res["bwd"]):
                assert counted.get("ring_kv", 0) == res["count"]["intra"], (layout, res)
                assert counted.get("ring_kv_inter", 0) == res["count"]["inter"], (layout, res)
            assert res["bwd"].get("ring_dkv", 0) == res["read_inner"], (layout, res)
            assert res["bwd"].get("ring_dkv_inter", 0) == res["held"], (layout, res)
            if res["modelled"] is not None:  # the planner's bytes (ring_sp.plan.layer_bytes) are the counted ones
                assert res["modelled"] == (res["fwd"], res["bwd"]), (layout, res)


def test_ring_inner_size_and_its_errors() -> None:
    assert ring_inner_size([0, 2, 4, 6], 4) == 2  # U2 x R4 on nodes of 4: two ring ranks per node
    assert ring_inner_size([0, 1, 2, 3], 2) == 2 and ring_inner_size([0, 1, 2, 3], 8) == 4
    assert ring_inner_size([0, 4, 8, 12], 4) == 1  # one ring rank per node: the flat ring
    with pytest.raises(ValueError, match="needs the node size.*LOCAL_WORLD_SIZE"):
        ring_inner_size([0, 1], None)
    with pytest.raises(ValueError, match="consecutive in the ring.*kv_exchange='ring'"):
        ring_inner_size([0, 2, 1, 3], 2)  # ring_inner placement over nodes of 2: nodes 0, 1, 0, 1
    assert ring_inner_size([0, 1, 2, 4, 5, 6], 4) == 3
    with pytest.raises(ValueError, match="as many on every node"):
        ring_inner_size([0, 1, 2, 4], 4)


def disagreeing_node_sizes() -> str:
    """Rank 0's launcher says nodes of 2 ranks, the others' 4: the call must fail on every rank."""
    q = k = v = torch.randn(1, 4, 2, 8)
    with nodes_of(2 if dist.get_rank() == 0 else 4):
        try:
            ring_sp.ring_attention(q, k, v, causal=True, kv_exchange="double_ring")
        except ValueError as error:
            return str(error)
    return "no error"


def test_ranks_that_disagree_on_the_node_size_fail_together(pools) -> None:
    for message in pools.get(4).run(disagreeing_node_sizes):
        assert "kv_exchange='double_ring' (nodes of 2 ranks)" in message and "(nodes of 4 ranks)" in message, message
