"""``python -m benchmarks.gpu_check``: what a few minutes of one GPU should measure (issue 32).

    python -m benchmarks.gpu_check --out $OUT --wheels .whl           # one H100/H200: within 9 minutes
    python -m benchmarks.gpu_check --quick --out $OUT --wheels .whl   # within 3 minutes
    python -m benchmarks.gpu_check --dry --out /tmp/gpu_check         # CPU, tiny sizes: every code path (CI)

Sections, in order of value, each under its own time cap and all under ``--budget`` (seconds
from the start; a section gets at most its cap's share of what is left): ``step`` (the whole
step with ring_sp's defaults against ALST's modules and untiled, with its top kernels),
``efficiency`` (each backend's attention rate against cuDNN SDPA, then the ring schedule's
blocks against one fused kernel, forward and backward, packed documents of a real length
distribution among them), ``kernel_tests`` (tests/test_kernels_cuda.py) and ``memory`` (the
whole-step memory model against the allocator on transformers' Llama through ring_sp's and
ALST's recipes, then each one's longest N on the card, whose probes stop at the section's
deadline and record how far they got). The memory section runs last: its probes run the
card out of memory on purpose, and a run cut short has the timed sections already.
Writes into
``--out`` (default ``$OUT``): ``gpu_check.jsonl`` (one JSON record per line, each written as
it is measured), ``gpu_check.md`` (the card and the tables, rewritten after each section)
and ``kernel_tests.log``. What a section cannot run (pytest, DeepSpeed, Liger missing) is named
before anything runs and recorded as skipped; it exits 1 only if a section raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .checkout import integrations_from_checkout

# Before any section is imported: on the GPU machine ring_sp runs from this checkout, not
# installed, and ring_sp.integrations exists only once integrations/ is mapped there.
INTEGRATIONS_MAPPED = integrations_from_checkout()

from ..tables import table  # noqa: E402
from . import efficiency, kernel_tests, memory, memory_report, step  # noqa: E402
from .preflight import card, card_markdown, install_wheels, missing  # noqa: E402
from .seam import Deadline, Seam  # noqa: E402

Record = dict[str, Any]
SECTIONS = ("step", "efficiency", "kernel_tests", "memory")
CAPS = {  # seconds per section: full within 9 minutes on an H100 (with start-up), quick within 3
    "full": {"step": 110, "efficiency": 110, "kernel_tests": 50, "memory": 170},
    "quick": {"step": 35, "efficiency": 35, "kernel_tests": 25, "memory": 60},
    "dry": {"step": 60, "efficiency": 60, "kernel_tests": 60, "memory": 60},
}
BUDGETS = {"full": 500.0, "quick": 170.0, "dry": None}  # seconds for the whole run, start-up included
CONFIGS = {"full": (memory.FULL, efficiency.FULL, step.FULL), "quick": (memory.QUICK, efficiency.QUICK, step.QUICK),
           "dry": (memory.DRY, efficiency.DRY, step.DRY)}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="folder for gpu_check.jsonl / .md (default $OUT)")
    p.add_argument("--wheels", type=Path, help="folder of wheels to install first (those not installed already)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and modes: within 3 minutes on an H100")
    p.add_argument("--dry", action="store_true", help="on the CPU at tiny sizes (CI): every section's code path")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    for name in SECTIONS:
        p.add_argument(f"--cap-{name.replace('_', '-')}", type=float, help=f"seconds for {name} (default per mode)")
    p.add_argument("--budget", type=float, help="seconds for the whole run from its start (default: 500 full, 170 quick, "
                                                "none dry); each section gets at most its cap's share of what is left")
    args = p.parse_args(argv)
    if args.out is None:
        p.error("--out is required when $OUT is not set")
    return args


class Results:
    """Records as they come: appended to the JSON lines file at once, kept for the summary."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path, self.records = out / "gpu_check.jsonl", []
        self.path.write_text("")

    def add(self, records: list[Record]) -> None:
        with self.path.open("a") as f:
            for r in records:
                f.write(json.dumps(r, default=str) + "\n")
        self.records += records


def section_command(name: str, mode: str, args: argparse.Namespace) -> str:
    flags = {"full": "", "quick": " --quick", "dry": " --dry"}[mode]
    wheels = f" --wheels {args.wheels}" if args.wheels else ""
    return f"python -m benchmarks.gpu_check --sections {name}{flags}{wheels} --out {args.out}"


def section_cap(caps: dict[str, float], remaining: list[str], left: float | None) -> float:
    """The first of ``remaining`` sections' seconds: its cap, or its cap's share of the ``left``
    budget when the caps of every remaining section would not fit (never below 1 s)."""
    cap = caps[remaining[0]]
    if left is None:
        return cap
    return max(1.0, min(cap, left * cap / sum(caps[name] for name in remaining)))


def run_section(name: str, seam: Seam, mode: str, deadline: Deadline, log: Callable[[str], None],
                out: Path) -> Iterable[Record]:
    memory_cfg, efficiency_cfg, step_cfg = CONFIGS[mode]
    if name == "kernel_tests":
        return kernel_tests.kernel_tests(seam, mode, deadline, log, out / "kernel_tests.log")
    if name == "memory":
        return memory.memory(seam, memory_cfg, deadline, log)
    if name == "step":
        return step.step(seam, step_cfg, deadline, log)
    return efficiency.efficiency(seam, efficiency_cfg, deadline, log)


def targets(records: list[Record]) -> list[list[str]]:
    """(target, measured, verdict) rows for the summary."""
    rows = []
    verdict = {True: "met", False: "**not met**"}
    tests = [r for r in records if r["section"] == "kernel_tests" and "counts" in r]
    for r in tests:
        bad = r["counts"].get("failed", 0) + r["counts"].get("errors", 0)
        rows.append(["CUDA kernel tests pass", r["summary"] or r.get("error", ""), verdict[bad == 0 and "error" not in r]])
    rows += efficiency.targets(records) + step.targets(records) + memory_report.targets(records)
    return rows


def summary(records: list[Record], elapsed: dict[str, Any]) -> str:
    cards = [r for r in records if r["section"] == "card"]
    lines = ["# gpu_check", ""] + (card_markdown(cards[0], elapsed) if cards else []) + [""]
    parts = (("CUDA kernel tests", kernel_tests.markdown),
             ("Attention rate and schedule efficiency", efficiency.markdown),
             ("Step time", step.markdown),
             ("Step memory: model against the allocator", memory_report.markdown))
    for title, render in parts:
        body = render(records)
        if body:
            lines += [f"## {title}", ""] + body + [""]
    errors = [r for r in records if "error" in r and r["section"] in SECTIONS and "counts" not in r]
    for r in errors:
        lines += [f"**{r['section']} failed**: {r['error']}", ""]
    found = targets(records)
    if found:
        lines += ["## Targets", ""] + table(["target", "measured", ""], found) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    mode = "dry" if args.dry else "quick" if args.quick else "full"
    if not args.dry:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts
    else:  # tiny ops: waking a pool of threads for each costs more than the op (10x on a busy machine)
        torch.set_num_threads(1)
    wheels = install_wheels(args.wheels) if args.wheels else None
    seam = Seam.open(args.dry)
    caps = {name: getattr(args, f"cap_{name}") or CAPS[mode][name] for name in args.sections}
    skips = missing(args.sections)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", flush=True)

    if INTEGRATIONS_MAPPED:
        log("ring_sp is not installed: integrations/ imported as ring_sp.integrations from this checkout")
    for row, reason in skips.items():
        log(f"will skip {row}: {reason}")
    results = Results(args.out)
    command = " ".join(["python -m benchmarks.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    results.add([card(seam, command, mode, caps, wheels, skips)])
    elapsed: dict[str, Any] = {}
    failed = False
    budget = args.budget if args.budget is not None else BUDGETS[mode]
    for at, name in enumerate(args.sections):
        begin = time.monotonic()
        status = "done"
        cap = section_cap(caps, args.sections[at:], None if budget is None else budget - (begin - started))
        try:  # records are written as they come: a failure keeps what was measured before it
            for r in run_section(name, seam, mode, Deadline(cap), log, args.out):
                results.add([{**r, "command": section_command(name, mode, args)}])
        except Exception as exc:  # noqa: BLE001  (one section's failure is recorded; the next still runs)
            traceback.print_exc()
            status, failed = "raised", True
            results.add([{"section": name, "error": f"{type(exc).__name__}: {exc}"[:500],
                          "command": section_command(name, mode, args)}])
        seam.release()  # what a section left cached (the step section's four models) goes back before the next
        elapsed[name] = {"elapsed_s": time.monotonic() - begin, "cap_s": cap, "status": status,
                         "command": section_command(name, mode, args)}
        results.add([{"section": "section_time", "name": name, **elapsed[name]}])
        (args.out / "gpu_check.md").write_text(summary(results.records, elapsed))
        log(f"{name}: {elapsed[name]['elapsed_s']:.1f} s ({status}); wrote {args.out / 'gpu_check.md'}")
    print(summary(results.records, elapsed))
    total = time.monotonic() - started
    log(f"done in {total:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
