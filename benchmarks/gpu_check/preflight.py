"""Before any measurement: the wheels ``--wheels`` brings, what is missing, and the card.

The GPU machine reaches no network and has its own torch (never replaced here). Packages it
lacks travel as wheels in a folder of the working tree: :func:`install_wheels` installs
those whose distribution is not already installed (``pip install --no-index --no-deps
--target``, a temporary folder put first on ``sys.path`` and on ``PYTHONPATH`` for the
kernel tests' subprocess), so a wheel can never shadow the machine's torch or numpy.
:func:`missing` names, before anything runs, what each section will have to skip.
:func:`card` describes the machine and the run.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ring_sp.integrations.versions import require_supported
from ring_sp.kernels import get_kernel, unavailable_reason

from .seam import Seam

Record = dict[str, Any]


def _distribution(wheel: Path) -> str:
    """The distribution a wheel file installs (PEP 427 names: ``name-version-...whl``)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_wheels(folder: Path) -> Record:
    """Install the wheels of ``folder`` whose distribution is missing here; SystemExit naming
    the problem if the folder is empty or pip fails (before any section has run)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no .whl files there (docs/benchmarks.md says how to make them)")
    present = {w.name: _installed(_distribution(w)) for w in wheels}
    todo = [w for w in wheels if present[w.name] is None]
    target = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))
    if todo:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--target", str(target), *map(str, todo)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"--wheels {folder}: pip could not install {[w.name for w in todo]}:\n"
                             f"{done.stdout}{done.stderr}")
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
        importlib.invalidate_caches()
    return {"folder": str(folder), "installed": [w.name for w in todo], "target": str(target),
            "already_present": {name: version for name, version in present.items() if version is not None}}


def _import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported (its error, naming what is missing), or None."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  (any failure to import is reported, never raised)
        return f"{type(exc).__name__}: {exc}"
    return None


def missing(sections: list[str]) -> dict[str, str]:
    """What will be skipped and why, per row, found before any section runs."""
    found = {}
    if "kernel_tests" in sections and importlib.util.find_spec("pytest") is None:
        found["kernel_tests"] = "pytest is not installed"
    if "memory" in sections:
        reason = _import_error("deepspeed.runtime.sequence_parallel.ulysses_sp")
        if reason:
            found["memory_longest ALST"] = f"DeepSpeed's ALST modules: {reason}"
    if "step" in sections:
        found.update(step_missing())
    return found


def step_missing() -> dict[str, str]:
    """What the ``step`` section cannot run: every mode without a supported transformers
    (``ring_sp.integrations.versions``), ``ALST`` without DeepSpeed's modules."""
    found = {}
    try:
        require_supported("transformers", "the step section (ring_sp.integrations.transformers)")
    except (RuntimeError, importlib.metadata.PackageNotFoundError) as exc:
        found["step"] = f"{type(exc).__name__}: {exc}"
    reason = _import_error("deepspeed.runtime.sequence_parallel.ulysses_sp")
    if reason:
        found["step ALST"] = f"DeepSpeed's ALST modules: {reason}"
    return found


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parents[2],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def card(seam: Seam, command: str, mode: str, caps: dict[str, float], wheels: Record | None,
         skips: dict[str, str]) -> Record:
    """The machine and the run: device, memory, versions, the command, the caps, what was missing."""
    dev = seam.device
    record: Record = {
        "section": "card", "command": command, "mode": mode, "started": datetime.datetime.now().isoformat(" ", "seconds"),
        "device": torch.cuda.get_device_name(dev) if seam.is_cuda else f"CPU ({platform.machine()}, dry run)",
        "memory_bytes": seam.capacity() if seam.is_cuda else None, "dtype": str(seam.dtype).removeprefix("torch."),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if seam.is_cuda else None,
        "capability": list(torch.cuda.get_device_capability(dev)) if seam.is_cuda else None,
        "python": platform.python_version(), "commit": _commit(),
        "kernel": get_kernel("auto", dev, seam.dtype, 128).name,
        "flash_attn": unavailable_reason("flash_attn", dev, seam.dtype, 128) or "available",
        "deepspeed": _installed("deepspeed"), "pytest": _installed("pytest"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "caps_s": caps, "wheels": wheels, "missing": skips,
    }
    return record


def card_markdown(card: Record, elapsed: dict[str, Any]) -> list[str]:
    memory = f", {card['memory_bytes'] / 2**30:.1f} GiB" if card.get("memory_bytes") else ""
    cap = f", sm{''.join(map(str, card['capability']))}" if card.get("capability") else ""
    lines = [f"* Run {card['started']}, `{card['command']}` ({card['mode']}), commit {card['commit'] or 'unknown'}.",
             f"* Device: {card['device']}{memory}{cap}; torch {card['torch']}, CUDA {card['cuda']}, "
             f"cuDNN {card['cudnn']}, Python {card['python']}; {card['dtype']}; attention kernel `{card['kernel']}` "
             f"(flash-attn: {card['flash_attn']}); DeepSpeed {card['deepspeed'] or 'not installed'}; "
             f"`PYTORCH_CUDA_ALLOC_CONF={card['alloc_conf']}`."]
    if card.get("wheels"):
        w = card["wheels"]
        lines.append(f"* Wheels from `{w['folder']}`: installed {', '.join(w['installed']) or 'none'}; "
                     f"already present {', '.join(w['already_present']) or 'none'}.")
    for row, reason in card.get("missing", {}).items():
        lines.append(f"* Skipped: {row}: {reason}.")
    for name, t in elapsed.items():
        lines.append(f"* Section `{name}`: {t['elapsed_s']:.0f} s of its {t['cap_s']:.0f} s cap ({t['status']}); "
                     f"rerun alone: `{t['command']}`.")
    return lines
