"""The longest sequence each library's step fits on the card, within a time budget.

A probe near a million tokens takes minutes on an H200 (attention grows as N^2), so the
search of the first GPU run found no bracket within its cap. Instead, per library:

1. its line: what the step adds above parameters and gradients at three lengths (128K-512K
   on the card; one step each, :attr:`.memory.MemoryConfig.line_lens`), fitted by least
   squares: bytes per token (the slope) and a constant;
2. the line extrapolated to the free memory: the longest N (a multiple of ``unit``);
3. a probe at that N (it should fit) and, where the time left allows, one ``longer`` (5%)
   past it (it should fail); each only if its predicted time (:func:`predict_time`: ``a N +
   b N^2`` through the line's two longest steps) fits the library's share of the time left.

The line and the probes run on fewer layers than the 2-layer model (one, by default) with a
ballast of the missing layers' parameters and gradients, so the free memory is the 2-layer
stack's, at half the time. That is exact because what a step adds depends on the layer count
only through the checkpoints a deeper stack holds on the device: with offloaded checkpoints
one (ALST; ring_sp beyond its prefetch share, which every longest N on an 80-141 GiB card is)
or two (ring_sp while it prefetches a layer ahead), and on the CPU every layer's. The model
counts those (:func:`.memory.layer_delta`), each probe adds them to the ballast, and the
``memory_layers`` record checks the claim at one length on both stacks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ring_sp.plan.step_memory import Training, Transformer, max_seq_len, step_memory

from .seam import Deadline

Record = dict[str, Any]


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """(bytes per token, constant bytes) of the least-squares line through ``(tokens, bytes)``
    points; None with fewer than two lengths or a line that does not grow."""
    lengths = {n for n, _ in points}
    if len(lengths) < 2:
        return None
    mean_n = sum(n for n, _ in points) / len(points)
    mean_b = sum(b for _, b in points) / len(points)
    slope = (sum((n - mean_n) * (b - mean_b) for n, b in points) / sum((n - mean_n) ** 2 for n, _ in points))
    if slope <= 0:
        return None
    return slope, mean_b - slope * mean_n


def units(n: float, unit: int) -> int:
    return max(0, int(math.floor(n / unit)) * unit)


def predict_time(steps: list[tuple[int, float]], n: int) -> float:
    """Seconds of a step at ``n`` tokens from ``steps`` ((tokens, seconds) run so far): ``a n + b n^2``
    through the two longest (a, b >= 0; attention grows as n^2, the rest as n); one step: scaled
    by ``n^2``; none: 0 (run it)."""
    points = sorted(set(steps))[-2:]
    if not points:
        return 0.0
    if len(points) == 1 or points[0][0] == points[1][0]:
        return points[-1][1] * (n / points[-1][0]) ** 2
    (n1, t1), (n2, t2) = points
    b = max(0.0, (t2 / n2 - t1 / n1) / (n2 - n1))
    a = max(0.0, t2 / n2 - b * n2)
    return a * n + b * n * n


def resident_model(shape: Transformer, train: Training) -> float:
    """The model's resident state (what :func:`max_seq_len` counts besides the step itself)."""
    s = step_memory(shape, train, seq_len=2)
    return s.params + s.grads + s.optimizer + s.zero_buffers + s.reserved


def probe_longest(runner: Any, line: list[Record], *, shape: Transformer, unit: int, longer: float,
                  ballast: Callable[[int], int], deadline: Deadline, log: Callable[[str], None]) -> Record:
    """Steps 2-3 of the module docstring for ``runner`` (a :class:`.memory.Runner` of the line's
    stack), whose measured line is ``line``; ``ballast(n)``: the resident bytes a probe at ``n``
    holds (the 2-layer stack's parameters and gradients, plus its extra device checkpoints)."""
    runner.hold(ballast(0))
    free = runner.free_bytes()
    modelled, _ = max_seq_len(shape, runner.training, free + resident_model(shape, runner.training), multiple=unit)
    record: Record = {"section": "memory_longest", "library": runner.library, "model": shape.name, "unit": unit,
                      "free_bytes": free, "model_longest": modelled, "line_lens": [r["seq_len"] for r in line],
                      "probes": [], "stopped": None}
    fitted = fit_line([(r["seq_len"], r["added_bytes"]) for r in line])
    if fitted is None:
        return {**record, "stopped": f"no line: {len(line)} measured step(s) on the line's stack"}
    slope, constant = fitted
    extrapolated = units((free - constant) / slope, unit)
    for _ in range(3):  # the deeper stack's extra device checkpoints at that length come off the free memory
        extrapolated = units((free - constant - (ballast(extrapolated) - ballast(0))) / slope, unit)
    record.update(slope_bytes_per_token=slope, constant_bytes=constant, extrapolated_longest=extrapolated)
    times = [(r["seq_len"], r["step_s"]) for r in line]
    targets = [extrapolated, max(extrapolated + unit, units(extrapolated * (1 + longer), unit))]
    for i, n in enumerate(targets):
        cost = predict_time(times, n)
        if not deadline.allows(cost):
            record["stopped"] = f"time cap: a probe at {n:,} predicted {cost:.0f} s, {deadline.left():.0f} s left"
            break
        log(f"memory: {runner.library} probe at N={n:,} (line: {slope:,.0f} bytes/token)")
        runner.hold(ballast(n))
        got = runner.step(n)
        fits = "out_of_memory" not in got
        record["probes"].append({"seq_len": n, "fits": fits, "ballast_bytes": runner.ballast_bytes,
                                 **{k: got[k] for k in ("added_bytes", "peak_bytes", "step_s") if k in got}})
        if fits:
            times.append((n, got["step_s"]))
        if i == 0 and not fits:
            break  # the line over-reached: no 5% probe past a failure
    first = record["probes"][0] if record["probes"] else None
    record["confirmed"] = bool(first and first["fits"])
    record["longest_fits"] = first["seq_len"] if record["confirmed"] else None
    second = record["probes"][1] if len(record["probes"]) > 1 else None
    record["longer_fails"] = None if second is None else not second["fits"]
    return record


__all__ = ["fit_line", "predict_time", "probe_longest", "resident_model", "units"]
