"""Training progress: a one-line bar on stderr and, with ``--log-json``, one JSON object
per step on stdout (``{"step": .., "loss": .., "tokens_per_s": ..}``) for scripts."""

from __future__ import annotations

import json
import sys
import time


class Progress:
    """Call ``step(step, loss, tokens)`` after each optimizer step on the logging rank."""

    def __init__(self, total_steps: int, *, log_json: bool, enabled: bool = True, start_step: int = 0) -> None:
        self.total, self.log_json, self.enabled = total_steps, log_json, enabled
        self.start_step = start_step
        self._last = time.perf_counter()

    def step(self, step: int, loss: float, tokens: int, **extra: float) -> None:
        now = time.perf_counter()
        tokens_per_s = tokens / max(now - self._last, 1e-9)
        self._last = now
        if not self.enabled:
            return
        if self.log_json:
            print(json.dumps({"step": step, "loss": round(loss, 6), "tokens_per_s": round(tokens_per_s, 1), **extra}), flush=True)
        done = step - self.start_step
        width = 30
        filled = int(width * done / max(1, self.total - self.start_step))
        bar = "#" * filled + "." * (width - filled)
        print(f"\r[{bar}] step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s", end="", file=sys.stderr, flush=True)
        if step >= self.total:
            print(file=sys.stderr, flush=True)
