"""The wheels ``--wheels`` carries to the GPU machine: which fill a gap, which replace, which are left.

The machine reaches no network and has its own torch, which is never replaced (no torch wheel
travels). A wheel of the folder is installed (``pip install --no-index --no-deps --target``,
a temporary folder put first on ``sys.path`` and on ``PYTHONPATH`` for the kernel tests'
subprocess, so it shadows the machine's copy for this run only) when its distribution is

* missing here;
* installed at a version outside ring_sp's supported range (``integrations/versions.py``, the
  one table of ranges: the GPU image's transformers 5.17 is below 5.18), or
* installed at a version that a wheel installed for the run excludes by its ``Requires-Dist``
  (transformers 5.18 needs huggingface-hub >= 1.31, where 5.17 took >= 1.5).

Otherwise the machine's own copy runs. Requirements of the installed wheels that nothing meets
(neither the machine nor a carried wheel) are listed, so the card names them before a section
trips over them. A distribution to replace that this process has imported already cannot be
replaced (the old module would keep running): that stops the run with the names.
"""

from __future__ import annotations

import email.parser
import functools
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from ring_sp.integrations.versions import SUPPORTED, in_supported_range, requirement

Record = dict[str, Any]
Installed = Callable[[str], "str | None"]


def normalise(name: str) -> str:
    """A distribution's canonical name (PEP 503): ``Huggingface_Hub`` -> ``huggingface-hub``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str) -> str | None:
    """The version of ``name`` this interpreter imports, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Wheel:
    """One wheel file: its distribution (canonical name) and version from the file's name (PEP 427:
    ``name-version-...whl``); :meth:`requires` and :meth:`modules` read the file, only for the
    wheels that will be installed (a wheel left unused is never opened)."""

    path: Path
    distribution: str
    version: str

    @classmethod
    def of(cls, path: Path) -> Wheel:
        name, version = path.name.split("-")[:2]
        return cls(path, normalise(name), version)

    def requires(self) -> tuple[Requirement, ...]:
        """The ``Requires-Dist`` that hold on this machine (markers evaluated, no extras)."""
        return _contents(self.path)[0]

    def modules(self) -> tuple[str, ...]:
        """The top-level modules the wheel installs."""
        return _contents(self.path)[1]


@functools.cache
def _contents(path: Path) -> tuple[tuple[Requirement, ...], tuple[str, ...]]:
    with zipfile.ZipFile(path) as whl:
        files = whl.namelist()
        meta = next((f for f in files if f.endswith(".dist-info/METADATA")), None)
        text = whl.read(meta).decode() if meta else ""
    requires = []
    for line in email.parser.Parser().parsestr(text).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            requires.append(req)
    modules = sorted({f.split("/")[0].removesuffix(".py") for f in files
                      if not f.split("/")[0].endswith((".dist-info", ".data")) and (f.endswith(".py") or "/" in f)})
    return tuple(requires), tuple(modules)


@dataclass
class WheelPlan:
    """What :func:`plan_wheels` decided: ``install`` (distribution -> the wheel and why),
    ``kept`` (distribution -> the machine's version, its wheel left unused), ``unmet`` (sentences)."""

    install: dict[str, tuple[Wheel, str]]
    kept: dict[str, str]
    unmet: list[str]


def _meets(req: Requirement, version: str | None) -> bool:
    return version is not None and req.specifier.contains(version, prereleases=True)


def plan_wheels(wheels: list[Wheel], installed: Installed = installed_version,
                supported: Mapping[str, tuple[str, str]] = SUPPORTED) -> WheelPlan:
    """Which of ``wheels`` to install given ``installed`` (distribution -> version or None) and
    the supported ranges (module docstring); pure, so the rules are tested with fake versions."""
    carried = {w.distribution: w for w in wheels}
    install: dict[str, tuple[Wheel, str]] = {}
    for w in wheels:
        have = installed(w.distribution)
        if have is None:
            install[w.distribution] = (w, "missing here")
        elif w.distribution in supported and not in_supported_range(w.distribution, have, supported):
            install[w.distribution] = (w, f"{w.distribution} {have} is outside ring_sp's supported "
                                          f"{requirement(w.distribution, supported)}")
    changed = True
    while changed:  # a replaced wheel may need a newer copy of another distribution: to a fixed point
        changed = False
        for wheel, _ in list(install.values()):
            for req in wheel.requires():
                name = normalise(req.name)
                have = installed(name)
                other = carried.get(name)
                if name in install or _meets(req, have) or other is None or not _meets(req, other.version):
                    continue
                install[name] = (other, f"{name} {have or 'missing'} does not meet {wheel.distribution} "
                                        f"{wheel.version}'s requirement {req}")
                changed = True
    runs = {name: w.version for name, (w, _) in install.items()}
    unmet = []
    for wheel, _ in install.values():
        for req in wheel.requires():
            name = normalise(req.name)
            version = runs.get(name) or installed(name)
            if not _meets(req, version):
                unmet.append(f"{wheel.distribution} {wheel.version} needs {req}; here {version or 'none'} "
                             f"(no wheel of the folder meets it)")
    kept = {w.distribution: installed(w.distribution) for w in wheels if w.distribution not in install}
    return WheelPlan(install, {k: v for k, v in kept.items() if v is not None}, unmet)


def install_wheels(folder: Path, installed: Installed = installed_version,
                   supported: Mapping[str, tuple[str, str]] = SUPPORTED) -> Record:
    """Install the wheels of ``folder`` that :func:`plan_wheels` picks; SystemExit naming the
    problem if the folder is empty, a distribution to replace is already imported, or pip
    fails (before any section has run). Returns the card's ``wheels`` record."""
    wheels = [Wheel.of(p) for p in sorted(folder.glob("*.whl"))]
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no .whl files there (docs/benchmarks.md says how to make them)")
    plan = plan_wheels(wheels, installed, supported)
    replaced = {name: {"installed": installed(name), "carried": w.version, "why": why}
                for name, (w, why) in plan.install.items() if installed(name) is not None}
    loaded = [m for name in replaced for m in plan.install[name][0].modules() if m in sys.modules]
    if loaded:
        raise SystemExit(f"--wheels {folder}: {sorted(replaced)} must replace the installed copies, but this process "
                         f"has imported {loaded} already; run gpu_check in a fresh interpreter")
    target = Path(tempfile.mkdtemp(prefix="gpu_check_site_"))
    todo = [w.path for w, _ in plan.install.values()]
    if todo:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--target", str(target), *map(str, todo)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"--wheels {folder}: pip could not install {[p.name for p in todo]}:\n"
                             f"{done.stdout}{done.stderr}")
        sys.path.insert(0, str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
        importlib.invalidate_caches()
    return {"folder": str(folder), "installed": sorted(p.name for p in todo), "target": str(target),
            "replaced": replaced, "already_present": plan.kept, "unmet": plan.unmet}


__all__ = ["Wheel", "WheelPlan", "install_wheels", "installed_version", "normalise", "plan_wheels"]
