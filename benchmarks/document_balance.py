"""Per-rank causal work with packed documents: plain layouts vs ``document_zigzag``.

Counts the (query, key) pairs each ring rank computes (``ring_sp.schedule``) for three
document-length mixes and prints max/mean per layout (1.00 = perfectly balanced):

    python benchmarks/document_balance.py [--seq-len 65536] [--world-sizes 4 8 16]
"""

from __future__ import annotations

import argparse
import random

from ring_sp.schedule import causal_work_per_rank

MIXES = ("short (64-512)", "lognormal (median ~1.1K, long tail)", "one half-length + short")


def draw(mix: str, rng: random.Random, seq_len: int, first: bool) -> int:
    """One document length of ``mix`` for a ``seq_len``-token packed sequence."""
    if mix == MIXES[0]:
        return rng.randint(64, 512)
    if mix == MIXES[1]:
        return int(rng.lognormvariate(7.0, 1.2)) + 1
    return seq_len // 2 if first else rng.randint(32, 1024)


def documents(mix: str, seq_len: int, multiple: int, seed: int = 0) -> tuple[int, ...]:
    """Boundaries of documents drawn from ``mix``, each rounded up to ``multiple`` tokens
    (the padding ``document_zigzag`` needs), truncated to ``seq_len``."""
    rng = random.Random(seed)
    cu = [0]
    while cu[-1] < seq_len:
        length = -(-draw(mix, rng, seq_len, first=len(cu) == 1) // multiple) * multiple
        cu.append(min(seq_len, cu[-1] + length))
    return tuple(cu)


def balance(layout: str, world_size: int, seq_len: int, cu: tuple[int, ...]) -> float:
    work = causal_work_per_rank(layout, world_size, seq_len // world_size, True, cu)
    return max(work) / (sum(work) / world_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8, 16])
    args = p.parse_args()
    layouts = ("contiguous", "zigzag", "striped", "document_zigzag")
    print(f"causal work max/mean per rank, {args.seq_len} tokens (1.00 = balanced)\n")
    print(f"| mix | P | docs | {' | '.join(layouts)} |")
    print(f"|---|---|---|{'---|' * len(layouts)}")
    for mix in MIXES:
        for world_size in args.world_sizes:
            cu = documents(mix, args.seq_len, 2 * world_size)  # the same padded documents for every layout
            cells = " | ".join(f"{balance(layout, world_size, args.seq_len, cu):.3f}" for layout in layouts)
            print(f"| {mix} | {world_size} | {len(cu) - 1} | {cells} |")


if __name__ == "__main__":
    main()
