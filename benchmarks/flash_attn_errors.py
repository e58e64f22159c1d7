"""``python -m benchmarks.flash_attn_errors [release ...]``: max errors of ``backend="flash_attn"``
against the float64 oracle on CPU, through flash-attn's double (``tests/flash_attn_double.py``),
per release, mode and dtype (the cases of ``tests/test_flash_attn_double.py``'s sweep).

Ring over 4 ranks (every layout, causal and not, GQA, windows, packed documents, sinks),
Ulysses over 4, the U2 x R2 grid; bf16 and fp16 (flash-attn takes no fp32). Prints a markdown
table of the largest |error| over ranks and cases for out, dq, dk, dv, and the largest share
of the ratio rule's bound (2 x the same kernel on one device + one rounding step per ring step)
any of them used. Default releases: 2.1 (no window argument) and 2.7 (the newest signature).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from dist_cases import check_attention_cases
    from flash_attn_double import run_installed
    from harness import PoolManager
    from test_flash_attn_double import _dist_cases

    releases = sys.argv[1:] or ["2.1", "2.7"]
    pools = PoolManager(max_alive=1)
    names = ("out", "dq", "dk", "dv")
    rows = ["| release | mode | dtype | cases | out | dq | dk | dv | of bound |", "|---|---|---|---|---|---|---|---|---|"]
    try:
        for release in releases:
            cases = _dist_cases(4, ("bf16", "fp16"), full=True)
            per_rank = pools.get(4).run(run_installed, release, check_attention_cases, cases, timeout=1800)
            for mode in ("ring", "ulysses", "hybrid"):
                for dtype in ("bf16", "fp16"):
                    picked = [i for i, c in enumerate(cases) if c.mode == mode and c.dtype == dtype]
                    results = [errors[i] for errors in per_rank for i in picked]
                    worst = [max(e[n] for e in results) for n in names]
                    share = max(e[f"{n} of bound"] for e in results for n in names)
                    rows.append(f"| {release} | {mode} | {dtype} | {len(picked)} | "
                                + " | ".join(f"{w:.1e}" for w in worst) + f" | {share:.2f} |")
    finally:
        pools.close()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
