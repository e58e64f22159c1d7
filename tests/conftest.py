"""Shared fixtures: the multi-rank pools (see harness.py), and a session that sees a fresh machine.

The session's ``TORCH_EXTENSIONS_DIR`` is a private empty directory (each pool launch gets
its own, see harness.py), so no test leans on a C++ op built earlier in the user's cache,
and no killed build can leave a lock there that blocks a later run. Nothing in this
project builds a C++ extension: the session fails at its end if any such directory was
written to.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from harness import PoolManager, live_groups, release_groups
from suite_health import SuiteHealth

os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed picks its accelerator once, at import; the pools' ranks import it in their
# forkserver (harness.FORKSERVER_PRELOAD), and every DeepSpeed test here runs on gloo CPU ranks
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# set at import, before any pool's forkserver or subprocess inherits the environment
SESSION_EXTENSIONS_DIR = tempfile.mkdtemp(prefix="ring_sp_test_ext_")
os.environ["TORCH_EXTENSIONS_DIR"] = SESSION_EXTENSIONS_DIR


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteHealth(), "ring_sp_suite_health")


def _files_under(path: str) -> list[str]:
    return [os.path.join(root, f) for root, dirs, files in os.walk(path) for f in dirs + files]


@pytest.fixture(scope="session", autouse=True)
def nothing_built():
    """After the session: nothing (subprocesses included) wrote to the session's extensions dir."""
    yield
    built = _files_under(SESSION_EXTENSIONS_DIR)
    shutil.rmtree(SESSION_EXTENSIONS_DIR, ignore_errors=True)
    assert not built, f"a test built C++ extensions (TORCH_EXTENSIONS_DIR): {built}"


@pytest.fixture(autouse=True)
def process_groups_released():
    """Every process group a test makes in the pytest process is destroyed when it ends (a group
    lives, with three gloo threads, until destroyed; 117 of them once ran behind test_megatron.py)."""
    before = live_groups()
    yield
    release_groups(before)


@pytest.fixture(scope="session")
def pools():
    """``pools.get(world_size)`` -> a persistent :class:`harness.RankPool`."""
    # one pool at a time: an idle pool's ranks were seen using ~half a core each after some
    # 4-rank cases, starving a second pool's ranks past their case timeouts on 2 cores
    manager = PoolManager(max_alive=1)
    yield manager
    manager.close()
    assert not manager.leftovers, f"a pool's ranks built C++ extensions (TORCH_EXTENSIONS_DIR): {manager.leftovers}"


@pytest.fixture(scope="session")
def single_rank():
    """A 1-rank gloo default group in the pytest process (for checks that need none of the
    pool's ranks). Pool ranks fork from a separate server, so they do not inherit it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        path = tempfile.mktemp(prefix="ring_sp_single_")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.fixture
def ring_sp_one_rank(single_rank):
    """ring_sp registered with transformers over a 1-rank group (yields its topology), the registry restored after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    import ring_sp
    import ring_sp.integrations.transformers as rsp_hf

    saved = [(registry, registry._global_mapping.get("ring_sp")) for registry in (AttentionInterface,
                                                                                AttentionMaskInterface)]
    topology = ring_sp.init_sequence_parallel(1, 1)
    rsp_hf.register(topology)
    yield topology
    for registry, entry in saved:
        if entry is None:
            registry._global_mapping.pop("ring_sp", None)
        else:
            registry._global_mapping["ring_sp"] = entry
