"""Moved to :mod:`ring_sp.plan.step_memory`; this name stays for code that imported ``ring_sp.step_memory``."""

from .plan.step_memory import *  # noqa: F403
from .plan.step_memory import __all__  # noqa: F401
