"""Section ``kernel_tests``: ``tests/test_kernels_cuda.py`` on the card, with pytest's summary line.

pytest runs in a subprocess (its own CUDA context, so a crash there cannot take the other
sections with it) under the section's time cap. ``--quick`` runs the bf16 cases only (a
third of the file); the dry mode the few that run anywhere (the aten plumbing on the meta
device), which exercises this code path in CI. pytest missing is a skipped row naming it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .seam import Deadline, Seam

Record = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = "tests/test_kernels_cuda.py"
SELECTIONS = {"full": [], "quick": ["-k", "bfloat16"], "dry": ["-k", "plumbing_on_meta"]}
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def command(selection: str) -> list[str]:
    # pytest.ini's addopts replaced: one process on the card (its -n 2 needs pytest-xdist, which a GPU
    # image may lack, and two workers would share the one GPU), the default suite's selection kept
    return [sys.executable, "-m", "pytest", TEST_FILE, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "not slow",
            *SELECTIONS[selection]]


def summary(output: str) -> tuple[str, dict[str, int]]:
    """pytest's last summary line and its counts (``{"passed": 381, "failed": 4, ...}``)."""
    lines = [line.strip("= ") for line in output.splitlines() if COUNTS.search(line) and " in " in line]
    if not lines:
        return "", {}
    line = lines[-1]
    counts: dict[str, int] = {}
    for number, kind in COUNTS.findall(line):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    return line, counts


def kernel_tests(seam: Seam, selection: str, deadline: Deadline, log: Callable[[str], None],
                 log_file: Path | None = None) -> list[Record]:
    record: Record = {"section": "kernel_tests", "file": TEST_FILE, "selection": selection,
                      "pytest_args": command(selection)[3:]}
    if importlib.util.find_spec("pytest") is None:
        return [{**record, "skipped": "pytest is not installed: bring its wheel with --wheels (docs/benchmarks.md)"}]
    log(f"kernel tests: {' '.join(command(selection)[1:])} (cap {deadline.left():.0f} s)")
    # the repository (ring_sp need not be installed) and any wheels --wheels installed (already there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    try:
        done = subprocess.run(command(selection), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(1.0, deadline.left()))
        output, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        returncode = None
    if log_file is not None:
        log_file.write_text(output)
    line, counts = summary(output)
    record.update(seconds=time.monotonic() - started, returncode=returncode, summary=line, counts=counts)
    if returncode is None:
        record["error"] = f"timed out after {record['seconds']:.0f} s (the section's cap)"
    elif not counts:
        record["error"] = "no pytest summary line: " + " | ".join(output.strip().splitlines()[-3:])[:400]
    failed = re.findall(r"^FAILED (\S+)", output, flags=re.MULTILINE)
    if failed:
        record["failed_tests"] = failed[:50]
    return [record]


def markdown(records: list[Record]) -> list[str]:
    rows = [r for r in records if r["section"] == "kernel_tests" and "selection" in r]  # not a section's crash
    out = []
    for r in rows:
        what = "`" + " ".join(["python -m pytest", TEST_FILE, *SELECTIONS[r["selection"]]]) + "`"
        if "skipped" in r:
            out.append(f"{what}: skipped: {r['skipped']}")
            continue
        result = r["summary"] or r.get("error", "")
        out.append(f"{what}: **{result}** ({r['seconds']:.0f} s)" + (f"; {r['error']}" if "error" in r else ""))
        out += [f"* FAILED {name}" for name in r.get("failed_tests", [])]
    return out
