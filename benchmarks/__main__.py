"""``python -m benchmarks``: ring_sp's modes side by side with DeepSpeed Ulysses.

    python -m benchmarks --quick                 # small sizes, about a minute on 2 cores
    python -m benchmarks                         # the full run behind docs/benchmarks.md
    torchrun --nproc-per-node 8 -m benchmarks    # the same on NCCL GPUs (or gloo CPUs)

Writes results.jsonl, results.md and PNG plots into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from . import plots
from .launch import launcher
from .length import plot as length_plot
from .length_rss import section_markdown as length_markdown
from .report import markdown, write_jsonl
from .suite import FULL, QUICK, SECTIONS


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--world-size", type=int, help="ranks of the timing/profile/overlap sections (default 4)")
    p.add_argument("--seq-lens", type=int, nargs="+", help="timing sweep (default: per --quick)")
    p.add_argument("--repeats", type=int, help="timed repeats after warm-up (median reported)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--backend", default="auto", help="ring_sp kernel backend, the same for every mode")
    return p.parse_args(argv)


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    cfg = QUICK if args.quick else FULL
    gpu = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    problem = replace(cfg.problem, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                      dtype=args.dtype or ("bfloat16" if gpu else "float32"))
    cfg = replace(cfg, problem=problem, backend=args.backend,
                  world_size=args.world_size or cfg.world_size, seq_lens=tuple(args.seq_lens or cfg.seq_lens),
                  repeats=args.repeats or cfg.repeats)
    run = launcher()
    started, load_before = time.time(), _load()

    def log(message: str) -> None:
        if run.is_leader:
            print(f"[{time.time() - started:7.1f} s] {message}", flush=True)

    records = []
    try:
        for name in args.sections:
            records += SECTIONS[name](run, cfg, log)
    finally:
        run.close()
    if not run.is_leader:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # the length section has its own files (it takes an hour; the other sections' results stay)
    whole_step = [r for r in records if r["section"].startswith("length")]
    records = [r for r in records if not r["section"].startswith("length")]
    if whole_step:
        write_jsonl(whole_step, args.out / "length.jsonl")
        (args.out / "length.md").write_text(length_markdown(whole_step))
        length_plot(whole_step, args.out / "length.png")
        log(f"wrote {args.out}: length.jsonl, length.md, length.png")
    if not records:
        return
    write_jsonl(records, args.out / "results.jsonl")
    figures = [plots.throughput(records, args.out / "throughput.png"),
               plots.memory_vs_world_size(records, args.out / "memory_vs_world_size.png"),
               plots.memory_checkpointing(records, args.out / "memory_checkpointing.png"),
               plots.overlap(records, args.out / "overlap.png")]
    machine = (f"{torch.cuda.get_device_name()} GPUs, NCCL" if gpu else
               f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), gloo ranks with 1 thread each")
    command = " ".join(["python -m benchmarks", *(sys.argv[1:] if argv is None else argv)])
    header = [
        f"* Run {datetime.datetime.now():%Y-%m-%d %H:%M}, `{command}`, {time.time() - started:.0f} s.",
        f"* Machine: {machine}; torch {torch.__version__}; load average (1/5/15 min) {load_before} before, "
        f"{_load()} after (this run's own ranks included).",
        f"* Problem: {problem.heads} q / {problem.kv_heads} kv heads x {problem.head_dim}, batch {problem.batch}, "
        f"{problem.dtype}, {'causal' if problem.causal else 'non-causal'}; {cfg.world_size} ranks unless stated; "
        f"median of {cfg.repeats} repeats after {cfg.warmup} warm-up.",
    ]
    (args.out / "results.md").write_text(markdown(records, header))
    log(f"wrote {args.out}: " + ", ".join(["results.jsonl", "results.md"] + [f.name for f in figures if f is not None]))


if __name__ == "__main__":
    main()
