"""Step times: every call starts on all ranks together, and a step lasts as long as its
slowest rank; we report the median over repeats after warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (CUDA timings are otherwise launch times)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(step: Callable[[], object], *, group: dist.ProcessGroup, device: torch.device,
              reset: Callable[[], None] | None = None) -> float:
    """This rank's seconds for one call of ``step``; ``reset`` runs first, untimed (e.g.
    clearing ``.grad``), then a barrier: call i means the same moment on every rank."""
    if reset is not None:
        reset()
    synchronize(device)
    dist.barrier(group)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Each repeat's step time: its slowest rank's (``per_rank[rank][repeat]``)."""
    return [max(rank_times[i] for rank_times in per_rank) for i in range(len(per_rank[0]))]


def step_time(per_rank: list[list[float]]) -> float:
    """Median over repeats of the slowest rank's time."""
    return statistics.median(slowest_rank(per_rank))


def rank_balance(per_rank: list[list[float]]) -> float:
    """max/mean over ranks of each rank's median time: 1.0 when every rank is as busy."""
    medians = [statistics.median(t) for t in per_rank]
    return max(medians) / (sum(medians) / len(medians))
