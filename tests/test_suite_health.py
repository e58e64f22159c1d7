"""Issue 47: the suite's end-of-session guard (suite_health.py) fails a run that leaks a rank
pool or threads, naming the file, and passes a clean one. Each run is a small pytest session
of its own in a subprocess (the guard judges a whole session)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import harness
from suite_health import SuiteHealth

harness.FORKSERVER_PRELOAD = ["torch"]  # the pool's ranks need nothing else here


def pytest_configure(config):
    config.pluginmanager.register(SuiteHealth(), "ring_sp_suite_health")
"""

FILES = {
    "test_clean.py": """
        from harness import RankPool

        def test_a_pool_closed_and_a_thread_joined():
            import threading
            pool = RankPool(1)
            assert pool.run(int, "7") == [7]
            pool.close()
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()
    """,
    "test_leaks_a_pool.py": """
        from harness import RankPool

        POOL = RankPool(2)

        def test_pool_left_running():
            assert POOL.run(int, "3") == [3, 3]
    """,
    "test_leaks_threads.py": """
        import threading

        STOP = threading.Event()

        def test_threads_left_waiting():
            for _ in range(60):
                threading.Thread(target=STOP.wait, daemon=True).start()
    """,
}


def _session(tmp_path: Path, *files: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name in files:
        (tmp_path / name).write_text(textwrap.dedent(FILES[name]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *files],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_the_guard_fails_leaked_pools_and_threads_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "clean").mkdir()
    clean = _session(tmp_path / "clean", "test_clean.py")
    assert clean.returncode == 0 and "suite health" not in clean.stdout, clean.stdout + clean.stderr
    leaky = tmp_path / "leaky"
    leaky.mkdir()
    done = _session(leaky, "test_clean.py", "test_leaks_a_pool.py", "test_leaks_threads.py")
    report = done.stdout
    assert done.returncode != 0 and "suite health: FAILED" in report, report + done.stderr
    assert "threads added by test_leaks_threads.py (+60)" in report, report
    ranks = [line for line in report.splitlines() if "is alive after the session" in line]
    assert len(ranks) == 2 and all("first alive after a test of test_leaks_a_pool.py" in line for line in ranks), report
    assert "3 passed" in report  # the tests themselves pass: the session fails for what they left


def benchmark_topology_call() -> int:
    """A benchmarks' mode on the topology ``benchmarks.modes`` caches: its groups must outlive the case."""
    import torch
    import torch.distributed as dist

    import ring_sp
    from benchmarks.modes import topology

    topo = topology(dist.group.WORLD, 1, 2)
    q = torch.randn(1, 4, 2, 8)
    return ring_sp.hybrid_attention(q, q, q, topology=topo, causal=True).shape[1]


def test_the_pools_keep_the_groups_of_the_benchmarks_topologies(pools) -> None:
    """``python -m benchmarks`` runs its cases on these pools and reuses the topologies it cached in
    earlier cases: the pools' ranks destroy a case's groups after it, except those (it once did not,
    and the second case failed on a destroyed group)."""
    pool = pools.get(2)
    assert pool.run(benchmark_topology_call) == [4, 4]
    assert pool.run(benchmark_topology_call) == [4, 4]
