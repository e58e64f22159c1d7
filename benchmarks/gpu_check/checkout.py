"""ring_sp from this checkout, uninstalled (the GPU machine installs nothing).

setup.py installs the top-level ``integrations/`` folder as ``ring_sp.integrations``
(``package_dir``); run from a checkout where ring_sp is not installed, ``ring_sp`` itself
imports (the working directory is on the path) but ``ring_sp.integrations`` does not exist.
:func:`integrations_from_checkout` maps the folder there the same way; ``python -m
benchmarks.gpu_check`` calls it before it imports any section.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import ring_sp

FOLDER = Path(__file__).resolve().parents[2] / "integrations"


def integrations_from_checkout() -> bool:
    """Make ``ring_sp.integrations`` importable (``integrations/`` of this checkout) if it is
    not; True if it had to."""
    if importlib.util.find_spec("ring_sp.integrations") is not None:
        return False
    spec = importlib.util.spec_from_file_location("ring_sp.integrations", FOLDER / "__init__.py",
                                                  submodule_search_locations=[str(FOLDER)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ring_sp.integrations"] = module
    spec.loader.exec_module(module)
    ring_sp.integrations = module  # type: ignore[attr-defined]
    return True
