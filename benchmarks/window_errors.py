"""``python -m benchmarks.window_errors``: max errors of sliding-window attention against the
float64 oracle, per dtype and mode (the test suite's cases, ``tests/dist_cases.py``).

Ring over 4 ranks (every layout), Ulysses over 4, the U2 x R2 grid; windows 1, inside a
chunk, one shard, more than a shard, the whole sequence; with and without packed documents.
Prints a markdown table of the largest |error| over ranks and cases for out, dq, dk, dv.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from dist_cases import AttnCase, check_attention_cases
    from harness import PoolManager

    modes = {"ring R4": ("ring", 1, 4, ("contiguous", "zigzag", "striped")),
             "ulysses U4": ("ulysses", 4, 1, ("contiguous", "zigzag", "striped")),
             "grid U2xR2": ("hybrid", 2, 2, ("contiguous", "zigzag"))}
    pools = PoolManager(max_alive=1)
    rows = ["| mode | dtype | cases | out | dq | dk | dv |", "|---|---|---|---|---|---|---|"]
    try:
        for label, (mode, u, r, layouts) in modes.items():
            for dtype in ("fp64", "fp32", "bf16"):
                cases = [AttnCase(mode, layout, True, 1, 16, 8, 2, 32, dtype, seed=i, ulysses=u, ring=r, window=w,
                                  packed=packed)
                         for i, (layout, w, packed) in enumerate(itertools.product(layouts, (1, 5, 16, 23, 64),
                                                                                   (False, True)))]
                per_rank = pools.get(4).run(check_attention_cases, cases, timeout=900)
                worst = {name: max(e[name] for errors in per_rank for e in errors) for name in ("out", "dq", "dk", "dv")}
                rows.append(f"| {label} | {dtype} | {len(cases)} | " + " | ".join(f"{worst[n]:.1e}" for n in worst) + " |")
    finally:
        pools.close()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
