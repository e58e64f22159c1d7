"""``python -m ring_sp.plan``: the ``ring-sp plan`` CLI."""

import sys

from .cli import main

sys.exit(main())
