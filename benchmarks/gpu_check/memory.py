"""Section ``memory``: the whole-step memory model against the allocator, and the longest N on the card.

Both libraries train transformers' ``LlamaForCausalLM`` with Llama-3-8B's shape (:mod:`.llama`:
from a config, bf16, one GPU, every gradient allocated before the step; no optimizer step),
each through its own long-sequence recipe: ring_sp's ``enable_long_sequence`` defaults with
checkpoints offloaded (:func:`.llama.ring_sp_step`), ALST's one-GPU recipe (:mod:`.alst`).

* ``memory``: each library's step at :attr:`MemoryConfig.seq_lens` (2 layers) and on its line
  (:attr:`MemoryConfig.line_lens`, :attr:`MemoryConfig.line_layers` layers): measured, the
  peak ``max_memory_allocated`` above what was allocated before (parameters, gradients, the
  ballast below), the absolute peak and ``max_memory_reserved`` beside it; model,
  :func:`ring_sp.plan.step_memory.step_memory` for the same recipe (:func:`training`), the
  part above parameters and gradients. Target: within 10% at every length, both libraries.
* ``memory_layers``: the same length on 2 layers and on the line's stack; what the step adds
  differs only by the checkpoints a deeper stack keeps on the device (one more while ring_sp
  prefetches, none for ALST; every layer's on the CPU, where nothing is offloaded), which the
  model counts (:func:`layer_delta`); so the line, measured on fewer layers, is the 2-layer
  model's (:mod:`.longest`).
* ``memory_longest``: each library's line extrapolated to the free memory, confirmed by a
  probe at that length and, where time allows, one 5% longer (:mod:`.longest`).
* ``memory_planner``: the planner's 8-GPU row of README's table (:func:`planner_record`),
  which rests on the constants the ``memory`` rows check on the card.

``--quick`` holds the process to a 20 GiB budget (``set_per_process_memory_fraction``) so its
probes are short; ``--dry`` runs the same code on the CPU at a tiny shape (float32, the CPU
kernel, transformers' modules where Liger would run; :mod:`.seam`'s live-bytes stand-in raises
its out-of-memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp.plan import main as plan_main
from ring_sp.plan.step_memory import Training, Transformer, step_memory

from .alst import AlstRecipe, alst_step
from .llama import TINY, Step, llama_3_8b, ring_sp_step, tokens
from .longest import predict_time, probe_longest
from .preflight import transformers_unsupported
from .seam import Deadline, Seam

Record = dict[str, Any]
LIBRARIES = ("ring_sp", "ALST")
PLANNER_ARGS = ("--model", "llama-3-8b", "--world-size", "8", "--max-seq-len", "--alst")  # README's 8-GPU row


@dataclass(frozen=True)
class MemoryConfig:
    shape: Transformer = llama_3_8b(2)
    seq_lens: tuple[int, ...] = (16384, 32768, 65536, 131072)  # both libraries on ``shape``
    line_lens: tuple[int, ...] = (131072, 262144, 524288)  # the longest-N line, on ``line_layers`` layers
    line_layers: int = 1
    unit: int = 8192  # the longest N in multiples of this
    longer: float = 0.05  # the second probe, this much past the first (expected to fail)
    budget: int | None = None  # the longest N within this many bytes (None: the whole card)
    fits_share: float = 0.9  # a step predicted above this share of the free memory is skipped
    dry_capacity: int = 2**30  # the CPU stand-in's memory (dry mode)

    def line_shape(self) -> Transformer:
        layers = f"{self.line_layers} layer" + ("s" if self.line_layers > 1 else "")
        return dataclasses.replace(self.shape, layers=self.line_layers,
                                   name=self.shape.name.replace(f"{self.shape.layers} layers", layers))


FULL = MemoryConfig()
QUICK = MemoryConfig(seq_lens=(8192, 16384, 32768), line_lens=(32768, 65536, 98304), unit=4096, budget=20 * 2**30)
DRY = MemoryConfig(shape=TINY, seq_lens=(256,), line_lens=(256, 512, 768), unit=64, dry_capacity=4 * 2**20)


def training(library: str, seam: Seam, step: Step | None = None) -> Training:
    """How ``ring_sp.plan.step_memory`` describes ``library``'s recipe on ``seam``'s device: bf16
    and the flash-attention 2 backward on CUDA, float32 and the CPU kernel in the dry run;
    offloaded checkpoints on CUDA only (a CPU tensor stays where it is); ALST with Liger's
    kernels where its step ran them (``step.pieces``)."""
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[seam.dtype]
    common = dict(dtype=dtype, master_weights=False, checkpointing=True, offload_checkpoints=seam.is_cuda,
                  tiled_mlp=True, tiled_loss=True, attention_kernel="flash" if seam.is_cuda else "cpu")
    if library == "ALST":
        liger = step is not None and step.pieces.get("norm_rope") == "Liger"
        return Training(**common, library="alst", kernels="fused" if liger else "hf")
    return Training(**common, lean_layers=True, head_chunks="auto", reuse_on_recompute=False)  # offloading: off


def model_added(shape: Transformer, train: Training, seq_len: int, device_memory: int | None) -> tuple[float, float]:
    """(bytes the step adds above parameters and gradients, parameters + gradients), modelled."""
    s = step_memory(shape, train, seq_len=seq_len, memory_bytes=device_memory)
    return s.checkpoints + s.kept + max(s.phases["loss"], s.phases["layer backward"]), s.params + s.grads


def layer_delta(shape: Transformer, train: Training, seq_len: int, device_memory: int | None, layers: int) -> float:
    """Modelled bytes the step of ``shape`` adds beyond the same step on ``layers`` layers."""
    fewer = dataclasses.replace(shape, layers=layers)
    return (model_added(shape, train, seq_len, device_memory)[0]
            - model_added(fewer, train, seq_len, device_memory)[0])


def build(library: str, seam: Seam, shape: Transformer) -> Step:
    if library == "ALST":
        return alst_step(shape, seam.device, seam.dtype, AlstRecipe())
    return ring_sp_step(shape, seam.device, seam.dtype)


class Runner:
    """One library's stack on the seam's device, plus ``ballast`` bytes held beside it (the
    parameters and gradients a deeper stack would hold); ``step(n)`` runs one forward + backward."""

    def __init__(self, seam: Seam, library: str, shape: Transformer, fits_share: float = MemoryConfig.fits_share
                 ) -> None:
        self.seam, self.library, self.shape, self.fits_share = seam, library, shape, fits_share
        self.step_: Step | None = build(library, seam, shape)
        self.resident = self.step_.resident_bytes()
        self.ballast: torch.Tensor | None = None
        self.training = training(library, seam, self.step_)

    def hold(self, resident: int) -> None:
        """Hold a ballast so that parameters, gradients and ballast take ``resident`` bytes (a
        deeper stack's parameters and gradients: the same free memory as it has)."""
        self.ballast = None
        self.ballast = torch.empty(max(0, resident - self.resident), dtype=torch.uint8, device=self.seam.device)

    def step(self, n: int) -> Record:
        """Measured: ``added_bytes`` (above what was allocated before), ``peak_bytes``,
        ``reserved_bytes``, ``step_s``, ``loss``; or ``out_of_memory`` with the message."""
        seam, step = self.seam, self.step_
        ids = tokens(n, self.shape.vocab, seam.device)
        for p in step.model.parameters():
            p.grad.zero_()
        loss: list[float] = []

        def run() -> None:
            loss.append(step.train(ids))

        failed = None
        try:  # the CPU stand-in holds the step to what is free (CUDA: the allocator does)
            with seam.memory(None if seam.is_cuda else self.free_bytes()) as m:
                seconds = seam.time(run)
        except Exception as exc:  # noqa: BLE001  (anything but running out of memory is raised again)
            failed = seam.out_of_memory_record(exc)
        del ids
        seam.release()
        if failed is not None:
            return {"out_of_memory": failed}
        start = m.start if seam.is_cuda else self.resident + self.ballast_bytes
        return {"added_bytes": m.added, "peak_bytes": start + m.added, "reserved_bytes": m.reserved,
                "start_bytes": start, "step_s": seconds, "loss": loss[0]}

    @property
    def ballast_bytes(self) -> int:
        return 0 if self.ballast is None else self.ballast.numel()

    def free_bytes(self) -> int:
        """Memory a step may add: the capacity (or budget) less what is allocated now."""
        held = self.seam.allocated() if self.seam.is_cuda else self.resident + self.ballast_bytes
        return self.seam.capacity() - held

    def close(self) -> None:
        self.step_ = self.ballast = None
        self.seam.release()


Points = dict[str, list[Record]]  # "library layers" -> its measured steps


def measure(runner: Runner, seq_lens: tuple[int, ...], deadline: Deadline, log: Callable[[str], None],
            points: Points) -> Iterator[Record]:
    """``runner``'s step at each length against the model: a ``memory`` record each (skipped where
    the model says it would not fit in ``fits_share`` of the free memory, or the time cap would pass)."""
    seam, key = runner.seam, f"{runner.library} {runner.shape.layers}"
    for n in seq_lens:
        added, resident = model_added(runner.shape, runner.training, n, seam.device_memory())
        record: Record = {"section": "memory", "library": runner.library, "layers": runner.shape.layers,
                          "seq_len": n, "model": runner.shape.name, "model_added_bytes": added,
                          "model_resident_bytes": resident, "measured_resident_bytes": runner.resident,
                          "ballast_bytes": runner.ballast_bytes}
        cost = predict_time([(r["seq_len"], r["step_s"]) for r in points.get(key, [])], n)
        free = runner.free_bytes()
        if added > runner.fits_share * free:
            yield {**record, "skipped": f"predicted {added / 2**20:,.1f} MiB above the resident state, over "
                                        f"{runner.fits_share:.0%} of the {free / 2**20:,.1f} MiB free"}
            continue
        if not deadline.allows(cost):
            yield {**record, "skipped": f"time cap: predicted {cost:.1f} s, {deadline.left():.0f} s left"}
            continue
        log(f"memory: {runner.library} ({runner.shape.layers} layers) at N={n:,}")
        got = runner.step(n)
        if "step_s" in got:
            got["measured_over_model"] = got["added_bytes"] / added
            points.setdefault(key, []).append({"seq_len": n, **got})
        yield {**record, **got}


def memory(seam: Seam, cfg: MemoryConfig, deadline: Deadline, log: Callable[[str], None]) -> Iterator[Record]:
    """Per library (one stack on the card at a time): its pieces, its steps on ``cfg.shape`` and
    on its line, the layer check; then the longest N of each (:func:`longest`)."""
    if not seam.is_cuda:  # the stand-in's capacity; one thread (tiny ops gain nothing from more, a busy CPU loses)
        seam = Seam(seam.device, cfg.dry_capacity)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield from _memory(seam, cfg, deadline, log)
        finally:
            torch.set_num_threads(threads)
        return
    yield from _memory(seam, cfg, deadline, log)


def _memory(seam: Seam, cfg: MemoryConfig, deadline: Deadline, log: Callable[[str], None]) -> Iterator[Record]:
    unsupported = transformers_unsupported()
    if unsupported:  # ring_sp's register refuses it; ALST's rows would have no ring_sp beside them
        for library in LIBRARIES:
            yield {"section": "memory_longest", "library": library, "skipped": unsupported}
        return
    points: Points = {}
    lines: dict[str, int] = {}  # library -> the 2-layer stack's parameters and gradients
    for library in LIBRARIES:
        try:
            runner = Runner(seam, library, cfg.shape, fits_share=cfg.fits_share)
        except ImportError as exc:  # DeepSpeed (ALST) missing: the rows say which
            yield {"section": "memory_longest", "library": library, "skipped": f"{library}'s recipe cannot be built "
                   f"({type(exc).__name__}: {exc}); bring its wheels with --wheels (docs/benchmarks.md)"}
            continue
        yield {"section": "memory_pieces", "library": library, "name": runner.step_.name, **runner.step_.pieces}
        if seam.is_cuda:
            runner.step(cfg.seq_lens[0])  # warm-up: kernels, allocator, library handles
        yield from measure(runner, cfg.seq_lens, deadline, log, points)
        full_resident = runner.resident
        runner.close()
        line = Runner(seam, library, cfg.line_shape(), fits_share=cfg.fits_share)
        line.hold(full_resident)
        yield from measure(line, cfg.line_lens, deadline, log, points)
        yield layers_record(library, cfg, seam, line.training, points)
        lines[library] = full_resident
        line.close()
    for i, library in enumerate(lines):
        share = Deadline(deadline.left() / (len(lines) - i))
        yield longest(seam, cfg, library, lines[library], points.get(f"{library} {cfg.line_layers}", []), share,
                      log)
    yield planner_record()


def planner_record(argv: tuple[str, ...] = PLANNER_ARGS) -> Record:
    """README's modelled 8-GPU row (``ring-sp plan`` with ``argv``): ALST's longest N on its one
    grid and ring_sp's on its best, from the constants this section checks on the card."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main([*argv, "--json"])
    rows = [r for r in json.loads(out.getvalue())["rows"] if r["status"] == "ok"]
    best = {library: max((r for r in rows if r["library"] == library), key=lambda r: r["longest_sequence"])
            for library in ("ALST", "ring_sp")}
    return {"section": "memory_planner", "planner_command": "ring-sp plan " + " ".join(argv),
            **{f"{name}_longest": r["longest_sequence"] for name, r in best.items()},
            **{f"{name}_grid": f"{r['ulysses']} x {r['ring']}" for name, r in best.items()}}


def longest(seam: Seam, cfg: MemoryConfig, library: str, resident: int, line: list[Record], deadline: Deadline,
            log: Callable[[str], None]) -> Record:
    """``library``'s longest N on the card (or ``cfg.budget``): :func:`.longest.probe_longest` on
    the line's stack holding the 2-layer stack's ``resident`` bytes and, per probe, the device
    checkpoints it would hold beyond the line's (:func:`layer_delta`)."""
    runner = Runner(seam, library, cfg.line_shape(), fits_share=cfg.fits_share)

    def ballast(n: int) -> int:
        extra = layer_delta(cfg.shape, runner.training, n, seam.device_memory(), cfg.line_layers) if n else 0
        return resident + round(extra)

    try:
        with seam.budget(cfg.budget):
            found = probe_longest(runner, line, shape=cfg.shape, unit=cfg.unit, longer=cfg.longer, ballast=ballast,
                                  deadline=deadline, log=log)
    finally:
        runner.close()
    held = None if cfg.budget is None else all(p.get("peak_bytes", 0) <= cfg.budget for p in found["probes"])
    return {**found, "budget_bytes": cfg.budget, "budget_held": held, "line_layers": cfg.line_layers}


def layers_record(library: str, cfg: MemoryConfig, seam: Seam, train: Training, points: Points) -> Record:
    """The same length on ``cfg.shape`` and on the line's stack: measured and modelled difference."""
    full = {r["seq_len"]: r for r in points.get(f"{library} {cfg.shape.layers}", [])}
    line = {r["seq_len"]: r for r in points.get(f"{library} {cfg.line_layers}", [])}
    common = sorted(set(full) & set(line))
    record: Record = {"section": "memory_layers", "library": library, "layers": [cfg.shape.layers, cfg.line_layers]}
    if not common:
        return {**record, "skipped": "no length measured on both stacks"}
    n = common[-1]
    delta = layer_delta(cfg.shape, train, n, seam.device_memory(), cfg.line_layers)
    return {**record, "seq_len": n, "measured_delta_bytes": full[n]["added_bytes"] - line[n]["added_bytes"],
            "model_delta_bytes": delta, "checkpoint_bytes": n * cfg.shape.hidden * torch.empty(
                (), dtype=seam.dtype).element_size()}


__all__ = ["DRY", "FULL", "LIBRARIES", "MemoryConfig", "PLANNER_ARGS", "QUICK", "Runner", "build", "layer_delta",
           "measure", "memory", "model_added", "planner_record", "training"]
