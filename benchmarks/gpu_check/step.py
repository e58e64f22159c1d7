"""Section ``step``: ring_sp's whole training step with its defaults against ALST's modules and untiled.

The model is transformers' ``LlamaForCausalLM`` with Llama-3-8B's shape and 2 decoder layers in
bf16 on one GPU, built by the ``memory`` section's builder (:mod:`.llama`; ALST's recipe
:mod:`.alst`), every mode training ONE set of parameters (:func:`.llama.share_parameters`;
gradients allocated before the step, zeroed between steps). The modes (:data:`RECIPES`):
``ring_sp`` (``register`` + ``enable_long_sequence`` defaults + ``model_loss``, what its users
run), ``untiled`` (ring_sp's attention only), ``ALST`` (its modules as issue 38 timed them:
sdpa with torch's own choice of kernel, DeepSpeed's ``TiledMLP`` and ``TiledFusedLogitsLoss``,
every layer checkpointed on the device, no Liger) and, where time allows, ``ring_sp+ckpt``
(the defaults with every layer checkpointed on the device, like for like with ALST). At each
length (16K-128K; ``--quick`` 16K-32K), one forward + backward per mode: a warm-up, then the
median of ``repeats`` timed steps (CUDA events; one after a warm-up where the step is predicted
past ``long_step_s``), the loss (the modes must agree: same weights, same tokens) and the peak
memory the step adds. A mode whose memory, extrapolated through its last two lengths, would
pass ``fits_share`` of the free memory is skipped there (so is every longer length of a mode
that ran out of memory), and a step whose predicted time would pass the section's cap. At
``profile_len`` one more step per mode runs under torch.profiler: its top CUDA kernels by their
own time (:meth:`.seam.Seam.profile`). Targets: ``ring_sp`` <= 1.10x ``untiled`` where untiled
fits, <= 1.00x ``ALST`` at every measured length.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp.plan.step_memory import Transformer

from ..tables import table
from .alst import AlstRecipe, alst_step
from .llama import TINY, RingSpRecipe, Step, llama_3_8b, ring_sp_step, share_parameters, tokens
from .longest import predict_time
from .preflight import transformers_unsupported
from .seam import Deadline, Seam

Record = dict[str, Any]
UNTILED_RATIO_TARGET, ALST_RATIO_TARGET = 1.10, 1.00
# relative, between the modes' losses: a label off by one token moves it by about 5e-4 (fp32, tiny dry model)
LOSS_AGREEMENT = {"bfloat16": 2e-3, "float32": 1e-4}
RECIPES: dict[str, RingSpRecipe | AlstRecipe] = {
    "ring_sp": RingSpRecipe(checkpointing=False, offload=False),
    "ring_sp+ckpt": RingSpRecipe(offload=False),
    "untiled": RingSpRecipe(tiled=False, checkpointing=False, offload=False),
    "ALST": AlstRecipe(liger=False, sdpa_backend=None, offload_checkpoints=False),
}


@dataclass(frozen=True)
class StepConfig:
    shape: Transformer = llama_3_8b(2)
    seq_lens: tuple[int, ...] = (16384, 32768, 65536, 131072)
    modes: tuple[str, ...] = ("ring_sp", "untiled", "ALST", "ring_sp+ckpt")  # in order of priority
    repeats: int = 2
    long_step_s: float = 2.0  # a step predicted longer than this is timed once (after its warm-up)
    profile_len: int = 32768
    profile_top: int = 8
    fits_share: float = 0.9
    dry_capacity: int = 2**30  # the CPU stand-in's memory (dry mode)


FULL = StepConfig()
QUICK = StepConfig(seq_lens=(16384, 32768), modes=("ring_sp", "untiled", "ALST"))
# the stand-in's capacity: at 256 tokens untiled's full logits pass it by about 15%, the others stay ~17% below
DRY = StepConfig(shape=TINY, seq_lens=(64, 256), repeats=1, profile_len=64, dry_capacity=int(2.75 * 2**20))


def build_steps(modes: Iterable[str], shape: Transformer, device: torch.device, dtype: torch.dtype
                ) -> tuple[dict[str, Step], dict[str, str]]:
    """({mode: its Step (:data:`RECIPES`)}, all sharing the first one's parameters and gradients,
    {mode: why it cannot be built}: ALST without DeepSpeed's modules)."""
    steps: dict[str, Step] = {}
    missing: dict[str, str] = {}
    for mode in modes:
        recipe = RECIPES[mode]
        try:
            if isinstance(recipe, AlstRecipe):
                step = alst_step(shape, device, dtype, recipe)
            else:
                step = ring_sp_step(shape, device, dtype, recipe)
        except ImportError as exc:  # DeepSpeed missing: the mode is reported, the others run
            missing[mode] = f"{type(exc).__name__}: {exc}"
            continue
        if steps:
            share_parameters(next(iter(steps.values())).model, step.model)
        steps[mode] = step
    return steps, missing


class _Runner:
    """The modes' steps on the seam's device and what each measured so far."""

    def __init__(self, seam: Seam, cfg: StepConfig, steps: dict[str, Step]) -> None:
        self.seam, self.cfg, self.steps = seam, cfg, steps
        first = next(iter(steps.values()))
        self.params = list(first.model.parameters())
        self.resident = first.resident_bytes()  # parameters + gradients
        self.times: dict[str, list[tuple[int, float]]] = {m: [] for m in steps}
        self.added: dict[str, list[tuple[int, int]]] = {m: [] for m in steps}
        self.failed_at: dict[str, int] = {}

    def free_bytes(self) -> int:
        return self.seam.capacity() - (self.seam.allocated() if self.seam.is_cuda else self.resident)

    def one(self, step: Step, ids: torch.Tensor) -> tuple[float, int, int, float]:
        """(seconds, bytes added at the peak, the peak, loss) of one forward + backward, gradients zeroed first."""
        for p in self.params:
            p.grad.zero_()
        losses: list[float] = []
        with self.seam.memory(None if self.seam.is_cuda else self.free_bytes()) as m:
            seconds = self.seam.time(lambda: losses.append(step.train(ids)))
        return seconds, m.added, m.peak if self.seam.is_cuda else self.resident + m.added, losses[0]

    def skip_reason(self, mode: str, n: int, deadline: Deadline) -> str | None:
        if mode in self.failed_at:
            return f"out of memory at {self.failed_at[mode]:,} already"
        added = sorted(self.added[mode])[-2:]
        if len(added) == 2 and added[1][0] > added[0][0]:
            (n1, b1), (n2, b2) = added
            predicted = b2 + (b2 - b1) / (n2 - n1) * (n - n2)
            if predicted > self.cfg.fits_share * self.free_bytes():
                return (f"predicted {predicted / 2**30:,.1f} GiB added, over {self.cfg.fits_share:.0%} of the "
                        f"{self.free_bytes() / 2**30:,.1f} GiB free")
        one = predict_time(self.times[mode], n)
        cost = one * (2 if one > self.cfg.long_step_s else 1 + self.cfg.repeats)  # the warm-up and the timed steps
        if not deadline.allows(cost):
            return f"time cap: predicted {cost:.1f} s, {deadline.left():.0f} s left"
        return None

    def measure(self, mode: str, n: int) -> Record:
        """Warm-up, then the timed steps: ``step_s`` (median), ``times_s``, ``loss``, ``added_bytes``;
        or ``out_of_memory`` with the message."""
        step, seam = self.steps[mode], self.seam
        ids = tokens(n, self.cfg.shape.vocab, seam.device)
        failed = None
        try:
            warm = self.one(step, ids)
            repeats = 1 if warm[0] > self.cfg.long_step_s else self.cfg.repeats
            runs = [self.one(step, ids) for _ in range(repeats)]
        except Exception as exc:  # noqa: BLE001  (anything but running out of memory is raised again)
            failed = seam.out_of_memory_record(exc)
        if failed is not None:  # released here, once the exception (and the step's tensors it holds) is gone
            self.failed_at[mode] = n
            seam.release()
            return {"out_of_memory": failed}
        median = statistics.median(r[0] for r in runs)
        added = max(r[1] for r in runs)
        self.times[mode].append((n, median))
        self.added[mode].append((n, added))
        return {"step_s": median, "times_s": [r[0] for r in runs], "warmup_s": warm[0], "loss": runs[-1][3],
                "added_bytes": added, "peak_bytes": max(r[2] for r in runs)}

    def profile(self, mode: str, n: int) -> Record:
        step, ids = self.steps[mode], tokens(n, self.cfg.shape.vocab, self.seam.device)
        for p in self.params:
            p.grad.zero_()
        return self.seam.profile(lambda: step.train(ids), self.cfg.profile_top)


def step(seam: Seam, cfg: StepConfig, deadline: Deadline, log: Callable[[str], None]) -> Iterator[Record]:
    """Every mode at every length, shortest first, within ``deadline``; each record as soon as it is measured."""
    if not seam.is_cuda:
        seam = Seam(seam.device, cfg.dry_capacity)
    shape = cfg.shape
    base: Record = {"section": "step", "model": shape.name, "layers": shape.layers, "hidden": shape.hidden,
                    "vocab": shape.vocab, "dtype": str(seam.dtype).removeprefix("torch.")}
    unsupported = transformers_unsupported()
    if unsupported:
        yield {**base, "mode": "every mode", "skipped": unsupported}
        return
    log(f"step: building {', '.join(cfg.modes)} ({shape.name}, one set of parameters)")
    steps, missing = build_steps(cfg.modes, shape, seam.device, seam.dtype)
    for mode, reason in missing.items():
        yield {**base, "mode": mode, "skipped": f"cannot build it: {reason}; bring DeepSpeed's wheel with --wheels "
               "(docs/benchmarks.md)"}
    if not steps:
        return
    runner = _Runner(seam, cfg, steps)
    first = next(iter(steps.values())).model
    yield {"section": "step_models", "modes": list(steps), "pieces": {m: s.pieces for m, s in steps.items()},
           "parameters": sum(p.numel() for p in runner.params),
           "resident_bytes": runner.resident, "parameters_shared": all(
               p is q for s in steps.values() for p, q in zip(s.model.parameters(), first.parameters()))}
    for n in cfg.seq_lens:
        for mode in steps:
            reason = runner.skip_reason(mode, n, deadline)
            if reason is not None:
                yield {**base, "mode": mode, "seq_len": n, "skipped": reason}
                continue
            log(f"step: {mode} at N={n:,}")
            yield {**base, "mode": mode, "seq_len": n, **runner.measure(mode, n)}
        if n == cfg.profile_len:
            for mode in steps:
                if runner.times[mode] and runner.times[mode][-1][0] == n and deadline.allows(
                        2 * runner.times[mode][-1][1]):
                    log(f"step: profiling {mode} at N={n:,}")
                    yield {"section": "step_profile", "mode": mode, "seq_len": n, **runner.profile(mode, n)}


def _measured(records: list[Record]) -> dict[int, dict[str, Record]]:
    """{N: {mode: its measured record}}."""
    by_n: dict[int, dict[str, Record]] = {}
    for r in records:
        if r["section"] == "step" and "step_s" in r:
            by_n.setdefault(r["seq_len"], {})[r["mode"]] = r
    return by_n


def _loss_spread(modes: dict[str, Record]) -> float:
    """The largest relative difference between the modes' losses at one length."""
    losses = [r["loss"] for r in modes.values()]
    return (max(losses) - min(losses)) / abs(min(losses, key=abs)) if len(losses) > 1 else 0.0


def markdown(records: list[Record]) -> list[str]:
    rows = [r for r in records if r["section"] == "step" and "mode" in r]  # not a section's crash
    if not rows:
        return []
    first = next(r for r in rows)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    lengths = sorted({r["seq_len"] for r in rows if "seq_len" in r})
    cell = {(r["mode"], r.get("seq_len")): r for r in rows}
    body = []
    for n in lengths:
        cells = [f"{n:,}"]
        for mode in modes:
            r = cell.get((mode, n), {})
            cells.append(f"{r['step_s']:.3f}" if "step_s" in r else r.get("skipped") or r.get("out_of_memory", "-"))
        measured = _measured(records).get(n, {})
        ring = measured.get("ring_sp")
        for other in ("untiled", "ALST"):
            cells.append(f"**{ring['step_s'] / measured[other]['step_s']:.2f}**" if ring and other in measured else "-")
        cells.append(f"{_loss_spread(measured):.1e}" if measured else "-")
        body.append(cells)
    out = [f"transformers' LlamaForCausalLM (hidden {first['hidden']:,}, vocab {first['vocab']:,}: Llama-3-8B's "
           f"shape on the GPU), {first['layers']} layers, {first['dtype']}, one forward + backward per mode: seconds "
           "per step (median after a warm-up; CUDA events). `ring_sp`: `register` + `enable_long_sequence` "
           "defaults + `model_loss`; each mode's pieces below. "
           f"Targets: ring_sp / untiled <= {UNTILED_RATIO_TARGET:.2f}, ring_sp / ALST <= "
           f"{ALST_RATIO_TARGET:.2f}. Loss spread: the modes' largest relative difference (one set of weights, the "
           "same tokens).", ""]
    for built in (r for r in records if r["section"] == "step_models"):
        out += [f"* `{mode}`: " + "; ".join(f"{k} {v}" for k, v in pieces.items()) for mode, pieces in
                built["pieces"].items()]
        shared = "one set shared by every mode" if built["parameters_shared"] else "**not shared**"
        out += [f"* {built['parameters']:,} parameters, {shared}", ""]
    for mode in modes:
        r = cell.get((mode, None))
        if r is not None:
            out += [f"* `{mode}`: {r['skipped']}"]
    out += table(["N", *[f"{m} s" for m in modes], "ring_sp / untiled", "ring_sp / ALST", "loss spread"], body)
    for p in (r for r in records if r["section"] == "step_profile"):
        out += ["", f"`{p['mode']}` at N={p['seq_len']:,}: top {len(p['top'])} {p['what']} of "
                f"{p['total_ms']:,.1f} ms:", ""]
        out += table(["name", "self ms", "calls", "share"],
                     [[f"`{k['name']}`", f"{k['self_ms']:,.2f}", str(k["calls"]), f"{k['share']:.1%}"]
                      for k in p["top"]])
    return out


def targets(records: list[Record]) -> list[list[str]]:
    """(target, measured, verdict): ring_sp's step against untiled and ALST, ring_sp+ckpt against
    ALST (recorded), and the modes' losses agreeing."""
    measured = _measured(records)
    if not measured:
        return []
    verdict = {True: "met", False: "**not met**"}
    rows = []
    for other, goal, where in (("untiled", UNTILED_RATIO_TARGET, " where untiled fits"),
                               ("ALST", ALST_RATIO_TARGET, " at every measured length")):
        ratios = {n: m["ring_sp"]["step_s"] / m[other]["step_s"] for n, m in measured.items()
                  if "ring_sp" in m and other in m}
        name = f"ring_sp's step (defaults) <= {goal:.2f}x {other}'s{where}"
        values = ", ".join(f"{n:,}: {x:.2f}" for n, x in sorted(ratios.items()))
        rows.append([name, values or "no length with both", verdict[max(ratios.values()) <= goal] if ratios
                     else "unmeasured"])
    ckpt = {n: m["ring_sp+ckpt"]["step_s"] / m["ALST"]["step_s"] for n, m in measured.items()
            if "ring_sp+ckpt" in m and "ALST" in m}
    if ckpt:
        rows.append(["ring_sp+ckpt's step / ALST's (like for like: both checkpointed)",
                     ", ".join(f"{n:,}: {x:.2f}" for n, x in sorted(ckpt.items())), "recorded"])
    dtype = next(r["dtype"] for m in measured.values() for r in m.values())
    spread = max(_loss_spread(m) for m in measured.values())
    rows.append([f"the modes' losses agree within {LOSS_AGREEMENT[dtype]:.0e} (one set of weights, same tokens)",
                 f"largest relative spread {spread:.1e}", verdict[spread <= LOSS_AGREEMENT[dtype]]])
    return rows
