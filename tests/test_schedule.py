"""The per-step causal decision (pure, no processes) and the per-rank work balance."""

from __future__ import annotations

import pytest
import torch

from ring_sp.layouts import LAYOUTS, layout_positions
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


@pytest.mark.parametrize("layout", LAYOUTS)
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


@pytest.mark.parametrize("layout", LAYOUTS)
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
