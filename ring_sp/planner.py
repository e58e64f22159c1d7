"""Moved to :mod:`ring_sp.plan`; this name stays for code that imported ``ring_sp.planner``."""

from .plan import *  # noqa: F403
from .plan import __all__  # noqa: F401
