"""Example scripts imported as modules by the tests that reuse their set-up (model, loss,
engine): one import per process, under a name that cannot clash with another example's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(module_name: str, path: Path) -> ModuleType:
    """``path`` imported as ``module_name`` (once; later calls return the same module)."""
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]
