"""A persistent pool of gloo ranks that runs many test cases per launch.

Spawning and initialising ranks costs seconds on this machine, so each world size keeps
one pool of worker processes alive and sends it cases (a picklable module-level function
plus arguments). Every case runs on every rank; the driver collects one result per rank
within a timeout. After any failure or timeout the pool is killed (each rank leads its
own process group, so children die too) and the next case gets a fresh one.

Nothing a killed launch leaves can block the next: each launch gets its own empty
``TORCH_EXTENSIONS_DIR`` (a C++ build's lock file and half-built objects live there) and
its own FileStore file, and both are deleted when the launch ends, whatever its end. What
the extensions directory held at that moment is kept in :attr:`RankPool.leftovers` (a
launch that ends cleanly should have built nothing).
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

_STARTUP_TIMEOUT_S = 120.0
_GRACE_AFTER_FAILURE_S = 5.0  # peers of a failed rank may be blocked in a collective


@dataclass
class RankError:
    rank: int
    kind: str
    message: str
    traceback: str


class DistributedCaseError(AssertionError):
    """A case failed or timed out on at least one rank; carries each rank's report."""

    def __init__(self, summary: str, errors: list[RankError], results: list[Any]) -> None:
        details = "\n".join(f"--- rank {e.rank}: {e.kind}: {e.message}\n{e.traceback}" for e in errors)
        super().__init__(f"{summary}\n{details}")
        self.errors = errors
        self.results = results  # what the ranks that did answer returned (None for the others)


# Ranks fork from a server that imported these once (copy-on-write), instead of each rank of
# each launch importing them again: seconds per rank, and pools restart whenever the world
# size changes. sympy (via symbolic_shapes): a rank's first backward imports it lazily, and a
# fresh pool under the suite's load was seen outliving a case's timeout there. The frameworks
# are preloaded where installed (none of them starts a thread at import); DeepSpeed reads
# DS_ACCELERATOR at import, which conftest.py sets to "cpu" for the session.
FORKSERVER_PRELOAD = ["torch", "torch.fx.experimental.symbolic_shapes"] + [
    module for module in ("deepspeed", "megatron.core", "transformers.models.llama.modeling_llama",
                          "transformers.trainer")
    if importlib.util.find_spec(module.split(".")[0]) is not None
]


def live_groups() -> set:
    """The process groups this process holds besides the default one (gloo: three threads each)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return set()
    return {pg for pg in distributed_c10d._world.pg_map if pg is not dist.group.WORLD}  # noqa: SLF001


def release_groups(keep: set) -> None:
    """Destroy every process group but the default one and ``keep`` (what a case or test made and
    dropped: torch keeps each alive, with its threads, until destroyed)."""
    import torch.distributed as dist

    dropped = live_groups() - keep
    for pg in dropped:
        dist.destroy_process_group(pg)
    if dropped:  # a group's threads end with its last reference: models in reference cycles hold some
        gc.collect()


# Modules whose globals keep process groups for later calls (the next case may reuse them): the
# frameworks', and the benchmarks' rank blocks (python -m benchmarks runs its cases on these pools)
GROUP_CACHES = ("deepspeed.utils.groups", "deepspeed.comm.comm", "megatron.core.parallel_state", "benchmarks.launch")
# (module, global) of the topology caches later cases reuse: the tests' and the benchmarks'
TOPOLOGY_CACHES = (("dist_cases", "_TOPOLOGIES"), ("benchmarks.modes", "_topologies"))


def _cached_groups() -> set:
    """The groups later cases may reuse: the topologies ``dist_cases.topology`` and the benchmarks
    keep, and those kept in module globals (DeepSpeed's ZeRO groups, Megatron's parallel state)."""
    import torch.distributed as dist

    topologies = [topo for module, name in TOPOLOGY_CACHES
                  for topo in getattr(sys.modules.get(module), name, {}).values()]
    kept = {getattr(topo, f"{kind}_group") for topo in topologies for kind in ("sp", "ulysses", "ring", "dp", "dp_sp")}
    for name in GROUP_CACHES:
        for value in vars(sys.modules[name]).values() if name in sys.modules else ():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            kept.update(item for item in items if isinstance(item, dist.ProcessGroup))
    return kept


def _worker_main(rank: int, world_size: int, init_file: str, conn: Connection, sys_path: list[str], pg_timeout_s: float, env: dict[str, str]) -> None:
    os.setsid()  # own process group: the driver kills the whole tree with killpg
    sys.path[:] = sys_path
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # many ranks share 2 cores; oversubscription only slows
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    conn.send("ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            break
        try:
            fn, args, kwargs = message
            held = live_groups()
            result = fn(*args, **kwargs)
            # a case's own groups go with it (each gloo group keeps three threads): left to pile up (DeepSpeed
            # cases build a topology each) they reached 70 groups per rank, thousands of threads, a load average
            # of 300 and a 3-rank gradcheck at 12x its time alone (docs/testing.md)
            release_groups(held | _cached_groups())
            conn.send(("ok", result))
        except BaseException as exc:  # report everything, including assertion failures
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))
    dist.destroy_process_group()


STARTS: list = []  # (world size, seconds to start) of every launch, for the suite's profile


class RankPool:
    """``world_size`` gloo ranks kept alive between cases."""

    def __init__(self, world_size: int, pg_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.env = dict(env or {})
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._init_file = ""
        self.extensions_dir = ""  # this launch's TORCH_EXTENSIONS_DIR ("" when not running)
        self.leftovers: list[str] = []  # files found in an extensions dir when its launch ended

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        began = time.monotonic()
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        fd, self._init_file = tempfile.mkstemp(prefix="ring_sp_pg_")
        os.close(fd)
        os.unlink(self._init_file)  # the FileStore creates it; a stale file would confuse it
        self.extensions_dir = tempfile.mkdtemp(prefix="ring_sp_ext_")
        env = {**self.env, "TORCH_EXTENSIONS_DIR": self.extensions_dir}
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, self._init_file, child, list(sys.path), self.pg_timeout_s, env),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())) or conn.recv() != "ready":
                self.kill()
                raise RuntimeError(f"rank {rank} of a {self.world_size}-rank pool did not start")
        STARTS.append((self.world_size, round(time.monotonic() - began, 3)))

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results.

        Raises :class:`DistributedCaseError` if any rank raises or the case outlives
        ``timeout`` seconds; the pool is then killed and restarted on the next call.
        """
        if not self.alive:
            self.kill()
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        errors: list[RankError] = []
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll(0.01):
                    try:
                        reply = conn.recv()
                    except EOFError:
                        reply = ("error", "ProcessExited", f"exit code {self._procs[rank].exitcode}", "")
                    pending.discard(rank)
                    if reply[0] == "ok":
                        results[rank] = reply[1]
                    else:
                        errors.append(RankError(rank, *reply[1:]))
                        deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
                elif not self._procs[rank].is_alive() and not conn.poll(0):
                    pending.discard(rank)
                    errors.append(RankError(rank, "ProcessExited", f"exit code {self._procs[rank].exitcode}", ""))
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
        if pending or errors:
            why = "no reply within 5 s after another rank failed" if errors else f"no reply within the case timeout ({timeout:.0f} s)"
            for rank in sorted(pending):
                errors.append(RankError(rank, "Timeout", why, ""))
            self.kill()
            errors.sort(key=lambda e: e.rank)
            name = getattr(fn, "__qualname__", repr(fn))
            raise DistributedCaseError(f"{name} failed on ranks {[e.rank for e in errors]} of {self.world_size}", errors, results)
        return results

    def kill(self) -> None:
        """End this launch: SIGKILL every rank's process group, then delete what it left on disk."""
        for proc in self._procs:
            if proc.pid is None:
                continue
            # also when the rank itself is gone: its children (a compiler, ...) keep its group. A
            # reaped rank's pid is not reused while that group has members, so a live /proc/<pid>
            # then means the group is empty and the pid belongs to someone else: leave it alone. A
            # zombie there is the rank itself, not yet reaped by the forkserver: its group goes too.
            if not proc.is_alive() and _running(proc.pid):
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self.extensions_dir:
            for root, dirs, files in os.walk(self.extensions_dir):
                self.leftovers += [os.path.join(root, f) for f in dirs + files]
            shutil.rmtree(self.extensions_dir, ignore_errors=True)
            self.extensions_dir = ""
        if self._init_file:
            try:
                os.unlink(self._init_file)
            except FileNotFoundError:
                pass
            self._init_file = ""

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
        self.kill()


def _running(pid: int) -> bool:
    """Whether a process that is not a zombie has ``pid`` (from /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


class PoolManager:
    """At most ``max_alive`` pools at once (each rank holds torch: ~0.3 GB)."""

    def __init__(self, max_alive: int = 2) -> None:
        self.max_alive = max_alive
        self._pools: OrderedDict[tuple, RankPool] = OrderedDict()
        self.leftovers: list[str] = []  # of every pool closed so far (see RankPool.leftovers)

    def get(self, world_size: int, pg_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> RankPool:
        key = (world_size, pg_timeout_s, tuple(sorted((env or {}).items())))
        if key in self._pools:
            self._pools.move_to_end(key)
            return self._pools[key]
        while len(self._pools) >= self.max_alive:
            _, oldest = self._pools.popitem(last=False)
            oldest.close()
            self.leftovers += oldest.leftovers
        pool = RankPool(world_size, pg_timeout_s, env)
        self._pools[key] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
            self.leftovers += pool.leftovers
        self._pools.clear()
