"""Issue 8: packed sequences (cu_seqlens) against the float64 oracle with a block-diagonal
(causal) mask, for ring, Ulysses and the grid, every layout, random document lengths
including length-1 documents and documents that span every shard boundary."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import ring_sp
from dist_cases import AttnCase, check_attention_cases, random_documents

LAYOUTS = ("contiguous", "zigzag", "striped", "document_zigzag", "document_balanced")


def _cases(mode: str, u: int, r: int, layouts=LAYOUTS) -> list[AttnCase]:
    shapes = itertools.cycle([(1, 16, 8), (2, 8, 12), (1, 64, 4)])
    cases = []
    for layout, causal, dtype, seed in itertools.product(layouts, (True, False), ("fp64", "fp32", "bf16"), range(2)):
        b, d, n = next(shapes)
        cases.append(AttnCase(mode, layout, causal, b, n, 4, 2, d, dtype, seed=100 * len(cases) + seed,
                              ulysses=u, ring=r, packed=True))
    return cases


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_packed_ring(pools, world_size: int) -> None:
    pools.get(world_size).run(check_attention_cases, _cases("ring", 1, world_size), timeout=600)


def test_packed_ulysses(pools) -> None:
    pools.get(4).run(check_attention_cases, _cases("ulysses", 1, 1), timeout=600)


@pytest.mark.parametrize("u,r", [(2, 2), (1, 4), (4, 1)])
def test_packed_grid(pools, u: int, r: int) -> None:
    layouts = ("zigzag", "contiguous", "document_zigzag", "document_balanced") + (("striped",) if u == 1 or r == 1 else ())
    pools.get(4).run(check_attention_cases, _cases("hybrid", u, r, layouts), timeout=600)


def test_random_documents_cover_the_hard_cases() -> None:
    cu = random_documents(64, seed=0)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert 1 in lengths and sum(lengths) == 64
    per_rank = 64 // 4
    spanning = [(a, b) for a, b in zip(cu, cu[1:]) if a // per_rank != (b - 1) // per_rank]
    assert spanning, "some document must span a contiguous shard boundary"


def documents_that_share_nothing_launch_nothing() -> int:
    """Two documents, each inside one contiguous shard: the other ranks' steps are empty."""
    calls = {"n": 0}
    topo_q = torch.randn(1, 8, 2, 8)
    kernel_forward = ring_sp.kernels.torch_cpu.TorchCPUKernel.forward

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return kernel_forward(self, *args, **kwargs)

    ring_sp.kernels.torch_cpu.TorchCPUKernel.forward = counting
    try:
        ring_sp.ring_attention(topo_q, topo_q[:, :, :1], topo_q[:, :, :1], causal=False, layout="contiguous",
                               cu_seqlens=[0, 8, 16])
    finally:
        ring_sp.kernels.torch_cpu.TorchCPUKernel.forward = kernel_forward
    return calls["n"] if dist.get_world_size() == 2 else -1


def test_steps_without_a_shared_document_launch_no_kernel(pools) -> None:
    assert pools.get(2).run(documents_that_share_nothing_launch_nothing) == [1, 1]


def test_shard_batch_with_documents_shifts_inside_documents_and_restarts_positions() -> None:
    ids = torch.arange(10, 22).view(1, 12)
    batch, cu = ring_sp.pad_documents({"input_ids": ids}, [0, 5, 12], 4, pad_id=0)
    assert cu == (0, 8, 16) and batch["input_ids"][0, 5:8].tolist() == [0, 0, 0]
    shards = [ring_sp.shard_batch(batch, rank=r, world_size=2, layout="document_zigzag", cu_seqlens=cu) for r in range(2)]
    full = ring_sp.unshard_sequence(torch.stack([s["labels"] for s in shards]), layout="document_zigzag", cu_seqlens=cu)
    assert full[0].tolist() == [11, 12, 13, 14, -100, -100, -100, -100, 16, 17, 18, 19, 20, 21, -100, -100]
    positions = ring_sp.unshard_sequence(torch.stack([s["position_ids"] for s in shards]), layout="document_zigzag", cu_seqlens=cu)
    assert positions[0].tolist() == list(range(8)) * 2


def empty_document_case(layout: str, cu_seqlens: tuple[int, ...]) -> float:
    """A repeated boundary (an empty document, as padded batches produce) changes nothing."""
    from dist_cases import document_mask
    from oracle import GRAD_TOL, OUT_TOL, assert_close, make_inputs, oracle_results

    inputs = make_inputs(5, 1, cu_seqlens[-1], 4, 2, 8, torch.float64)
    expected = oracle_results(inputs, causal=True, mask=document_mask(cu_seqlens, True))
    shard = lambda x: ring_sp.shard_sequence(x, rank=dist.get_rank(), world_size=2, layout=layout, cu_seqlens=cu_seqlens)  # noqa: E731
    q, k, v = (shard(inputs[n]).requires_grad_() for n in ("q", "k", "v"))
    out = ring_sp.ring_attention(q, k, v, causal=True, layout=layout, cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32))
    out.backward(shard(inputs["dout"]))
    assert_close("out", out, shard(expected["out"]), OUT_TOL[torch.float64])
    return assert_close("dk", k.grad, shard(expected["dk"]), GRAD_TOL[torch.float64])


@pytest.mark.parametrize("layout", ["zigzag", "document_zigzag", "striped"])
def test_empty_documents_are_allowed(pools, layout: str) -> None:
    pools.get(2).run(empty_document_case, layout, (0, 4, 4, 8, 8, 16))


def schedule_builds_case() -> list[int]:
    """Issue 24: the packed schedule is built once per distinct ``cu_seqlens`` (and topology
    parameters) on the group, and reused by every layer and the backward. Builds counted
    after: two layers' forward + backward; the same documents as a new tensor; a new
    packing; a different window; the first packing again (still cached); another group."""
    from ring_sp.schedule_cache import schedule_cache

    group = dist.group.WORLD
    cache = schedule_cache(group)
    before = cache.builds
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    first, second = [0, 5, 6, 19, 32], [0, 3, 20, 21, 32]
    counts = []

    def layer(cu, **options) -> None:
        ring_sp.ring_attention(q, k, v, causal=True, layout="document_zigzag", cu_seqlens=cu, **options).sum().backward()

    layer(first)
    layer(first)
    counts.append(cache.builds - before)
    layer(torch.tensor(first))
    counts.append(cache.builds - before)
    layer(second)
    counts.append(cache.builds - before)
    layer(second, sliding_window=4)
    counts.append(cache.builds - before)
    layer(first)
    counts.append(cache.builds - before)
    other = dist.new_group(list(range(dist.get_world_size())))
    ring_sp.ring_attention(q, k, v, group=other, causal=True, layout="document_zigzag", cu_seqlens=first)
    counts.append(schedule_cache(other).builds)
    return counts


def test_the_packed_schedule_is_built_once_per_distinct_documents(pools) -> None:
    assert pools.get(2).run(schedule_builds_case) == [[1, 1, 2, 3, 3, 1]] * 2


def test_schedule_cache_is_a_bounded_lru() -> None:
    from ring_sp.schedule_cache import ScheduleCache

    cache: ScheduleCache[str] = ScheduleCache(maxsize=2)
    assert [cache.get(key, lambda key=key: key * 2) for key in ("a", "b", "a", "c", "b")] == ["aa", "bb", "aa", "cc", "bb"]
    assert cache.builds == 4 and len(cache) == 2  # "b" was evicted by "c" ("a" used more recently)
    with pytest.raises(ValueError, match="maxsize=0"):
        ScheduleCache(maxsize=0)
