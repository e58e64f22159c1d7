"""The per-step causal decision (pure, no processes) and the per-rank work balance."""

from __future__ import annotations

import pytest
import torch

from ring_sp.layouts import LAYOUTS, layout_positions

PLAIN = ("contiguous", "zigzag", "striped")  # the layouts that need no documents
from ring_sp.schedule import causal_work_per_rank, ring_step_tasks


def _mask_from_tasks(layout: str, causal: bool, rank: int, source: int, n: int) -> torch.Tensor:
    mask = torch.zeros(n, n, dtype=torch.bool)
    for task in ring_step_tasks(layout, causal, rank, source, n):
        nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
        block = torch.ones(nq, nk, dtype=torch.bool)
        if task.causal:
            assert nq == nk, "masked blocks must be square"
            block = block.tril()
        assert not mask[task.q, task.kv].any(), "blocks must not overlap"
        mask[task.q, task.kv] = block
    return mask


@pytest.mark.parametrize("layout", PLAIN)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_tasks_cover_exactly_the_visible_pairs(layout: str, world_size: int, causal: bool) -> None:
    """For every (rank, source) the union of blocks equals the true mask from the positions."""
    n_local = 6
    positions = layout_positions(layout, world_size, n_local * world_size)
    for rank in range(world_size):
        for source in range(world_size):
            q_pos, k_pos = positions[rank], positions[source]
            truth = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1) if causal else torch.ones(n_local, n_local, dtype=torch.bool)
            assert torch.equal(_mask_from_tasks(layout, causal, rank, source, n_local), truth), (rank, source)


@pytest.mark.parametrize("layout", PLAIN)
def test_fully_masked_steps_launch_nothing(layout: str) -> None:
    for rank in range(4):
        for source in range(4):
            tasks = ring_step_tasks(layout, True, rank, source, 8)
            assert all(t.visible_pairs() > 0 for t in tasks)
    assert ring_step_tasks("contiguous", True, 0, 3, 8) == ()
    assert ring_step_tasks("striped", True, 0, 1, 1) == ()  # strictly-causal 1x1 block is empty


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zigzag_and_striped_balance_causal_work_and_contiguous_does_not(world_size: int) -> None:
    n_local = 512
    zigzag = causal_work_per_rank("zigzag", world_size, n_local)
    striped = causal_work_per_rank("striped", world_size, n_local)
    contiguous = causal_work_per_rank("contiguous", world_size, n_local)
    total = (n_local * world_size) * (n_local * world_size + 1) // 2
    for work in (zigzag, striped, contiguous):
        assert sum(work) == total  # every visible pair computed exactly once
    assert max(zigzag) == min(zigzag)  # exactly balanced
    assert max(striped) / (sum(striped) / world_size) <= 1.01
    assert max(contiguous) / (sum(contiguous) / world_size) >= 2 - 1 / world_size - 0.01  # ~2x


def test_zigzag_steps_after_the_first_cost_half_a_block() -> None:
    n = 16
    for rank in range(4):
        for source in range(4):
            work = sum(t.visible_pairs() for t in ring_step_tasks("zigzag", True, rank, source, n))
            assert work == (n * (n + 1) // 2 if source == rank else n * n // 2)


def _random_documents(seq_len: int, seed: int, multiple: int = 1) -> tuple[int, ...]:
    """Boundaries with length-1 documents (multiple=1) and documents spanning shards."""
    g = torch.Generator().manual_seed(seed)
    cuts = {0, seq_len}
    while len(cuts) < min(seq_len // multiple, 2 + int(torch.randint(1, 12, (1,), generator=g))):
        cuts.add(int(torch.randint(1, seq_len // multiple, (1,), generator=g)) * multiple)
    if multiple == 1 and seq_len > 3:
        cuts.update({1, 2})  # two length-1 documents at the start
    return tuple(sorted(cuts))


def _document_mask(positions_q: torch.Tensor, positions_k: torch.Tensor, cu: tuple[int, ...], causal: bool) -> torch.Tensor:
    edges = torch.tensor(cu)
    doc_q = torch.searchsorted(edges, positions_q, right=True)
    doc_k = torch.searchsorted(edges, positions_k, right=True)
    same = doc_q.unsqueeze(1) == doc_k.unsqueeze(0)
    return same & (positions_k.unsqueeze(0) <= positions_q.unsqueeze(1)) if causal else same


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_packed_tasks_cover_exactly_the_same_document_pairs(layout: str, world_size: int, causal: bool, seed: int) -> None:
    from ring_sp.schedule import step_tasks

    n_local = 12 if layout != "document_zigzag" else 2 * world_size * 3
    seq_len = n_local * world_size
    multiple = 2 * world_size if layout == "document_zigzag" else 1
    cu = _random_documents(seq_len, seed, multiple)
    positions = layout_positions(layout, world_size, seq_len, cu)
    for rank in range(world_size):
        for source in range(world_size):
            got = torch.zeros(n_local, n_local, dtype=torch.bool)
            for task in step_tasks(layout, causal, rank, source, world_size, n_local, cu):
                nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
                assert nq > 0 and nk > 0 and (not task.causal or nq == nk)
                block = torch.ones(nq, nk, dtype=torch.bool)
                assert not got[task.q, task.kv].any(), "blocks must not overlap"
                got[task.q, task.kv] = block.tril() if task.causal else block
            truth = _document_mask(positions[rank], positions[source], cu, causal)
            assert torch.equal(got, truth), (rank, source, cu)


def test_document_zigzag_balances_every_document_mix_and_plain_zigzag_does_not() -> None:
    world_size, n_local = 4, 256
    seq_len = world_size * n_local
    one_long = (0, 512, 576, 640, 768, 832, 896, 960, seq_len)  # one half-length document + short ones
    plain = causal_work_per_rank("zigzag", world_size, n_local, cu_seqlens=one_long)
    balanced = causal_work_per_rank("document_zigzag", world_size, n_local, cu_seqlens=one_long)
    striped = causal_work_per_rank("striped", world_size, n_local, cu_seqlens=one_long)
    assert sum(plain) == sum(balanced) == sum(striped)  # the same visible pairs, distributed differently
    assert max(balanced) == min(balanced)
    assert max(striped) / (sum(striped) / world_size) <= 1.02
    assert max(plain) / (sum(plain) / world_size) >= 1.4


@pytest.mark.parametrize("causal", [True, False])
def test_interval_blocks_cover_exactly_the_causal_pairs_of_any_two_intervals(causal: bool) -> None:
    """The per-document cut of a block, for every pair of intervals in a small frame
    (our layouts only produce nested ones; the function is exact for all)."""
    from ring_sp.schedule.blocks import interval_blocks as _interval_blocks

    size = 6
    intervals = [(a, b) for a in range(size) for b in range(a + 1, size + 1)]
    for q in intervals:
        for kv in intervals:
            got = torch.zeros(size, size, dtype=torch.bool)
            for task in _interval_blocks(q, kv, causal):
                nq, nk = task.q.stop - task.q.start, task.kv.stop - task.kv.start
                assert nq > 0 and nk > 0 and (not task.causal or (task.q == task.kv))
                assert not got[task.q, task.kv].any()
                got[task.q, task.kv] = torch.ones(nq, nk, dtype=torch.bool).tril() if task.causal else True
            rows, cols = torch.arange(size).unsqueeze(1), torch.arange(size).unsqueeze(0)
            truth = (rows >= q[0]) & (rows < q[1]) & (cols >= kv[0]) & (cols < kv[1])
            if causal:
                truth &= cols <= rows
            assert torch.equal(got, truth), (q, kv)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("u,r", [(1, 1), (1, 3), (2, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("seed", range(3))
def test_shard_pieces_are_the_position_runs_of_the_shard(layout: str, u: int, r: int, seed: int) -> None:
    """The schedule cuts a rank's runs at documents without building its positions: the same
    pieces as position_runs over the positions themselves."""
    from ring_sp.layouts import ring_positions, shard_runs
    from ring_sp.schedule.documents import position_runs, shard_pieces

    if layout == "striped" and u > 1 and r > 1:
        return
    seq_len = 2 * u * r * 7
    cu = _random_documents(seq_len, seed)
    for ring_rank in range(r):
        runs = shard_runs(layout, u, r, seq_len, ring_rank, cu)
        positions = ring_positions(layout, u, r, seq_len, cu)[ring_rank]
        for consecutive in (True, False) if runs.stride == 1 else (False,):
            for documents in (cu, None):
                got = list(zip(*(t.tolist() for t in shard_pieces(runs, documents, consecutive=consecutive))))
                assert got == position_runs(positions, documents, consecutive=consecutive), (ring_rank, consecutive)
