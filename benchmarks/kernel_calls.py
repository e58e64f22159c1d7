"""``python -m benchmarks.kernel_calls``: the attention work and kernel calls of the ring schedules.

For sliding windows and packed documents at ``P`` = 4 and 8 (the ring, and the ``U = 2`` grid),
each kernel family's view of every ring rank's pass, counted by the library
(:func:`ring_sp.schedule.rank_pair_count`, pure: no kernel runs, exact on any machine):

* **cut** (torch's CPU op, the CUDA memory-efficient op, flash-attn < 2.3): no window
  argument, one call per block; bands cut into full, causal and flipped edge squares;
* **bands** (flash-attn >= 2.3 / FA3): each band whole, one call per block;
* **bands + varlen** (torch's CUDA flash op, torch >= 2.5): bands whole and the blocks of a
  step grouped into varlen calls (:func:`ring_sp.schedule.step_calls`).

Columns: score pairs the calls compute / pairs the mask needs (the issue's target: <= 1.10);
the same rounded up to flash-attention's 128 x 64 tiles (a tile with any needed pair is computed
whole, per segment: what small or ragged blocks cost a GPU); kernel calls per rank per step,
the largest and the mean over the steps that compute.

Writes ``kernel_calls.md`` into ``--out`` (default ``benchmarks/results``) and prints it.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch

from ring_sp.schedule import KernelCaps, rank_pair_count

from .document_balance import MIXES, documents
from .schedule_cost import random_boundaries
from .tables import table

CAPS = {"cut": KernelCaps(), "bands": KernelCaps(bands=True), "bands + varlen": KernelCaps(bands=True, varlen=True)}
TILE = (128, 64)  # FlashAttention-2's forward tile for head_dim 128


def boundaries(kind: str, seq_len: int, seed: int) -> tuple[int, ...] | None:
    """None, gpu_check's mix (a document per 16K tokens, random cuts) or short documents (64-512)."""
    if kind == "none":
        return None
    if kind == "per 16K":
        return random_boundaries(seq_len, max(2, seq_len // 16384), seed=seed)
    lengths = documents(MIXES[0], seq_len, seed)
    return tuple(itertools.accumulate([0, *lengths[:-1], seq_len - sum(lengths[:-1])]))


def problems(tokens_per_rank: int, window: int) -> list[tuple[str, str, int | None, str]]:
    """(label, layout, window, documents) of each schedule counted."""
    return [(f"window {window}", layout, window, "none") for layout in ("contiguous", "zigzag", "striped")] + [
        ("packed, a document per 16K", "document_zigzag", None, "per 16K"),
        ("packed, documents of 64-512", "document_zigzag", None, "short"),
        (f"packed (64-512) + window {window}", "document_zigzag", window, "short"),
    ]


def count(layout: str, world_size: int, ulysses: int, tokens_per_rank: int, window: int | None,
          cu: tuple[int, ...] | None, caps: KernelCaps) -> dict[str, float]:
    ring = world_size // ulysses
    local = tokens_per_rank * ulysses  # the ring shard after the all-to-all
    computed = needed = tiled = 0
    calls: list[int] = []
    for rank in range(ring):
        c = rank_pair_count(layout, True, rank, ring, local, cu, window, ulysses_size=ulysses, caps=caps)
        computed, needed = computed + c.computed, needed + c.needed
        tiled += rank_pair_count(layout, True, rank, ring, local, cu, window, ulysses_size=ulysses, caps=caps,
                                 tile=TILE).computed
        calls += [n for n in c.calls if n]
    return {"ratio": computed / needed, "tiled": tiled / needed, "max": max(calls), "mean": statistics.mean(calls)}


def report(tokens_per_rank: int, window: int, world_sizes: tuple[int, ...]) -> list[str]:
    rows = []
    for (label, layout, w, kind), p, u in itertools.product(problems(tokens_per_rank, window), world_sizes, (1, 2)):
        if layout == "striped" and u > 1:
            continue  # striped cannot feed a U x R grid
        cu = boundaries(kind, tokens_per_rank * p, seed=p)
        row = [label, layout, f"U{u}xR{p // u}"]
        for caps in CAPS.values():
            r = count(layout, p, u, tokens_per_rank, w, cu, caps)
            row += [f"{r['ratio']:.2f}", f"{r['tiled']:.2f}", f"{r['max']} / {r['mean']:.1f}"]
        rows.append(row)
    header = ["schedule", "layout", "grid"] + [f"{name}: {col}" for name in CAPS
                                               for col in ("pairs", "tiles", "calls max / mean")]
    return [f"{tokens_per_rank:,} tokens per SP rank, causal; pairs = computed / needed; tiles = computed in "
            f"{TILE[0]}x{TILE[1]} tiles / needed; calls = kernel calls per rank per step (max / mean over the "
            "steps that compute). Counted by `ring_sp.schedule.rank_pair_count`.", ""] + table(header, rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_calls", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-rank", type=int, default=8192)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # many tiny tensor ops: threads only contend
    lines = ["# Kernel calls and attention work of the ring schedules", "",
             f"`python -m benchmarks.kernel_calls --tokens-per-rank {args.tokens_per_rank} --window {args.window} "
             f"--world-sizes {' '.join(map(str, args.world_sizes))}`", ""]
    lines += report(args.tokens_per_rank, args.window, tuple(args.world_sizes))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_calls.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
