"""Before any measurement: the wheels ``--wheels`` brings, what is missing, and the card.

The GPU machine reaches no network and has its own torch (never replaced here). Packages it
lacks, or has at a version ring_sp does not support, travel as wheels in a folder of the
working tree: :func:`.wheels.install_wheels` installs those it needs for this run (see
:mod:`.wheels`). :func:`missing` names, before anything runs, what each section will have to
skip. :func:`card` describes the machine and the run, the wheels that replaced the machine's
copies included.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from ring_sp.integrations.versions import in_supported_range, requirement
from ring_sp.kernels import get_kernel, unavailable_reason

from .seam import Seam
from .wheels import install_wheels, installed_version

Record = dict[str, Any]


def _import_error(module: str) -> str | None:
    """Why ``module`` cannot be imported (its error, naming what is missing), or None."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  (any failure to import is reported, never raised)
        return f"{type(exc).__name__}: {exc}"
    return None


def transformers_unsupported() -> str | None:
    """Why ring_sp's transformers integration cannot run here (no transformers, or one outside
    its supported range: ``integrations/versions.py``), or None; the ``memory`` and ``step``
    sections train transformers' Llama through it."""
    version = installed_version("transformers")
    if version is not None and in_supported_range("transformers", version):
        return None
    return (f"transformers {version or 'is not installed'}: ring_sp's register needs {requirement('transformers')}; "
            "bring its wheel with --wheels (docs/benchmarks.md)")


def missing(sections: list[str]) -> dict[str, str]:
    """What will be skipped and why, per row, found before any section runs."""
    found = {}
    if "kernel_tests" in sections and importlib.util.find_spec("pytest") is None:
        found["kernel_tests"] = "pytest is not installed"
    models = [name for name in ("memory", "step") if name in sections]  # both train transformers' Llama
    unsupported = transformers_unsupported() if models else None
    alst = _import_error("deepspeed.runtime.sequence_parallel.ulysses_sp") if models else None
    for name in models:
        if unsupported:
            found[name] = unsupported
        if alst:
            found[f"{name} ALST"] = f"DeepSpeed's ALST modules: {alst}"
    if "memory" in sections and importlib.util.find_spec("liger_kernel") is None:
        found["memory ALST's Liger kernels"] = ("liger-kernel is not installed: on a GPU, ALST runs with "
                                                "transformers' norms and RoPE and DeepSpeed's tiled loss instead")
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
        "deepspeed": installed_version("deepspeed"), "pytest": installed_version("pytest"),
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
        for name, r in w.get("replaced", {}).items():
            lines.append(f"* Replaced for this run: {name} {r['installed']} by the carried {r['carried']} ({r['why']}).")
        for sentence in w.get("unmet", []):
            lines.append(f"* Unmet requirement: {sentence}.")
    for row, reason in card.get("missing", {}).items():
        lines.append(f"* Skipped: {row}: {reason}.")
    for name, t in elapsed.items():
        lines.append(f"* Section `{name}`: {t['elapsed_s']:.0f} s of its {t['cap_s']:.0f} s cap ({t['status']}); "
                     f"rerun alone: `{t['command']}`.")
    return lines


__all__ = ["card", "card_markdown", "install_wheels", "missing", "transformers_unsupported"]
