"""The example scripts, as the tests use them: imported as modules (to reuse their model,
loss and engine set-up) or run through their launchers as a user would."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def load_script(module_name: str, path: Path) -> ModuleType:
    """``path`` imported as ``module_name`` (once; later calls return the same module)."""
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launcher(script: Path, *args: str, ranks: int | None = None, timeout: float) -> list[dict[str, Any]]:
    """``script --cpu *args`` on a free port with this interpreter (``ranks``: NUM_RANKS, None =
    the launcher's default); asserts it succeeds and returns its stdout's JSON lines."""
    env = {**os.environ, "MASTER_PORT": str(_free_port()), "PYTHON": sys.executable}
    if ranks is not None:
        env["NUM_RANKS"] = str(ranks)
    proc = subprocess.run([str(script), "--cpu", *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]  # stdout carries only JSON lines
