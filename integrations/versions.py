"""The framework versions each integration supports: one table for setup.py's extras and the runtime checks.

Each range is ``[lowest, below)``: ``lowest`` is the oldest release the integration's tests
passed on, ``below`` the first release after the newest one they passed on (tested ends in
README.md, "Supported versions"). The integrations call :func:`require_supported` where
they first lean on a framework's internals, so a version outside the range raises a clear
error instead of computing a wrong result. Imports nothing but the standard library
(setup.py reads this file before anything is installed).
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping
from importlib import metadata

# distribution name -> (lowest supported, first unsupported)
SUPPORTED: dict[str, tuple[str, str]] = {
    "transformers": ("5.18.0", "5.25"),
    "accelerate": ("1.15.0", "1.16"),
    "deepspeed": ("0.19.8", "0.20"),
    "megatron-core": ("0.16.1", "0.17"),
    "trl": ("1.16.0", "1.17"),  # SequenceParallelSFTTrainer (TRL's SFTTrainer and its fused LM head)
    "peft": ("0.21.2", "0.22"),  # LoRA under SequenceParallelSFTTrainer (optional)
}


def requirement(distribution: str, ranges: Mapping[str, tuple[str, str]] = SUPPORTED) -> str:
    """The pip requirement for ``distribution``'s supported range, e.g. ``"transformers>=5.18.0,<5.25"``
    (``ranges``: another table of the same form, for tests)."""
    lowest, below = ranges[distribution]
    return f"{distribution}>={lowest},<{below}"


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (``"5.25.0.dev0"`` -> ``(5, 25, 0)``), padded to 3 parts."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"cannot read the version {version!r}")
    parts = tuple(int(p) for p in match.group(0).split("."))
    return parts + (0,) * (3 - len(parts))


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (``importlib.metadata``)."""
    return metadata.version(distribution)


def in_supported_range(distribution: str, version: str, ranges: Mapping[str, tuple[str, str]] = SUPPORTED) -> bool:
    """Whether ``version`` of ``distribution`` lies in its supported range (:data:`SUPPORTED`, or ``ranges``)."""
    lowest, below = ranges[distribution]
    return _release(lowest) <= _release(version) < _release(below)


def require_supported(distribution: str, feature: str) -> None:
    """Raise unless the installed ``distribution`` lies in its supported range.

    ``feature`` names what needs it (for the message), e.g. ``"ring_sp.integrations.transformers.register"``.
    A pre-release or dev build of ``below`` (``5.25.0.dev0``) counts as ``below``: outside.
    """
    version = installed_version(distribution)
    if not in_supported_range(distribution, version):
        raise RuntimeError(
            f"{feature} supports {requirement(distribution)} (the versions its tests pass on), but "
            f"{distribution} {version} is installed; install a supported one: pip install '{requirement(distribution)}'"
        )


def main(distributions: list[str]) -> str:
    """``python integrations/versions.py DIST ...``: the requirements of ``DIST ...``, shell-quoted, one line.

    The Makefile's newest-end environment (``make test-newest``) installs them: pip then takes
    the newest release inside each supported range.
    """
    unknown = [d for d in distributions if d not in SUPPORTED]
    if unknown or not distributions:
        raise SystemExit(f"usage: versions.py DISTRIBUTION ...; unknown {unknown}, known: {sorted(SUPPORTED)}")
    return " ".join(shlex.quote(requirement(d)) for d in distributions)


if __name__ == "__main__":  # not when setup.py exec()s this file
    print(main(sys.argv[1:]))


__all__ = ["SUPPORTED", "in_supported_range", "installed_version", "main", "require_supported", "requirement"]
