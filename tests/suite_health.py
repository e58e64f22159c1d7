"""The suite's own health (issue 47): what each test costs and what it leaves behind.

A pytest plugin (``conftest.py`` loads it). After every test it notes the test's wall and
CPU time (the pytest process, its reaped children and every live descendant) and how many
threads the pytest process holds and which child processes are alive. At the end of the
session (its pools closed by then; multiprocessing's fork server and resource tracker then
stopped) it FAILS the run when the pytest process ends with more than :data:`MAX_THREADS`
threads or with a process of its own alive (a child, or a pool's rank below the fork
server), naming the test files whose tests left them: a
leaked rank pool, process group or thread costs every later test (4 ranks on 2 cores
once ran behind 494 threads of finished groups, at 0.5 cores for 20 minutes).

``RING_SP_SUITE_PROFILE=path.json`` also writes the per-test records (``nodeid``, ``wall_s``,
``cpu_s``, ``threads``, ``children``) and the rank pools' launches there (``path.json.gw0``,
``.gw1`` under pytest-xdist: one per worker, each checked on its own), for the table of
``docs/testing.md``.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import time
from collections import OrderedDict

import psutil
import pytest

MAX_THREADS = 50
PROFILE_ENV = "RING_SP_SUITE_PROFILE"


def _cpu_seconds(process: psutil.Process) -> float:
    """CPU time of ``process``, its reaped children and every live descendant (and theirs)."""
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _descendants(process: psutil.Process) -> dict[int, str]:
    """Live processes below ``process`` (a pool's ranks are the fork server's children, in
    sessions of their own): pid -> a short description, multiprocessing's helpers left out."""
    helpers = {pid for pid in (getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),  # noqa: SLF001
                               getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None))  # noqa: SLF001
               if pid}
    found = {}
    for child in process.children(recursive=True):
        try:
            if child.pid not in helpers:
                found[child.pid] = " ".join(child.cmdline())[:120]
        except psutil.Error:
            continue
    return found


def stop_multiprocessing_helpers() -> None:
    """Stop the fork server and resource tracker this process started (they would outlive the suite)."""
    multiprocessing.forkserver._forkserver._stop()  # noqa: SLF001  (no public way; both restart on demand)
    multiprocessing.resource_tracker._resource_tracker._stop()  # noqa: SLF001


class SuiteHealth:
    """Per-test records and the end-of-session check (module docstring)."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.records: list[dict] = []
        self.by_file: OrderedDict[str, dict] = OrderedDict()  # file -> threads added, children first seen
        self.seen_children: dict[int, str] = {}  # pid -> the file after whose test it was first alive
        self.failure: str | None = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        wall, cpu, threads = time.perf_counter(), _cpu_seconds(self.process), self.process.num_threads()
        yield
        children = _descendants(self.process)
        record = {"nodeid": item.nodeid, "wall_s": round(time.perf_counter() - wall, 3),
                  "cpu_s": round(_cpu_seconds(self.process) - cpu, 3), "threads": self.process.num_threads(),
                  "children": len(children)}
        self.records.append(record)
        path = item.nodeid.split("::")[0]
        entry = self.by_file.setdefault(path, {"threads_added": 0})
        entry["threads_added"] += record["threads"] - threads
        for pid in children:
            self.seen_children.setdefault(pid, path)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if os.environ.get(PROFILE_ENV):
            import harness

            worker = os.environ.get("PYTEST_XDIST_WORKER")  # one file per pytest-xdist worker
            with open(os.environ[PROFILE_ENV] + (f".{worker}" if worker else ""), "w") as f:
                json.dump({"tests": self.records, "pool_starts": harness.STARTS}, f, indent=1)
        if not self.records:
            return
        left = _descendants(self.process)  # a leaked pool's ranks (the fork server waits for them)
        for pid in left:  # noted, then ended: a failed run leaves no orphans either
            try:
                psutil.Process(pid).kill()
                psutil.Process(pid).wait(10)
            except psutil.Error:
                pass
        stop_multiprocessing_helpers()
        left.update(_descendants(self.process))
        self.failure = self.check(self.process.num_threads(), left)
        if self.failure:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def check(self, threads: int, children: dict[int, str]) -> str | None:
        """The end-of-session verdict: None, or what was left and by which test files."""
        problems = []
        if threads > MAX_THREADS:
            growth = sorted(((v["threads_added"], f) for f, v in self.by_file.items() if v["threads_added"] > 0),
                            reverse=True)[:5]
            problems.append(f"the pytest process ends with {threads} threads (at most {MAX_THREADS}); threads added by "
                            + ", ".join(f"{path} (+{added})" for added, path in growth))
        for pid, command in children.items():
            problems.append(f"process {pid} is alive after the session ({command}); first alive after a test of "
                            f"{self.seen_children.get(pid, 'no test (started at session end)')}")
        return "\n".join(problems) or None

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.failure:
            terminalreporter.section("suite health: FAILED", red=True)
            terminalreporter.write_line(self.failure)
