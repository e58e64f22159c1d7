"""Section ``efficiency``: the attention rate, then the ring schedule against one fused kernel,
forward and backward, per backend, on one device.

First :mod:`.attention_rate` (each backend's single causal call at 32K against cuDNN SDPA).
Then, for a ring of ``P`` ranks with ``n`` tokens each (``N = P n``) and every fused backend of
ring_sp that runs here (:func:`.attention_rate.available_backends`), every rank's
:func:`ring_sp.ring.ring_forward` and :func:`ring_sp.ring.ring_backward` run one rank after
another on rank ``r``'s real shards of one global q, k, v and output gradient (cut by
:func:`ring_sp.shard_sequence`), each step's KV delivered by :mod:`.loopback` (no
communication, no overlap to hide): the compute the schedule costs, and the loops' own
overhead. Against it, the same backend's kernel:

* ``zigzag`` (causal): one causal call over all ``N`` tokens, forward and backward; efficiency
  = full / sum (both do the same ``N (N + 1) / 2`` pairs);
* ``window`` (``contiguous``, sliding window ``W``): no fused kernel here takes a window, so
  the ideal is the full causal kernel's rate over the schedule's pairs: full x pairs / causal
  pairs; efficiency = that / sum;
* ``packed`` (``document_zigzag``, random document cuts): one causal call per document,
  summed (what one varlen kernel would do); efficiency = that / sum;
* ``packed_real`` (``document_balanced``, documents of ProLong's published length statistics,
  ``benchmarks.packed``): the same baseline; what users' packed batches cost.

Every record also has ``efficiency_work`` per direction (the full kernel's rate over the
schedule's pairs, for all three alike) and, at the first size of each schedule, ``P`` and
backend, the check of the assembled output (``max_abs_diff``) and of every rank's dq, dk, dv
(``grad_max_rel_diff``: over the reference's largest entry; the loopback collects the dK/dV
partials so they are exact) against the baseline's (the window's: the reference kernel's
where that fits). Sizes grow; a point whose predicted time (the backend's last one's, scaled
by its work: ``N^2``, or ``N`` for window and packed) would pass the section's time cap is
recorded as skipped, and one predicted over ``long_point_s`` is timed once after its warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ring_sp import shard_sequence, unshard_sequence
from ring_sp.kernels import AttentionKernel, get_kernel
from ring_sp.kernels.reference import ReferenceKernel
from ring_sp.ring import ring_forward

from .. import packed
from ..schedule_cost import random_boundaries
from ..tables import table
from . import attention_rate
from .loopback import ring_grads, ring_outputs, ring_rank_backward, rank_specs
from .seam import Deadline, Seam

Record = dict[str, Any]
SCHEDULES = ("zigzag", "window", "packed", "packed_real")
DIRECTIONS = ("forward", "backward")
FLOPS_PER_PAIR = {"forward": 4, "backward": 4 * attention_rate.BACKWARD_FLOPS}  # x head_dim x heads
GROWTH = {"full": 2, "zigzag": 2, "window": 1, "packed": 1, "packed_real": 1}  # how a point's time grows with N
REFERENCE_LIMIT = 2**28  # score elements of the window's reference check (N^2 x heads)
EFFICIENCY_TARGETS = {"zigzag": 0.95, "window": 0.85, "packed": 0.85, "packed_real": 0.85}
ZIGZAG_TARGET_TOKENS = 16384  # zigzag's target holds at >= this many tokens per rank


@dataclass(frozen=True)
class EfficiencyConfig:
    world_sizes: tuple[int, ...] = (4, 8)
    tokens_per_rank: tuple[int, ...] = (8192, 16384)
    heads: int = 32  # Llama-3-8B's attention
    kv_heads: int = 8
    head_dim: int = 128
    window: int = 4096
    document_tokens: int = 16384  # packed: N // this documents (at least 2), random cuts
    real_lengths: str = "prolong"  # packed_real: documents of this benchmarks.packed distribution, document_balanced
    repeats: int = 2
    long_point_s: float = 4.0  # a point predicted longer than this is timed once (after its warm-up)
    rate_tokens: int = 32768  # the attention rate's single causal call
    rate_repeats: int = 3
    rate_also: tuple[str, ...] = ()  # rated besides the fused backends (dry: "reference", so the order has two)


FULL = EfficiencyConfig()
QUICK = EfficiencyConfig(world_sizes=(4,))
DRY = EfficiencyConfig(tokens_per_rank=(16, 32), heads=4, kv_heads=2, head_dim=16, window=8, document_tokens=24,
                       repeats=1, rate_tokens=64, rate_repeats=1, rate_also=("reference",))


def problem(schedule: str, world_size: int, seq_len: int, cfg: EfficiencyConfig
            ) -> tuple[str, tuple[int, ...] | None, int | None]:
    """(layout, document boundaries, window) of a schedule."""
    if schedule == "zigzag":
        return "zigzag", None, None
    if schedule == "window":
        return "contiguous", None, cfg.window
    if schedule == "packed_real":  # whole documents where they fit, as users pack them
        return "document_balanced", packed.pack(cfg.real_lengths, seq_len, seed=world_size), None
    documents = max(2, seq_len // cfg.document_tokens)
    return "document_zigzag", random_boundaries(seq_len, documents, seed=seq_len + world_size), None


def _rel_diff(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Max over tensors of the largest error over the reference's largest entry."""
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp(min=1e-30)).item()
               for g, w in zip(got, want))


class _Point:
    """One (tokens per rank, P): the global q, k, v and output gradient, and their shards per layout."""

    def __init__(self, seam: Seam, cfg: EfficiencyConfig, world_size: int, local_len: int) -> None:
        self.seam, self.cfg = seam, cfg
        self.world_size, self.local_len, self.seq_len = world_size, local_len, world_size * local_len
        g = torch.Generator(device=seam.device).manual_seed(self.seq_len)
        shape = lambda h: (1, self.seq_len, h, cfg.head_dim)  # noqa: E731
        self.q, self.k, self.v, self.dout = (torch.randn(shape(h), generator=g, device=seam.device, dtype=seam.dtype)
                                             for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads, cfg.heads))
        self.scale = cfg.head_dim ** -0.5
        self._shards: dict[tuple, tuple[list[torch.Tensor], ...]] = {}

    def shards(self, layout: str, cu: tuple[int, ...] | None) -> tuple[list[torch.Tensor], ...]:
        """(qs, ks, vs, douts): every rank's shard of each, cut once per layout."""
        if (layout, cu) not in self._shards:
            self._shards[layout, cu] = tuple(
                [shard_sequence(x, rank=r, world_size=self.world_size, layout=layout, cu_seqlens=cu)
                 for r in range(self.world_size)] for x in (self.q, self.k, self.v, self.dout))
        return self._shards[layout, cu]


class _Backend:
    """One backend at one point: its causal kernel over N (and per document), and the schedules."""

    def __init__(self, point: _Point, name: str, kernel: AttentionKernel, repeats: int) -> None:
        self.point, self.name, self.kernel, self.repeats = point, name, kernel, repeats
        self.full_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.full_grads: tuple[torch.Tensor, ...] | None = None
        self.full_s: dict[str, float] = {}

    def timed(self, fn: Callable[[], object]) -> float:
        """Median seconds of ``repeats`` calls (the caller's first call was the warm-up)."""
        return self.point.seam.median_time(fn, self.repeats, warmup=0)[0]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernel.forward(q, k, v, causal=True, scale=self.point.scale)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return self.kernel.backward(dout, q, k, v, *out, causal=True, scale=self.point.scale)

    def full(self) -> None:
        """The causal kernel over all N tokens: output, gradients, and their times."""
        p = self.point
        self.full_out = self.forward(p.q, p.k, p.v)  # the warm-up, kept for the checks
        self.full_grads = self.backward(p.dout, p.q, p.k, p.v, self.full_out)
        self.full_s = {"forward": self.timed(lambda: self.forward(p.q, p.k, p.v)),
                       "backward": self.timed(lambda: self.backward(p.dout, p.q, p.k, p.v, self.full_out))}

    def per_document(self, cu: tuple[int, ...]) -> tuple[dict[str, float], torch.Tensor, list[torch.Tensor]]:
        """One causal call per document, forward and backward: (times, output, gradients)."""
        p, docs = self.point, list(zip(cu[:-1], cu[1:]))
        parts = lambda x: [x[:, a:b] for a, b in docs]  # noqa: E731
        qs, ks, vs, douts = parts(p.q), parts(p.k), parts(p.v), parts(p.dout)
        outs = [self.forward(*x) for x in zip(qs, ks, vs)]
        grads = [self.backward(*x) for x in zip(douts, qs, ks, vs, outs)]
        times = {"forward": self.timed(lambda: [self.forward(*x) for x in zip(qs, ks, vs)]),
                 "backward": self.timed(lambda: [self.backward(*x) for x in zip(douts, qs, ks, vs, outs)])}
        return times, torch.cat([o for o, _ in outs], dim=1), [torch.cat(g, dim=1) for g in zip(*grads)]

    def schedule(self, schedule: str, check: bool) -> Record:
        """Every rank's forward and backward of ``schedule``, its baseline, and (``check``) the check."""
        p, cfg = self.point, self.point.cfg
        layout, cu, window = problem(schedule, p.world_size, p.seq_len, cfg)
        qs, ks, vs, douts = p.shards(layout, cu)
        specs = rank_specs(self.kernel, p.scale, layout, p.local_len, cu, window, ks, vs)
        outputs = ring_outputs(specs, qs, ks, vs)  # the warm-up, and the backward's out and lse
        rank_s = {"forward": [self.timed(lambda r=r: ring_forward(qs[r], ks[r], vs[r], specs[r]))
                              for r in range(p.world_size)]}
        backward = lambda r: ring_rank_backward(specs[r], douts[r], qs[r], ks[r], vs[r], *outputs[r])  # noqa: E731
        if check:  # the warm-up, with the dK/dV partials collected
            grads = ring_grads(specs, douts, qs, ks, vs, outputs)
        else:
            for r in range(p.world_size):
                backward(r)
        rank_s["backward"] = [self.timed(lambda r=r: backward(r)) for r in range(p.world_size)]
        pairs = sum(t.visible_pairs() for spec in specs for tasks in spec.schedule for t in tasks)
        causal_pairs = p.seq_len * (p.seq_len + 1) // 2
        record: Record = {"schedule": schedule, "layout": layout, "window": window,
                          "documents": None if cu is None else len(cu) - 1, "pairs": pairs,
                          "causal_pairs": causal_pairs,
                          "blocks": sum(len(tasks) for spec in specs for tasks in spec.schedule)}
        if schedule in ("packed", "packed_real"):
            baseline_s, want_out, want_grads = self.per_document(cu)  # type: ignore[arg-type]
            record["baseline"] = "one causal kernel call per document"
        elif schedule == "zigzag":
            assert self.full_out is not None and self.full_grads is not None  # full() ran first
            baseline_s, want_out, want_grads = self.full_s, self.full_out[0], list(self.full_grads)
            record["baseline"] = "one causal kernel call over N"
        else:
            baseline_s = {d: s * pairs / causal_pairs for d, s in self.full_s.items()}
            want_out, want_grads = self.window_reference(window) if check else (None, None)  # type: ignore[arg-type]
            record["baseline"] = "the causal kernel's rate over the schedule's pairs"
        for d in DIRECTIONS:
            total = sum(rank_s[d])
            record[d] = {"baseline_s": baseline_s[d], "sum_s": total, "rank_s": rank_s[d],
                         "efficiency": baseline_s[d] / total,
                         "efficiency_work": self.full_s[d] * pairs / causal_pairs / total,
                         "tflops": FLOPS_PER_PAIR[d] * pairs * cfg.head_dim * cfg.heads / total / 1e12}
        if check:
            got_out = unshard_sequence(torch.stack([o for o, _ in outputs]), layout=layout, cu_seqlens=cu)
            got_grads = [unshard_sequence(torch.stack(g), layout=layout, cu_seqlens=cu) for g in zip(*grads)]
            record["max_abs_diff"] = (None if want_out is None
                                      else (got_out.float() - want_out.float()).abs().max().item())
            record["grad_max_rel_diff"] = None if want_grads is None else _rel_diff(got_grads, want_grads)
        return record

    def window_reference(self, window: int) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """The window's output and gradients by the reference kernel, where its masks fit."""
        p = self.point
        if p.seq_len ** 2 * p.cfg.heads > REFERENCE_LIMIT:
            return None, None
        ref = ReferenceKernel()
        out = ref.forward(p.q, p.k, p.v, causal=True, scale=p.scale, window=window)
        grads = ref.backward(p.dout, p.q, p.k, p.v, *out, causal=True, scale=p.scale, window=window)
        return out[0], list(grads)


def efficiency(seam: Seam, cfg: EfficiencyConfig, deadline: Deadline, log: Callable[[str], None]
               ) -> Iterator[Record]:
    """The attention rate, then every schedule at every (tokens per rank, P) and backend,
    smallest first, within ``deadline``; each record as soon as it is measured."""
    names, unavailable = attention_rate.available_backends(seam.device, seam.dtype, cfg.head_dim)
    rated = names + [n for n in cfg.rate_also if n not in names]
    yield from attention_rate.attention_rate(seam, cfg.rate_tokens, cfg.heads, cfg.kv_heads, cfg.head_dim, rated,
                                             unavailable, cfg.rate_repeats, log)
    seam.release()
    kernels = {name: get_kernel(name, seam.device, seam.dtype, cfg.head_dim) for name in names}
    last: dict[tuple[str, str], tuple[int, float]] = {}  # (backend, what) -> (N, seconds of its last point)
    seen: set[tuple[str, int, str]] = set()
    for n in cfg.tokens_per_rank:
        for p in cfg.world_sizes:
            point = None
            for name in names:
                seq_len = n * p
                base: Record = {"section": "efficiency", "world_size": p, "tokens_per_rank": n, "seq_len": seq_len,
                                "heads": cfg.heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                                "dtype": str(seam.dtype).removeprefix("torch."), "backend": name}
                est = {what: s * (seq_len / m) ** GROWTH[what] for (b, what), (m, s) in last.items() if b == name}
                if not deadline.allows(est.get("full", 0.0) + est.get("zigzag", 0.0)):
                    yield from ({**base, "schedule": s, "skipped": f"time cap: predicted {est.get('full', 0):.1f} s "
                                 f"for the full kernel alone, {deadline.left():.0f} s left"} for s in SCHEDULES)
                    continue
                point = point or _Point(seam, cfg, p, n)
                log(f"efficiency: {name}, {n} tokens per rank, P={p} (N={seq_len})")
                backend = _Backend(point, name, kernels[name], 1 if est.get("zigzag", 0.0) > cfg.long_point_s
                                   else cfg.repeats)
                started = deadline.left()
                backend.full()
                last[name, "full"] = (seq_len, started - deadline.left())
                for schedule in SCHEDULES:
                    if not deadline.allows(est.get(schedule, 0.0)):
                        yield {**base, "schedule": schedule, "skipped": f"time cap: predicted "
                               f"{est[schedule]:.1f} s, {deadline.left():.0f} s left"}
                        continue
                    check = (name, p, schedule) not in seen
                    seen.add((name, p, schedule))
                    started = deadline.left()
                    yield {**base, **backend.schedule(schedule, check)}
                    last[name, schedule] = (seq_len, started - deadline.left())
                del backend
            del point
            seam.release()


def markdown(records: list[Record]) -> list[str]:
    """The attention rate's table, then one row per schedule, P, tokens per rank and backend."""
    out = attention_rate.markdown(records)
    rows = [r for r in records if r["section"] == "efficiency" and "schedule" in r]  # not a section's crash
    if not rows:
        return out
    body = []
    for r in rows:
        cells = [r["schedule"], str(r["world_size"]), f"{r['tokens_per_rank']:,}", f"{r['seq_len']:,}",
                 f"`{r['backend']}`"]
        if "skipped" in r:
            body.append(cells + [r["skipped"]] + [""] * 8)
            continue
        for d in DIRECTIONS:
            x = r[d]
            cells += [f"{x['baseline_s'] * 1e3:.2f}", f"{x['sum_s'] * 1e3:.2f}", f"**{x['efficiency']:.3f}**",
                      f"{x['tflops']:.3g}"]
        diffs = [r.get("max_abs_diff"), r.get("grad_max_rel_diff")]
        cells.append(" / ".join("-" if x is None or math.isnan(x) else f"{x:.1e}" for x in diffs))
        body.append(cells)
    first = next(r for r in rows)
    out += ["" if out else None, f"Forward and backward of every rank's block schedule, one rank after another on one "
            f"device ({first['heads']} q / {first['kv_heads']} kv heads x {first['head_dim']}, {first['dtype']}; "
            "`ring_forward` / `ring_backward` with a loopback for the ring), against the same backend's baseline "
            "(zigzag: one causal call over N; window: that call's rate over the schedule's pairs; packed and packed_real: "
            "one causal call per document). Efficiency = baseline / sum of the ranks; TFLOP/s over the schedule's pairs. Check "
            "(first size of each): output max abs diff / gradients' max error over the largest entry.", ""]
    out += table(["schedule", "P", "tokens/rank", "N", "backend", "fwd baseline ms", "fwd sum ms", "fwd eff.",
                  "fwd TFLOP/s", "bwd baseline ms", "bwd sum ms", "bwd eff.", "bwd TFLOP/s", "check"], body)
    return [line for line in out if line is not None]


def targets(records: list[Record]) -> list[list[str]]:
    """(target, measured, verdict) rows: each schedule's efficiency, forward and backward, for the
    backend ``auto`` picks (the others: the table), and the attention rate's."""
    rows = attention_rate.targets(records)
    verdict = {True: "met", False: "**not met**"}
    auto = next((r["auto_backend"] for r in records if r["section"] == "attention_rate" and "auto_backend" in r), None)
    if not any(r["section"] == "efficiency" for r in records):
        return rows
    eff = [r for r in records if r["section"] == "efficiency" and "forward" in r and r["backend"] == auto]
    for schedule, goal in EFFICIENCY_TARGETS.items():
        mine = [r for r in eff if r["schedule"] == schedule]
        if schedule == "zigzag":
            mine = [r for r in mine if r["tokens_per_rank"] >= ZIGZAG_TARGET_TOKENS]
        where = " at >= 16K tokens per rank" if schedule == "zigzag" else ""
        for d in DIRECTIONS:
            name = f"{schedule} schedule efficiency, {d}, >= {goal}{where} (`{auto}`)"
            if not mine:
                rows.append([name, "no point measured", "unmeasured"])
                continue
            values = ", ".join(f"P={r['world_size']} n={r['tokens_per_rank']:,}: {r[d]['efficiency']:.3f}"
                               for r in mine)
            rows.append([name, values, verdict[min(r[d]["efficiency"] for r in mine) >= goal]])
    return rows
