"""Shared fixtures: the multi-rank pools (see harness.py)."""

from __future__ import annotations

import os

import pytest

from harness import PoolManager

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def pools():
    """``pools.get(world_size)`` -> a persistent :class:`harness.RankPool`."""
    manager = PoolManager(max_alive=2)
    yield manager
    manager.close()


@pytest.fixture(scope="session")
def single_rank():
    """A 1-rank gloo default group in the pytest process (for checks that need none of the
    pool's ranks). Pool ranks fork from a separate server, so they do not inherit it."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        path = tempfile.mktemp(prefix="ring_sp_single_")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD
