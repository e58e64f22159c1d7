"""Issue 21: DeepSpeed starts on a fresh CPU machine (empty extensions cache, no C++ compiler),
and a rank killed in the middle of a DeepSpeed start leaves nothing that blocks the next case.

"No compiler" is a directory of stub ``g++``/``c++``/``gcc``/``cc`` first on ``PATH``: they fail
(or hang, for the kill test) and record that they ran. A negative control shows the set-up
bites: plain ``deepspeed.init_distributed`` without ring_sp's skip tries the build and fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from example_scripts import _free_port
from harness import DistributedCaseError, RankPool

pytest.importorskip("deepspeed")

_COMPILERS = ("g++", "c++", "gcc", "cc", "clang", "clang++")


def _stub_compilers(directory: Path, body: str) -> Path:
    """A directory of compilers that each run ``body`` (sh) after logging their pid to ``calls``."""
    directory.mkdir()
    for name in _COMPILERS:
        stub = directory / name
        stub.write_text(f'#!/bin/sh\necho "$$ $0 $*" >> "{directory}/calls"\n{body}\n')
        stub.chmod(0o755)
    return directory


def _fresh_env(tmp_path: Path, stubs: Path) -> dict[str, str]:
    """This interpreter's environment as a fresh CPU machine sees it: empty extensions dir, stub compilers."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    env.update(TORCH_EXTENSIONS_DIR=str(extensions), DS_ACCELERATOR="cpu", CXX="c++",
               PATH=os.pathsep.join([str(stubs), os.path.dirname(sys.executable), env.get("PATH", "")]))
    return env


def _files(path: str | Path) -> list[str]:
    """Every directory and file under ``path`` (a build starts with an empty directory)."""
    return [os.path.join(root, f) for root, dirs, files in os.walk(path) for f in dirs + files]


# ------------------------------------------------------------------ one process, world size 1
def _start(mode: str, output_dir: str) -> None:
    """DeepSpeed's comm starts through ``mode``; raises if it did not."""
    import torch

    if mode == "initialize":  # a user's own script: rsp_ds.initialize with a "ring_sp" section
        import ring_sp.integrations.deepspeed as rsp_ds

        model = torch.nn.Linear(4, 4)
        config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                  "ring_sp": {"ulysses_size": 1, "ring_size": 1}}
        engine, *_ = rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        assert engine.ring_sp_topology.sp_size == 1
    elif mode == "trainer":  # the Hugging Face path: TrainingArguments starts DeepSpeed itself
        from transformers import TrainingArguments

        import ring_sp.integrations.transformers.trainer  # noqa: F401  (what a Trainer script imports first)

        TrainingArguments(output_dir=output_dir, deepspeed={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
                          report_to="none")
    elif mode == "no_skip":  # negative control: DeepSpeed on its own
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        raise ValueError(mode)
    import deepspeed.comm

    assert deepspeed.comm.is_initialized()


@pytest.mark.parametrize("mode", ["initialize", "trainer", "no_skip"])
def test_deepspeed_starts_without_a_compiler(tmp_path: Path, mode: str) -> None:
    """ring_sp's DeepSpeed starts build nothing: they succeed and the extensions dir stays empty."""
    if mode == "trainer":
        pytest.importorskip("transformers")
    env = _fresh_env(tmp_path, _stub_compilers(tmp_path / "bin", "exit 1"))
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    code = f"import sys; sys.path[:0] = {sys.path!r}; import test_fresh_machine as t; t._start({mode!r}, {str(tmp_path / 'out')!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    built = _files(env["TORCH_EXTENSIONS_DIR"])
    if mode == "no_skip":  # the stubs are reached: DeepSpeed tries to build its op and fails
        assert proc.returncode != 0 and "build_shm_op" in proc.stderr, proc.stderr[-4000:]
        assert any("deepspeed_shm_comm" in f for f in built), built
        return
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert built == []


# ------------------------------------------------------------------ a rank killed mid-build
def _start_deepspeed(skip: bool) -> str:
    """On every pool rank: start DeepSpeed's comm over the pool's world (with or without the skip)."""
    import os

    import deepspeed.comm
    import torch.distributed as dist

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    if skip:
        from ring_sp.integrations.deepspeed import skip_cpu_inference_comm_build

        skip_cpu_inference_comm_build()
    deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
    return os.environ["TORCH_EXTENSIONS_DIR"]


def _group_members(pgids: set[int]) -> list[str]:
    """Live (not zombie) processes in any of the process groups ``pgids``."""
    members = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, ...
        if int(fields[2]) in pgids and fields[0] != "Z":
            members.append(stat)
    return members


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process groups from /proc")
def test_rank_killed_mid_deepspeed_start_leaves_nothing(tmp_path: Path) -> None:
    """The issue's hang, re-enacted: DeepSpeed builds its op (compiler hangs), one rank is killed.

    The peer waits on the build's lock file; the case fails, the pool kills every rank's
    process group (the orphaned compiler too) and deletes the launch's extensions dir with
    the lock in it. The next case on the same pool starts DeepSpeed, with the compiler still
    hanging, and returns.
    """
    # torch checks the compiler (c++ --version) once it holds the build's lock: that one hangs
    stubs = _stub_compilers(tmp_path / "bin", 'case "$*" in *--version*) exec sleep 600;; esac; exit 1')
    env = _fresh_env(tmp_path, stubs)
    pool = RankPool(2, env={k: env[k] for k in ("PATH", "DS_ACCELERATOR", "CXX")})
    calls = stubs / "calls"
    seen: dict[str, object] = {}

    def building() -> list[str]:
        return [line for line in (calls.read_text().splitlines() if calls.exists() else []) if "--version" in line]

    def kill_the_builder() -> None:  # driver side: once the build's compiler runs, kill the rank that started it
        deadline = time.monotonic() + 200
        while not building() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not building():
            return
        compiler = int(building()[0].split()[0])
        stat = Path(f"/proc/{compiler}/stat").read_text()
        builder_rank = int(stat[stat.rindex(")") + 2:].split()[2])  # its process group = its rank's pid
        seen.update(compiler=compiler, rank_pgids={p.pid for p in pool._procs},
                    locks=[f for f in _files(pool.extensions_dir) if f.endswith("lock")],
                    extensions_dir=pool.extensions_dir)
        os.kill(builder_rank, signal.SIGKILL)

    try:
        killer = threading.Thread(target=kill_the_builder, daemon=True)
        killer.start()
        with pytest.raises(DistributedCaseError) as failure:
            pool.run(_start_deepspeed, False, timeout=240)
        killer.join()
        assert "ProcessExited" in str(failure.value)
        assert seen["locks"], "the build held no lock when its rank was killed: the case re-enacts nothing"
        assert not os.path.exists(seen["extensions_dir"])  # lock and half-built objects are gone
        assert _group_members(seen["rank_pgids"]) == []  # no rank, no orphaned compiler
        assert any(f.endswith("lock") for f in pool.leftovers)  # what the kill found and deleted

        killed_launch = len(pool.leftovers)
        dirs = pool.run(_start_deepspeed, True, timeout=240)  # the next case: a fresh launch that runs
        assert len(set(dirs)) == 1 and dirs[0] != seen["extensions_dir"]
    finally:
        pool.close()
    assert pool.leftovers[killed_launch:] == []  # the fresh launch built nothing
