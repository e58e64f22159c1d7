"""Section ``efficiency``: the ring schedule's compute against one fused kernel, on one device.

For a ring of ``P`` ranks with ``n`` tokens each (``N = P n``), every rank's forward runs one
rank after another on the one device: :func:`ring_sp.ring.ring_forward` itself, on rank
``r``'s real shards of one global q, k, v (cut by :func:`ring_sp.shard_sequence`), with its
schedule (:func:`ring_sp.schedule.exchange_plan`: the blocks of each step, each through the
kernel's forward returning out + lse, merged into fp32 rows by
:func:`ring_sp.merge.merge_block_`, cast back at the end), and a :class:`Loopback` in place
of the ring that delivers at step ``t`` the rows of rank ``r - t``'s KV shard the step reads
(one copy of the bytes a receive would write; no communication, no overlap to hide): the
compute the schedule costs, and the loop's own overhead. Against it:

* ``zigzag`` (causal): one causal call of the same kernel over all ``N`` tokens; efficiency =
  full / sum (both do the same ``N (N + 1) / 2`` pairs);
* ``window`` (``contiguous``, sliding window ``W``): no fused kernel here takes a window, so
  the ideal is the full causal kernel's rate over the schedule's pairs: full x pairs / causal
  pairs; efficiency = that / sum;
* ``packed`` (``document_zigzag``, random document cuts): one causal kernel call per document,
  summed (what one varlen kernel would do); efficiency = that / sum.

Every record also has ``efficiency_work`` (the full kernel's rate over the schedule's pairs,
for all three alike) and, at the first size of each schedule and ``P``, ``max_abs_diff``
of the assembled output against its baseline's output (the window's against the reference
kernel where that fits). Sizes grow; a point whose predicted time (the last one's, scaled by
its work: ``N^2``, or ``N`` for window and packed) would pass the section's time cap is
recorded as skipped, and one predicted over ``long_point_s`` is timed once without warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp import shard_sequence, unshard_sequence
from ring_sp.comm import PendingExchange
from ring_sp.kernels import get_kernel
from ring_sp.kernels.reference import ReferenceKernel
from ring_sp.ring import RingSpec, ring_forward

from ..schedule_cost import random_boundaries
from ..tables import table
from .seam import Deadline, Seam

Record = dict[str, Any]
SCHEDULES = ("zigzag", "window", "packed")
GROWTH = {"full": 2, "zigzag": 2, "window": 1, "packed": 1}  # how a point's time grows with N (its work)
REFERENCE_LIMIT = 2**28  # score elements of the window's reference check (N^2 x heads)


@dataclass(frozen=True)
class EfficiencyConfig:
    world_sizes: tuple[int, ...] = (4, 8)
    tokens_per_rank: tuple[int, ...] = (8192, 16384, 32768, 65536)
    heads: int = 32  # Llama-3-8B's attention
    kv_heads: int = 8
    head_dim: int = 128
    window: int = 4096
    document_tokens: int = 16384  # packed: N // this documents (at least 2), random cuts
    repeats: int = 2
    long_point_s: float = 4.0  # a point predicted longer than this is timed once, without warm-up


FULL = EfficiencyConfig()
QUICK = EfficiencyConfig(tokens_per_rank=(8192, 16384), repeats=2)
DRY = EfficiencyConfig(tokens_per_rank=(16, 32), heads=4, kv_heads=2, head_dim=16, window=8, document_tokens=24,
                       repeats=1)


def problem(schedule: str, world_size: int, seq_len: int, cfg: EfficiencyConfig
            ) -> tuple[str, tuple[int, ...] | None, int | None]:
    """(layout, document boundaries, window) of a schedule."""
    if schedule == "zigzag":
        return "zigzag", None, None
    if schedule == "window":
        return "contiguous", None, cfg.window
    documents = max(2, seq_len // cfg.document_tokens)
    return "document_zigzag", random_boundaries(seq_len, documents, seed=seq_len + world_size), None


class Loopback:
    """Stands in for :class:`ring_sp.comm.RingComm` for ring rank ``rank`` on one device: the
    exchange of step ``t`` fills the receive buffer with the rows of rank ``r - t``'s shard the
    step reads (what the ring would deliver; one copy of those bytes, as a receive writes them)."""

    def __init__(self, rank: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        self.rank, self.world_size, self.ks, self.vs = rank, len(ks), ks, vs
        self.recv_rows: tuple = ()  # the spec's, set once it is built

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None, kind: str = "ring_kv",
                 offset: int = 1) -> PendingExchange:
        if recv is not None:
            source, (a, b) = (self.rank - offset) % self.world_size, self.recv_rows[offset]
            k, v = self.ks[source][:, a:b], self.vs[source][:, a:b]
            recv[:k.numel()].view_as(k).copy_(k)
            recv[k.numel():].view_as(v).copy_(v)
        return PendingExchange([])


def rank_specs(kernel: Any, scale: float, layout: str, local_len: int, cu_seqlens: tuple[int, ...] | None,
               window: int | None, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> list[RingSpec]:
    """Every ring rank's :class:`RingSpec` (its schedule, built here, outside the timings)."""
    specs = []
    for rank in range(len(ks)):
        comm = Loopback(rank, ks, vs)
        spec = RingSpec(comm, layout, True, kernel, scale, local_len, cu_seqlens, window)  # type: ignore[arg-type]
        comm.recv_rows = spec.recv_rows
        specs.append(spec)
    return specs


def run_rank(spec: RingSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rank ``spec.rank``'s forward: :func:`ring_sp.ring.ring_forward` itself (its blocks, merges
    and final cast), each step's KV delivered by the :class:`Loopback`."""
    return ring_forward(q, k, v, spec)[0]


class _Point:
    """One (tokens per rank, P): the global q, k, v, the full causal kernel's time, and the schedules."""

    def __init__(self, seam: Seam, cfg: EfficiencyConfig, kernel: Any, world_size: int, local_len: int, seed: int):
        self.seam, self.cfg, self.kernel = seam, cfg, kernel
        self.world_size, self.local_len, self.seq_len = world_size, local_len, world_size * local_len
        g = torch.Generator(device=seam.device).manual_seed(seed)
        shape = lambda h: (1, self.seq_len, h, cfg.head_dim)  # noqa: E731
        self.q, self.k, self.v = (torch.randn(shape(h), generator=g, device=seam.device, dtype=seam.dtype)
                                  for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads))
        self.scale = cfg.head_dim ** -0.5

    def timed(self, fn: Callable[[], object], warm: bool, repeats: int) -> tuple[float, list[float]]:
        return self.seam.median_time(fn, repeats, warmup=1 if warm else 0)

    def full(self) -> torch.Tensor:
        return self.kernel.forward(self.q, self.k, self.v, causal=True, scale=self.scale)[0]

    def per_document(self, cu: tuple[int, ...]) -> list[torch.Tensor]:
        """One causal kernel call per document (what one varlen kernel does in one launch)."""
        return [self.kernel.forward(self.q[:, a:b], self.k[:, a:b], self.v[:, a:b], causal=True, scale=self.scale)[0]
                for a, b in zip(cu[:-1], cu[1:])]

    def schedule(self, schedule: str, warm: bool, repeats: int, check: bool) -> Record:
        cfg, p, n = self.cfg, self.world_size, self.local_len
        layout, cu, window = problem(schedule, p, self.seq_len, cfg)
        qs, ks, vs = ([shard_sequence(x, rank=r, world_size=p, layout=layout, cu_seqlens=cu) for r in range(p)]
                      for x in (self.q, self.k, self.v))
        specs = rank_specs(self.kernel, self.scale, layout, n, cu, window, ks, vs)
        per_rank = [self.timed(lambda r=r: run_rank(specs[r], qs[r], ks[r], vs[r]), warm, repeats)[0]
                    for r in range(p)]
        pairs = sum(t.visible_pairs() for spec in specs for tasks in spec.schedule for t in tasks)
        record: Record = {
            "schedule": schedule, "layout": layout, "window": window,
            "documents": None if cu is None else len(cu) - 1, "pairs": pairs,
            "blocks": sum(len(tasks) for spec in specs for tasks in spec.schedule),
            "sum_s": sum(per_rank), "rank_s": per_rank,
        }
        if schedule == "packed":
            record["baseline"] = "one causal kernel call per document"
            record["baseline_s"] = self.timed(lambda: self.per_document(cu), warm, repeats)[0]
        if check:
            outs = [run_rank(specs[r], qs[r], ks[r], vs[r]) for r in range(p)]
            got = unshard_sequence(torch.stack(outs), layout=layout, cu_seqlens=cu)
            want = self.reference(schedule, window, cu)
            record["max_abs_diff"] = None if want is None else (got.float() - want.float()).abs().max().item()
        return record

    def reference(self, schedule: str, window: int | None, cu: tuple[int, ...] | None) -> torch.Tensor | None:
        if schedule == "zigzag":
            return self.full()
        if schedule == "packed":
            return torch.cat(self.per_document(cu), dim=1)
        if self.seq_len ** 2 * self.cfg.heads > REFERENCE_LIMIT:
            return None
        return ReferenceKernel().forward(self.q, self.k, self.v, causal=True, scale=self.scale, window=window)[0]


def efficiency(seam: Seam, cfg: EfficiencyConfig, deadline: Deadline, log: Callable[[str], None]
               ) -> Iterator[Record]:
    """Every schedule at every (tokens per rank, P), smallest first, within ``deadline``; each
    record as soon as it is measured."""
    kernel = get_kernel("auto", seam.device, seam.dtype, cfg.head_dim)
    last: dict[str, tuple[int, float]] = {}  # what -> (N, seconds of its last point): the cost estimate
    seen: set[tuple[str, int]] = set()
    for n in cfg.tokens_per_rank:
        for p in cfg.world_sizes:
            seq_len = n * p
            base: Record = {"section": "efficiency", "world_size": p, "tokens_per_rank": n, "seq_len": seq_len,
                            "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                            "dtype": str(seam.dtype).removeprefix("torch."), "kernel": kernel.name,
                            "causal_pairs": seq_len * (seq_len + 1) // 2}
            est = {what: s * (seq_len / m) ** GROWTH[what] for what, (m, s) in last.items()}
            if not deadline.allows(est.get("full", 0.0) + est.get("zigzag", 0.0)):
                yield from ({**base, "schedule": s, "skipped": f"time cap: predicted {est.get('full', 0):.1f} s for "
                             f"the full kernel alone, {deadline.left():.0f} s left"} for s in SCHEDULES)
                continue
            long = est.get("zigzag", 0.0) > cfg.long_point_s
            warm, repeats = not long, 1 if long else cfg.repeats
            log(f"efficiency: {n} tokens per rank, P={p} (N={seq_len})")
            started = deadline.left()
            point = _Point(seam, cfg, kernel, p, n, seed=seq_len)
            full_s, _ = point.timed(point.full, warm, repeats)
            last["full"] = (seq_len, started - deadline.left())
            for schedule in SCHEDULES:
                if not deadline.allows(est.get(schedule, 0.0)):
                    yield {**base, "schedule": schedule, "skipped": f"time cap: predicted "
                           f"{est[schedule]:.1f} s, {deadline.left():.0f} s left"}
                    continue
                check = (schedule, p) not in seen
                seen.add((schedule, p))
                started = deadline.left()
                r = {**base, **point.schedule(schedule, warm, repeats, check), "full_s": full_s}
                last[schedule] = (seq_len, started - deadline.left())
                r["efficiency_work"] = full_s * r["pairs"] / base["causal_pairs"] / r["sum_s"]
                if schedule == "zigzag":
                    r.update(baseline="one causal kernel call over N", baseline_s=full_s)
                elif schedule == "window":
                    r.update(baseline="the causal kernel's rate over the schedule's pairs",
                             baseline_s=full_s * r["pairs"] / base["causal_pairs"])
                r["efficiency"] = r["baseline_s"] / r["sum_s"]
                r["sum_tflops"] = 4 * r["pairs"] * cfg.head_dim * cfg.heads / r["sum_s"] / 1e12
                yield r
            del point
            seam.release()


def markdown(records: list[Record]) -> list[str]:
    """The section's table: one row per schedule, P and tokens per rank."""
    rows = [r for r in records if r["section"] == "efficiency" and "schedule" in r]  # not a section's crash
    if not rows:
        return []
    body = []
    for r in rows:
        if "skipped" in r:
            body.append([r["schedule"], str(r["world_size"]), f"{r['tokens_per_rank']:,}", f"{r['seq_len']:,}",
                         r["skipped"], "", "", "", "", ""])
            continue
        diff = r.get("max_abs_diff")
        body.append([r["schedule"], str(r["world_size"]), f"{r['tokens_per_rank']:,}", f"{r['seq_len']:,}",
                     f"{r['baseline_s'] * 1e3:.2f}", f"{r['sum_s'] * 1e3:.2f}", f"**{r['efficiency']:.3f}**",
                     f"{r['efficiency_work']:.3f}", f"{r['sum_tflops']:.3g}",
                     "-" if diff is None or math.isnan(diff) else f"{diff:.1e}"])
    first = rows[0]
    return [f"Forward of every rank's block schedule, one rank after another on one device ({first['kernel']} "
            f"kernel, {first['heads']} q / {first['kv_heads']} kv heads x {first['head_dim']}, {first['dtype']}), "
            "against its baseline (zigzag: one causal kernel over N; window: that kernel's rate over the schedule's "
            "pairs; packed: one causal kernel per document). Efficiency = baseline / sum; work = the full kernel's "
            "rate over the schedule's pairs / sum.", ""] + table(
        ["schedule", "P", "tokens/rank", "N", "baseline ms", "sum of blocks ms", "efficiency", "work eff.",
         "TFLOP/s", "max abs diff"], body)
