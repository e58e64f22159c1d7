"""Section ``memory``: the whole-step memory model against the allocator, and the longest N that fits.

The stack (:mod:`.stack`): a Llama-3-8B-sized model with 2 decoder layers in bf16 on one GPU
(hidden 4096, ffn 14,336, 32 q / 8 kv heads of 128, vocab 128,256), ring_sp's attention on one
rank, every gradient allocated before the step (steady state; no optimizer step: the model's
Adam states are fp32, torch's AdamW on bf16 parameters keeps bf16 ones). Two parts:

* ``memory``: at three lengths, each long-sequence piece (:data:`MODES`: tiled MLP and loss,
  checkpointing, checkpoints offloaded to host; untiled where it fits) runs one forward +
  backward; measured: the peak ``max_memory_allocated`` above what was allocated before
  (parameters and gradients), the absolute peak and ``max_memory_reserved`` beside it; model:
  :func:`ring_sp.plan.step_memory.step_memory` for the same stack (``kernels="hf"``, its tiles,
  ``master_weights=False``), the part above parameters and gradients: checkpoints + kept
  activations + the larger of the loss and one layer's backward. Target: within 10%.
* ``memory_longest``: the longest N whose step fits on the card (``--quick``: in a 20 GiB
  budget, ``set_per_process_memory_fraction``), for ring_sp (tiled + offloaded checkpoints)
  and for ALST's modules (DeepSpeed's ``TiledMLP`` + ``TiledFusedLogitsLoss`` around sdpa,
  every layer checkpointed; first measured at two lengths like the others): from where the
  line through the two longest measured steps reaches the free memory (else the model's
  prediction), moved by 4% steps until a fit and a failure bracket it, then bisected to
  :attr:`MemoryConfig.unit` tokens; each probe only if its predicted time
  (:func:`predict_time`: ``a N + b N^2`` through the two longest steps run so far) fits the
  target's share of the time left.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp.offload import OffloadedCheckpoint
from ring_sp.plan.step_memory import Training, Transformer, max_seq_len, step_memory

from ..cuda_long_sequence import MODES
from ..tables import table
from .seam import Deadline, Seam
from .stack import StepModel, alst_loss, alst_modules, build, tokens

Record = dict[str, Any]
LLAMA_8B_2_LAYERS = Transformer(hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, layers=2, vocab=128256,
                                name="Llama-3-8B-sized, 2 layers")
TINY = Transformer(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=300, name="tiny (dry)")


@dataclass(frozen=True)
class MemoryConfig:
    shape: Transformer = LLAMA_8B_2_LAYERS
    seq_lens: tuple[int, ...] = (16384, 32768, 65536)
    modes: tuple[str, ...] = ("tiled", "tiled+ckpt", "tiled+offload", "untiled", "untiled+ckpt")
    tile_tokens: int = 4096
    longest: tuple[str, ...] = ("ring_sp tiled+offload", "ALST")
    unit: int = 8192  # the longest N is searched in multiples of this
    step_share: float = 0.04  # ... from its first guess in steps of this share of it (doubling)
    budget: int | None = None  # the longest N within this many bytes (None: the whole card)
    fits_share: float = 0.9  # a measured mode predicted above this share of the free memory is skipped
    dry_capacity: int = 2**30  # the CPU stand-in's memory (dry mode)


FULL = MemoryConfig()
QUICK = MemoryConfig(seq_lens=(8192, 16384, 32768), modes=("tiled", "tiled+offload", "untiled"), unit=4096,
                     budget=20 * 2**30)
DRY = MemoryConfig(shape=TINY, seq_lens=(64, 256), tile_tokens=32, unit=64, dry_capacity=3 * 2**20)
assert set(FULL.modes) <= set(MODES)


def training(mode: str, cfg: MemoryConfig, dtype: torch.dtype) -> Training:
    """How ``ring_sp.plan.step_memory`` describes ``mode`` ("tiled+offload", ..., or "ALST")."""
    if mode == "ALST":
        return Training(dtype=_dtype(dtype), master_weights=False, checkpointing=True, tiled_mlp=True,
                        tiled_loss=True, library="alst")
    ckpt = mode.endswith(("+ckpt", "+offload"))
    tiled = mode.startswith("tiled")
    return Training(dtype=_dtype(dtype), master_weights=False, checkpointing=ckpt,
                    offload_checkpoints=mode.endswith("+offload"), tiled_mlp=tiled, tiled_loss=tiled,
                    mlp_tile_tokens=cfg.tile_tokens, loss_tile_tokens=cfg.tile_tokens)


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def _dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def model_added(shape: Transformer, train: Training, seq_len: int) -> tuple[float, float]:
    """(bytes the step adds above parameters and gradients, parameters + gradients), modelled."""
    s = step_memory(shape, train, seq_len=seq_len)
    return s.checkpoints + s.kept + max(s.phases["loss"], s.phases["layer backward"]), s.params + s.grads


class Runner:
    """One stack on the seam's device; ``step(n, mode)`` runs one forward + backward at ``n`` tokens."""

    def __init__(self, seam: Seam, cfg: MemoryConfig, alst: Any = None) -> None:
        self.seam, self.cfg, self.alst = seam, cfg, alst
        self.model: StepModel | None = build(cfg.shape, seam.device, seam.dtype, alst)
        self.resident = sum(2 * p.numel() * p.element_size() for p in self.model.parameters())  # params + grads

    def step(self, n: int, mode: str) -> Record:
        """Measured: ``added_bytes`` (above what was allocated before), ``peak_bytes``,
        ``reserved_bytes``, ``step_s``, ``loss``; or ``out_of_memory`` with the message."""
        seam, model = self.seam, self.model
        ids, labels = tokens(n, self.cfg.shape.vocab, seam.device)
        for p in model.parameters():
            p.grad.zero_()
        loss: list[float] = []

        def run() -> None:
            if mode == "ALST":
                value = alst_loss(model, ids, labels, self.alst[1])
            else:
                offloader = OffloadedCheckpoint() if mode.endswith("+offload") else None
                value = model.loss(ids, labels, mode, self.cfg.tile_tokens, offloader)
            value.backward()
            loss.append(value.item())

        failed = None
        try:  # the CPU stand-in holds the step to what is free (CUDA: the allocator does)
            with seam.memory(None if seam.is_cuda else self.free_bytes()) as m:
                seconds = seam.time(run)
        except Exception as exc:  # noqa: BLE001  (anything but running out of memory is raised again)
            if not seam.is_out_of_memory(exc):
                raise
            failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
        del ids, labels
        seam.release()
        if failed is not None:
            return {"out_of_memory": failed}
        start = m.start if seam.is_cuda else self.resident
        return {"added_bytes": m.added, "peak_bytes": start + m.added, "reserved_bytes": m.reserved,
                "start_bytes": start, "step_s": seconds, "loss": loss[0]}

    def free_bytes(self) -> int:
        """Memory a step may add: the capacity (or budget) less what is allocated now."""
        return self.seam.capacity() - (self.seam.allocated() if self.seam.is_cuda else self.resident)

    def close(self) -> None:
        self.model = None
        self.seam.release()


Points = dict[str, list[Record]]  # mode -> its measured steps


def measure(runner: Runner, mode: str, seq_lens: tuple[int, ...], deadline: Deadline, log: Callable[[str], None],
            points: Points) -> list[Record]:
    """``mode`` at each length against the model: a ``memory`` record each (skipped where the model
    says it would not fit in ``fits_share`` of the free memory, or the time cap would pass)."""
    cfg, records = runner.cfg, []
    for n in seq_lens:
        train = training(mode, cfg, runner.seam.dtype)
        added, resident = model_added(cfg.shape, train, n)
        record: Record = {"section": "memory", "mode": mode, "library": train.library, "seq_len": n,
                          "model": cfg.shape.name, "tile_tokens": cfg.tile_tokens, "model_added_bytes": added,
                          "model_resident_bytes": resident, "measured_resident_bytes": runner.resident}
        cost = predict_time([(r["seq_len"], r["step_s"]) for r in points.get(mode, [])], n)
        if added > cfg.fits_share * runner.free_bytes():
            records.append({**record, "skipped": f"predicted {_mib(added)} MiB above the resident state, over "
                            f"{cfg.fits_share:.0%} of the {_mib(runner.free_bytes())} MiB free"})
        elif not deadline.allows(cost):
            records.append({**record, "skipped": f"time cap: predicted {cost:.1f} s, {deadline.left():.0f} s left"})
        else:
            log(f"memory: {mode} at N={n}")
            got = runner.step(n, mode)
            if "step_s" in got:
                got["measured_over_model"] = got["added_bytes"] / added
                points.setdefault(mode, []).append({"seq_len": n, **got})
            records.append({**record, **got})
    return records


def memory(seam: Seam, cfg: MemoryConfig, deadline: Deadline, log: Callable[[str], None]) -> Iterator[Record]:
    """The measured modes at every length, then the longest N of each ``cfg.longest``; each
    record as soon as it is measured."""
    if not seam.is_cuda:
        seam = Seam(seam.device, cfg.dry_capacity)
    runner = Runner(seam, cfg)
    runner.step(cfg.seq_lens[0], "tiled")  # warm-up: kernels, allocator, library handles
    points: Points = {}
    for n in cfg.seq_lens:
        for mode in cfg.modes:
            yield from measure(runner, mode, (n,), deadline, log, points)
    for i, target in enumerate(cfg.longest):
        share = Deadline(deadline.left() / (len(cfg.longest) - i))
        if target != "ALST":
            yield from longest(runner, target, share, log, points)
            continue
        try:
            modules = alst_modules()
        except Exception as exc:  # noqa: BLE001  (DeepSpeed missing or broken: the row says which)
            yield {"section": "memory_longest", "target": target, "skipped": f"DeepSpeed's ALST modules are not "
                   f"importable ({type(exc).__name__}: {exc}); bring DeepSpeed's wheel with --wheels (docs/benchmarks.md)"}
            continue
        runner.close()  # one stack on the card at a time
        alst = Runner(seam, cfg, modules)
        yield from measure(alst, "ALST", cfg.seq_lens[:2], share, log, points)
        yield from longest(alst, target, share, log, points)
        alst.close()
        if i + 1 < len(cfg.longest):
            runner = Runner(seam, cfg)


def longest(runner: Runner, target: str, deadline: Deadline, log: Callable[[str], None], points: Points) -> list[Record]:
    """The longest N of ``target`` ("ring_sp <mode>" or "ALST") within the card (or ``cfg.budget``)."""
    cfg = runner.cfg
    mode = "ALST" if target == "ALST" else target.removeprefix("ring_sp ")
    train = training(mode, cfg, runner.seam.dtype)
    with runner.seam.budget(cfg.budget):
        free = runner.free_bytes()
        modelled, _ = max_seq_len(cfg.shape, train, free + _resident_model(cfg.shape, train), multiple=cfg.unit)
        extrapolated = linear_longest(points.get(mode, []), free)
        guess = extrapolated or modelled
        seen = points.get(mode) or points.get("tiled+ckpt") or []
        log(f"memory: longest N for {target} within {_mib(free)} MiB free, from {guess:,} "
            f"({'measured steps extrapolated' if extrapolated else 'the model'})")
        found = search(lambda n: runner.step(n, mode), max(guess, cfg.unit), cfg.unit, deadline,
                       [(r["seq_len"], r["step_s"]) for r in seen], cfg.step_share)
    held = None if cfg.budget is None else all(p.get("peak_bytes", 0) <= cfg.budget for p in found["probes"])
    return [{"section": "memory_longest", "target": target, "model": cfg.shape.name, "unit": cfg.unit,
             "budget_bytes": cfg.budget, "budget_held": held, "free_bytes": free, "model_longest": modelled,
             "extrapolated_longest": extrapolated, **found}]


def linear_longest(steps: list[Record], free: int) -> int | None:
    """Where the line through the two longest measured steps' ``added_bytes`` reaches ``free``."""
    points = sorted((r["seq_len"], r["added_bytes"]) for r in steps)[-2:]
    if len(points) < 2 or points[1][0] == points[0][0] or points[1][1] <= points[0][1]:
        return None
    (n1, b1), (n2, b2) = points
    per_token = (b2 - b1) / (n2 - n1)
    return max(0, int(n2 + (free - b2) / per_token))


def _resident_model(shape: Transformer, train: Training) -> float:
    """The model's resident state (what :func:`max_seq_len` counts besides the step itself)."""
    s = step_memory(shape, train, seq_len=2)
    return s.params + s.grads + s.optimizer + s.zero_buffers + s.reserved


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


def search(fits: Callable[[int], Record], guess: int, unit: int, deadline: Deadline,
           steps: list[tuple[int, float]], step_share: float = 0.04) -> Record:
    """Bracket, then bisect, the longest multiple of ``unit`` for which ``fits(n)`` has no
    ``out_of_memory``: start at ``guess``, move up or down by ``step_share`` of it (at least one
    unit; doubling each time) until a fit and a failure bracket it, then halve the bracket down
    to one unit. A probe runs only if its predicted time (:func:`predict_time` over ``steps``
    and the probes that fit) fits ``deadline``."""
    lo, hi, probes, stopped = 0, None, [], None
    n = _units(guess, unit)
    stride = max(unit, _units(guess * step_share, unit))
    while n > 0:
        cost = predict_time(steps, n)
        if not deadline.allows(cost):
            stopped = f"time cap: a probe at {n:,} predicted {cost:.0f} s, {deadline.left():.0f} s left"
            break
        result = fits(n)
        ok = "out_of_memory" not in result
        probes.append({"seq_len": n, "fits": ok,
                       **{k: result[k] for k in ("added_bytes", "peak_bytes", "step_s") if k in result}})
        if ok:
            lo = n
            steps.append((n, result["step_s"]))
        else:
            hi = n
        if hi is not None and hi - lo <= unit:
            break
        if hi is None:
            n, stride = n + stride, 2 * stride
        elif lo == 0:
            n, stride = max(unit, n - stride), 2 * stride
        else:
            n = lo + _units((hi - lo) / 2, unit)
    return {"longest_fits": lo, "shortest_fails": hi, "converged": hi is not None and hi - lo <= unit,
            "probes": probes, "stopped": stopped}


def _units(n: float, unit: int) -> int:
    return int(math.floor(n / unit)) * unit


def markdown(records: list[Record]) -> list[str]:
    rows = [r for r in records if r["section"] == "memory" and "mode" in r]  # not a section's crash
    out: list[str] = []
    if rows:
        body = []
        for r in rows:
            cells = [r["mode"], f"{r['seq_len']:,}", _mib(r["model_added_bytes"])]
            if "added_bytes" in r:
                reserved = "-" if r["reserved_bytes"] is None else _mib(r["reserved_bytes"])
                cells += [_mib(r["added_bytes"]), f"**{r['measured_over_model']:.3f}**", _mib(r["peak_bytes"]),
                          reserved, f"{r['step_s']:.3f}"]
            else:
                cells += [r.get("skipped") or r.get("out_of_memory", "-"), "", "", "", ""]
            body.append(cells)
        out += [f"{rows[0]['model']}, one forward + backward per mode, gradients allocated before it: what the step "
                "adds above parameters and gradients (MiB), modelled (`ring_sp.plan.step_memory`) and measured "
                "(`max_memory_allocated`); the absolute peak and `max_memory_reserved` beside it. Target: "
                "measured / model within 10%.", ""]
        out += table(["mode", "N", "model", "measured", "measured / model", "peak", "reserved", "step s"], body)
    found = [r for r in records if r["section"] == "memory_longest"]
    if found:
        body = []
        for r in found:
            if "skipped" in r:
                body.append([r["target"], r["skipped"], "", "", "", "", ""])
                continue
            bracket = f"{r['longest_fits']:,} fits" if r["longest_fits"] else "no fit seen"
            bracket += f", {r['shortest_fails']:,} fails" if r["shortest_fails"] else ", no failure seen"
            bracket += f" ({r['stopped']})" if r["stopped"] else ""
            extrapolated = r["extrapolated_longest"]
            body.append([r["target"], f"{r['longest_fits']:,}", bracket,
                         "-" if extrapolated is None else f"{extrapolated:,}", f"{r['model_longest']:,}",
                         str(len(r["probes"])), _mib(r["free_bytes"])])
        budget = next((r["budget_bytes"] for r in found if r.get("budget_bytes")), None)
        where = "on the card" if budget is None else f"in a {_mib(budget)} MiB budget"
        if any(r.get("budget_held") is False for r in found):
            where += " (**a probe's peak passed the budget: the allocator did not hold it**)"
        unit = next((r["unit"] for r in found if "unit" in r), 0)
        out += ["" if out else None, f"The longest sequence whose step fits {where} (multiples of "
                f"{unit:,} tokens), by probing; beside it the measured steps' line extrapolated to the "
                "free memory, and the model's prediction:", ""]
        out += table(["stack", "longest N", "bracket", "extrapolated", "model", "probes", "free MiB"], body)
    return [line for line in out if line is not None]

