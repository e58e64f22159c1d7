"""What the default per-call agreement costs against the attention it guards (issue 31).

With default settings every attention call first runs :func:`ring_sp.agreement.agree`: one
``all_gather`` of a fixed 32-int64 row over the SP group and one host sync. This measures,
on ``U x R`` gloo CPU ranks (default U2 x R2, 8 heads of 64, fp32, 4096 tokens per rank,
causal zigzag), on the same ranks:

* the agreement alone: ``--agree-calls`` calls in a row, median per call (the slowest rank);
* the attention's forward + backward with the default (agreement on every call) and with
  ``validate=False`` (the agreement cached after the first call), in interleaved rounds
  (A B, B A, ...), each step's time the slowest rank's; the median of the per-round ratios.

The first is the cost itself; the second checks it end to end (its noise on shared cores is
larger than the cost). Prints both; docs/robustness.md holds the figures and the NCCL model.

    python -m benchmarks.agreement_cost [--tokens-per-rank 4096] [--rounds 6] [--agree-calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import ring_sp
from ring_sp.agreement import CallSignature, agree

from .launch import launcher, sp_group


def measure(ulysses: int, ring: int, tokens_per_rank: int, heads: int, head_dim: int, rounds: int,
            agree_calls: int) -> dict[str, Any]:
    """On every rank: seconds per agreement call, and per fwd+bwd step of each variant, per round."""
    topo = ring_sp.init_sequence_parallel(ulysses, ring)
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, tokens_per_rank, heads, head_dim, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(1, tokens_per_rank, heads, head_dim, generator=g)

    def step(validate: bool | None) -> float:
        dist.barrier(group=sp_group())
        start = time.perf_counter()
        out = ring_sp.hybrid_attention(q, k, v, topology=topo, causal=True, layout="zigzag", validate=validate)
        out.backward(dout)
        seconds = time.perf_counter() - start
        q.grad = k.grad = v.grad = None
        return seconds

    step(None), step(False)  # warm-up: kernels, schedules, the opt-out's cached agreement
    times: dict[str, list[float]] = {"default": [], "opt_out": []}
    for r in range(rounds):
        for name in (("default", "opt_out") if r % 2 == 0 else ("opt_out", "default")):
            times[name].append(step(None if name == "default" else False))
    signature = CallSignature.of(q, k, v, causal=True, layout="zigzag", softmax_scale=None, backend="auto",
                                 ulysses_size=ulysses, ring_size=ring)
    calls = []
    dist.barrier(group=sp_group())
    for _ in range(agree_calls):
        start = time.perf_counter()
        agree(topo.sp_group, signature, None, always=True, device=q.device)
        calls.append(time.perf_counter() - start)
    return {"steps": times, "agree": calls}


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    """The slowest rank per step / per call; medians; the median per-round ratio."""
    def slowest(key: str) -> list[float]:
        return [max(values) for values in zip(*(res["steps"][key] for res in results))]

    default, opt_out = slowest("default"), slowest("opt_out")
    agree_each = [max(values) for values in zip(*(res["agree"] for res in results))]
    agree_s = statistics.median(agree_each)
    step_s = statistics.median(opt_out)
    return {"agree_s": agree_s, "default_s": statistics.median(default), "opt_out_s": step_s,
            "round_ratio": statistics.median(d / o for d, o in zip(default, opt_out)),
            "agree_fraction": agree_s / step_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agreement_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ulysses", type=int, default=2)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--agree-calls", type=int, default=200)
    args = p.parse_args(argv)
    run = launcher()
    try:
        results = run.run(measure, args.ulysses * args.ring, args.ulysses, args.ring, args.tokens_per_rank, args.heads,
                          args.head_dim, args.rounds, args.agree_calls)
    finally:
        run.close()
    if not run.is_leader:
        return
    s = summarize(results)
    print(f"U{args.ulysses} x R{args.ring}, {args.heads} heads x {args.head_dim}, {args.tokens_per_rank} tokens per rank, "
          f"fp32 causal zigzag, fwd+bwd; {args.rounds} interleaved rounds, {args.agree_calls} agreement calls")
    print(f"  agreement alone (median per call, slowest rank): {s['agree_s'] * 1e6:9.0f} us")
    print(f"  attention fwd+bwd, validate=False (median):      {s['opt_out_s']:9.3f} s")
    print(f"  attention fwd+bwd, default (median):             {s['default_s']:9.3f} s")
    print(f"  agreement / attention:                           {s['agree_fraction'] * 100:9.4f} %")
    print(f"  default / validate=False (median of rounds):     {s['round_ratio']:9.4f}")


if __name__ == "__main__":
    main()
