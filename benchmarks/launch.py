"""Where benchmark cases run: a pool of local gloo ranks, or the world of a ``torchrun`` job.

A case is a module-level function that runs on every rank of a block of ``P`` ranks and
returns one picklable result per rank. It reaches its ranks through :func:`sp_group` and
its device through :func:`device`, so the same case runs on CPU ranks here and on NCCL
GPUs under ``torchrun`` unchanged.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

_block: dict[str, dist.ProcessGroup] = {}  # the group of the case now running (torchrun blocks)


def sp_group() -> dist.ProcessGroup:
    """The ``P`` ranks running the current case."""
    return _block.get("group", dist.group.WORLD)


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Launcher(Protocol):
    is_leader: bool  # writes the results

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
        """``fn(*args)`` on ``world_size`` ranks; one result per rank, in group-rank order."""
        ...

    def close(self) -> None: ...


class PoolLauncher:
    """Gloo ranks on this machine, one thread each, from the test suite's persistent pool
    (``tests/harness.py``): one pool per world size, kept while it is used."""

    is_leader = True

    def __init__(self, case_timeout_s: float = 3600.0) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from harness import PoolManager

        self._pools = PoolManager(max_alive=2)
        self._timeout = case_timeout_s

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
        # DeepSpeed would otherwise warn on every rank that it found no GPU
        env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        return self._pools.get(world_size, pg_timeout_s=self._timeout, env=env).run(fn, *args, timeout=self._timeout)

    def close(self) -> None:
        self._pools.close()


class TorchrunLauncher:
    """Inside ``torchrun --nproc-per-node W -m benchmarks``: NCCL on GPUs, gloo on CPUs.

    A case on ``P`` ranks runs in every block of ``P`` consecutive ranks at once (``P`` must
    divide ``W``), like data-parallel replicas; block 0's results are reported.
    """

    def __init__(self) -> None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
        self.is_leader = dist.get_rank() == 0
        self._blocks: dict[int, dist.ProcessGroup] = {}

    def _group(self, world_size: int) -> dist.ProcessGroup:
        total = dist.get_world_size()
        if total % world_size != 0:
            raise ValueError(f"a case on {world_size} ranks needs a world that it divides; torchrun started {total}")
        if world_size not in self._blocks:
            for start in range(0, total, world_size):  # every rank creates every block, in one order
                group = dist.new_group(list(range(start, start + world_size)))
                if start <= dist.get_rank() < start + world_size:
                    self._blocks[world_size] = group
        return self._blocks[world_size]

    def run(self, fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
        _block["group"] = self._group(world_size)
        try:
            mine = fn(*args)
        finally:
            _block.pop("group")
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
        return results[:world_size]

    def close(self) -> None:
        dist.destroy_process_group()


def launcher() -> Launcher:
    """torchrun's world when started by torchrun, else a local pool of gloo ranks."""
    return TorchrunLauncher() if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else PoolLauncher()
