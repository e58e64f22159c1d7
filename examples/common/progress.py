"""Training progress: a tqdm bar on stderr and, with ``--log-json``, one JSON object per
step on stdout (``{"step": .., "loss": .., "tokens_per_s": ..}``) for scripts."""

from __future__ import annotations

import json
import sys
import time

from tqdm import tqdm


class Progress:
    """Call ``step(step, loss, tokens)`` after each optimizer step on the logging rank.

    The bar counts optimizer steps up to ``total_steps`` (starting at ``start_step`` when a
    run resumes) and shows the last loss and tokens/s; it closes itself after the last step
    (or call :meth:`close`). ``enabled=False`` (every rank but the logging one) prints nothing.
    """

    def __init__(self, total_steps: int, *, log_json: bool, enabled: bool = True, start_step: int = 0) -> None:
        self.total, self.log_json, self.enabled = total_steps, log_json, enabled
        self.start_step = start_step
        self._last = time.perf_counter()
        # stderr keeps stdout for the JSON lines; mininterval=0 draws every step (steps are slow)
        self._bar = tqdm(total=total_steps, initial=start_step, disable=not enabled, file=sys.stderr, unit="step",
                         dynamic_ncols=True, mininterval=0)

    def step(self, step: int, loss: float, tokens: int, **extra: float) -> None:
        now = time.perf_counter()
        tokens_per_s = tokens / max(now - self._last, 1e-9)
        self._last = now
        if not self.enabled:
            return
        if self.log_json:
            print(json.dumps({"step": step, "loss": round(loss, 6), "tokens_per_s": round(tokens_per_s, 1), **extra}), flush=True)
        self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=False)
        self._bar.update(step - self._bar.n)
        if step >= self.total:
            self.close()

    def log(self, step: int, **values: float) -> None:
        """One more JSON line for ``step`` (e.g. ``eval_loss``), with ``--log-json``; on the bar otherwise."""
        if not self.enabled:
            return
        if self.log_json:
            print(json.dumps({"step": step, **{k: round(v, 6) for k, v in values.items()}}), flush=True)
        self._bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()), file=sys.stderr)

    def close(self) -> None:
        """End the bar's line (idempotent)."""
        self._bar.close()
