"""What the benchmark runs, section by section; each section returns flat JSON records.

Sections: ``timing`` (every mode and DeepSpeed against one rank, sequence-length sweep),
``profile`` (bytes vs the design formulas, causal work per rank), ``memory`` (peak per
rank while N grows at fixed P and while P grows at fixed N), ``activations`` (memory an
attention layer keeps between forward and backward, plain and checkpointed, vs the planner), ``overlap`` (an injected
link delay), ``heads`` (fewer heads than ranks: who runs, and exactly?), ``kv_exchange`` (all-gathered KV
against the ring, :mod:`.kv_exchange`) and ``length`` (the whole training step of a small HF Llama as N grows,
tiled and untiled, against DeepSpeed ALST, in live tensor bytes (:mod:`.length`) and in peak RSS
(:mod:`.length_rss`), written to length.*).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ring_sp.plan import attention_memory

from .cases import activation_case, exactness_case, overlap_case, profile_case, timing_case
from .comm_bytes import formula_bytes
from .kv_exchange import kv_exchange
from .launch import Launcher
from .length_rss import length_section
from .modes import DEEPSPEED, SINGLE, Mode, Problem, comparison_modes
from .schedule_cost import measure
from .timing import rank_balance, slowest_rank, step_time

Record = dict[str, Any]


@dataclass(frozen=True)
class Config:
    world_size: int  # P of the timing, profile and overlap sections
    seq_lens: tuple[int, ...]  # timing sweep
    profile_seq_len: int
    memory_seq_lens: tuple[int, ...]  # at world_size
    memory_world_sizes: tuple[int, ...]  # at memory_seq_len
    memory_seq_len: int
    overlap_seq_len: int
    overlap_delays: tuple[float, ...]  # injected delay per exchange, in units of one ring step's compute
    warmup: int
    repeats: int
    problem: Problem  # heads, head_dim, dtype, ...; seq_len is set per run
    backend: str = "auto"
    schedule_tokens_per_rank: int = 8192  # packed schedule build cost, at P = 8
    schedule_documents: int = 1000
    ulysses_seq_lens: tuple[int, ...] = (4096, 8192)  # Ulysses vs DeepSpeed head-shape sweep, 2 ranks
    ulysses_rounds: int = 5


QUICK = Config(4, (256, 512), 512, (256, 512, 1024), (1, 2, 4), 1024, 1024, (1.0,), 1, 3, Problem(0),
               schedule_tokens_per_rank=1024, schedule_documents=125, ulysses_seq_lens=(256,), ulysses_rounds=2)
FULL = Config(4, (1024, 2048, 4096, 8192), 4096, (2048, 4096, 8192, 16384), (1, 2, 4, 8), 8192, 8192,
              (0.5, 1.0, 2.0), 1, 9, Problem(0))


def _memory_modes(world_size: int) -> list[Mode]:
    if world_size == 1:
        return [SINGLE]
    return [m for m in comparison_modes(world_size) if m.kind != "ring" or m.layout == "zigzag"]


def _per_mode(results: list[dict[str, dict[str, Any]]], name: str) -> list[dict[str, Any]] | str:
    """Every rank's result for one mode, or the error message if the mode refused."""
    per_rank = [r[name] for r in results]
    return per_rank[0]["error"] if "error" in per_rank[0] else per_rank


def timing(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    records = []
    p = cfg.world_size
    for n in cfg.seq_lens:
        problem = replace(cfg.problem, seq_len=n)
        log(f"timing N={n}: 1 rank")
        single = run.run(timing_case, 1, problem, [SINGLE], cfg.warmup, cfg.repeats, cfg.backend)[0][SINGLE.name]
        base = {"fwd_s": statistics.median(single["fwd"]), "fwd_bwd_s": statistics.median(single["fwd_bwd"]),
                "fwd_repeats_s": single["fwd"], "fwd_bwd_repeats_s": single["fwd_bwd"]}
        records.append({"section": "timing", "mode": SINGLE.name, "seq_len": n, "world_size": 1, **base})
        log(f"timing N={n}: {p} ranks, every mode")
        modes = comparison_modes(p)
        results = run.run(timing_case, p, problem, modes, cfg.warmup, cfg.repeats, cfg.backend)
        for mode in modes:
            per_rank = _per_mode(results, mode.name)
            record: Record = {"section": "timing", "mode": mode.name, "seq_len": n, "world_size": p}
            if isinstance(per_rank, str):
                records.append({**record, "error": per_rank})
                continue
            fwd, fwd_bwd = step_time([r["fwd"] for r in per_rank]), step_time([r["fwd_bwd"] for r in per_rank])
            records.append({
                **record, "fwd_s": fwd, "fwd_bwd_s": fwd_bwd,
                "fwd_repeats_s": slowest_rank([r["fwd"] for r in per_rank]),
                "fwd_bwd_repeats_s": slowest_rank([r["fwd_bwd"] for r in per_rank]),
                "speedup_fwd": base["fwd_s"] / fwd, "speedup_fwd_bwd": base["fwd_bwd_s"] / fwd_bwd,
                "efficiency_fwd_bwd": base["fwd_bwd_s"] / (p * fwd_bwd),
                "rank_time_max_over_mean": rank_balance([r["fwd_bwd"] for r in per_rank]),
                "tokens_per_s": n / fwd_bwd,
            })
    return records


def _formula(mode: Mode, problem: Problem, world_size: int) -> tuple[int, int]:
    u, r = mode.grid(world_size)
    return formula_bytes(ulysses=u, ring=r, batch=problem.batch, local_len=problem.seq_len // world_size,
                         heads=problem.heads, kv_heads=problem.kv_heads, head_dim=problem.head_dim,
                         dtype=problem.dtype)


def _profile_records(run: Launcher, problem: Problem, world_size: int, modes: list[Mode], backend: str,
                     section: str) -> list[Record]:
    results = run.run(profile_case, world_size, problem, modes, backend)
    records = []
    for mode in modes:
        per_rank = _per_mode(results, mode.name)
        u, r = mode.grid(world_size)
        record: Record = {"section": section, "mode": mode.name, "seq_len": problem.seq_len, "world_size": world_size,
                          "ulysses": u, "ring": r, "heads": problem.heads, "kv_heads": problem.kv_heads}
        if isinstance(per_rank, str):
            records.append({**record, "error": per_rank})
            continue
        scores = [r["scores"] for r in per_rank]
        fwd_formula, bwd_formula = _formula(mode, problem, world_size) if mode.kind != "single" else (0, 0)
        records.append({
            **record,
            "bytes_fwd": max(sum(r["bytes_fwd"].values()) for r in per_rank),
            "bytes_bwd": max(sum(r["bytes_bwd"].values()) for r in per_rank),
            "bytes_fwd_formula": fwd_formula, "bytes_bwd_formula": bwd_formula,
            "bytes_by_kind_fwd": per_rank[0]["bytes_fwd"], "bytes_by_kind_bwd": per_rank[0]["bytes_bwd"],
            "work_max_over_mean": max(scores) / (sum(scores) / len(scores)),
            "peak_bytes": max(r["peak_bytes"] for r in per_rank),
            "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        })
    return records


def profile(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    log(f"profile N={cfg.profile_seq_len}: bytes, work, memory of every mode on {cfg.world_size} ranks")
    problem = replace(cfg.problem, seq_len=cfg.profile_seq_len)
    return _profile_records(run, problem, cfg.world_size, comparison_modes(cfg.world_size), cfg.backend, "profile")


def memory(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    records = []
    for n in cfg.memory_seq_lens:
        log(f"memory: N={n} on {cfg.world_size} ranks")
        problem = replace(cfg.problem, seq_len=n)
        records += _profile_records(run, problem, cfg.world_size, _memory_modes(cfg.world_size), cfg.backend,
                                    "memory_vs_seq_len")
    for p in cfg.memory_world_sizes:
        log(f"memory: N={cfg.memory_seq_len} on {p} ranks")
        problem = replace(cfg.problem, seq_len=cfg.memory_seq_len)
        records += _profile_records(run, problem, p, _memory_modes(p), cfg.backend, "memory_vs_world_size")
    return records


def _attention_memory(mode: Mode, problem: Problem, world_size: int):
    u, r = mode.grid(world_size)
    return attention_memory(ulysses=u, ring=r, batch=problem.batch, local_len=problem.seq_len // world_size,
                            heads=problem.heads, kv_heads=problem.kv_heads, head_dim=problem.head_dim,
                            dtype=problem.dtype)


def model_peak_bytes(mode: Mode, problem: Problem, world_size: int) -> int:
    """The planner's minimum peak of :func:`~.cases.activation_case`'s plain layer on one rank:
    kept + working (``ring_sp.plan.attention_memory``), the layer's output, and (ring
    only: Ulysses frees it before its all-to-alls) the incoming gradient the ring's node holds."""
    model = _attention_memory(mode, problem, world_size)
    out = problem.batch * (problem.seq_len // world_size) * problem.heads * problem.head_dim * problem.torch_dtype.itemsize
    u, _ = mode.grid(world_size)
    return model.kept + model.working + out + (out if u == 1 else 0)


def activations(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    """Memory one attention layer keeps per rank between forward and backward, and its peak,
    plain and under activation checkpointing, against ``ring_sp.plan.attention_memory``."""
    records = []
    p = cfg.world_size
    modes = [m for m in _memory_modes(p) if m.kind != "single"]
    for n in cfg.memory_seq_lens:
        log(f"activations: N={n} on {p} ranks, plain and checkpointed")
        problem = replace(cfg.problem, seq_len=n)
        results = run.run(activation_case, p, problem, modes, cfg.backend)
        for mode in modes:
            per_rank = _per_mode(results, mode.name)
            record: Record = {"section": "activations", "mode": mode.name, "seq_len": n, "world_size": p}
            if isinstance(per_rank, str):
                records.append({**record, "error": per_rank})
                continue
            for kind in ("plain", "checkpointed"):
                suffix = "" if kind == "plain" else "_checkpointed"
                record["kept_bytes" + suffix] = max(r[kind]["kept_bytes"] for r in per_rank)
                record["peak_bytes" + suffix] = max(r[kind]["peak_bytes"] for r in per_rank)
            if mode.kind != "deepspeed":
                model = _attention_memory(mode, problem, p)
                record.update(model_kept_bytes=model.kept, model_kept_bytes_checkpointed=model.kept_checkpointed,
                              model_peak_bytes=model_peak_bytes(mode, problem, p))
            records.append(record)
    return records


def overlap(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    """Ring (zigzag) step time with every exchange delayed, against compute alone (the same
    call without delay, alternated with it) and the delay alone (the call on 2P tokens,
    where compute is negligible)."""
    p, mode = cfg.world_size, Mode("ring zigzag", "ring", "zigzag")
    problem, tiny = replace(cfg.problem, seq_len=cfg.overlap_seq_len), replace(cfg.problem, seq_len=2 * p)
    log(f"overlap N={problem.seq_len}: one ring step's compute")
    plain = run.run(timing_case, p, problem, [mode], cfg.warmup, cfg.repeats, cfg.backend)
    step_compute = step_time([r[mode.name]["fwd"] for r in plain]) / p  # a balanced forward ring step
    records = []
    for multiple in cfg.overlap_delays:
        delay = multiple * step_compute
        log(f"overlap: {delay * 1e3:.1f} ms per exchange, alone and with compute")
        alone = run.run(timing_case, p, tiny, [mode], cfg.warmup, cfg.repeats, cfg.backend, delay)
        both = run.run(overlap_case, p, problem, mode, delay, cfg.warmup, cfg.repeats, cfg.backend)
        t = {key: step_time([r[key] for r in both]) for key in both[0]}
        comm = {kind: step_time([r[mode.name][kind] for r in alone]) for kind in ("fwd", "fwd_bwd")}
        step_fwd, step_bwd = t["fwd"] / p, (t["fwd_bwd"] - t["fwd"]) / p
        # A perfect pipeline still computes its last step with nothing in flight, and backward's last
        # [dk; dv] hop home starts after the last compute: the best the ring's schedule can do.
        fwd_ideal = (p - 1) * max(step_fwd, delay) + step_fwd
        pipeline = {"fwd": fwd_ideal, "fwd_bwd": fwd_ideal + (p - 1) * max(step_bwd, delay) + step_bwd + delay}
        for kind in ("fwd", "fwd_bwd"):
            bound = max(t[kind], comm[kind])
            records.append({
                "section": "overlap", "mode": mode.name, "seq_len": problem.seq_len, "world_size": p, "pass": kind,
                "delay_s": delay, "delay_over_step_compute": multiple, "compute_s": t[kind], "comm_s": comm[kind],
                "measured_s": t[kind + "_delayed"], "max_s": bound, "sum_s": t[kind] + comm[kind],
                "pipeline_s": pipeline[kind], "measured_over_max": t[kind + "_delayed"] / bound,
            })
    return records


HEAD_CASES = (Problem(64, heads=2, kv_heads=2, head_dim=16, dtype="float64"),
              Problem(64, heads=8, kv_heads=2, head_dim=16, dtype="float64"))


def heads(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    """Fewer (KV) heads than ranks: DeepSpeed refuses; our grid (and Ulysses with KV
    replication, where the q heads split) is exact against one rank, in float64."""
    p = cfg.world_size
    modes = [DEEPSPEED, Mode("Ulysses", "ulysses", "zigzag"), Mode("hybrid U=2", "hybrid", "zigzag", 2),
             Mode("ring zigzag", "ring", "zigzag")]
    records = []
    for problem in HEAD_CASES:
        log(f"heads: {problem.heads} q / {problem.kv_heads} kv heads on {p} ranks")
        results = run.run(exactness_case, p, problem, modes, cfg.backend)
        for mode in modes:
            per_rank = _per_mode(results, mode.name)
            record: Record = {"section": "heads", "mode": mode.name, "heads": problem.heads,
                              "kv_heads": problem.kv_heads, "world_size": p, "seq_len": problem.seq_len}
            if isinstance(per_rank, str):
                records.append({**record, "error": per_rank})
            else:
                records.append({**record, **{k: max(r[k] for r in per_rank) for k in ("out", "dq", "dk", "dv")}})
    return records


def schedule(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    """The packed schedule's one build per distinct ``cu_seqlens`` against one layer's
    attention on ring rank 0 of P = 8 (:mod:`.schedule_cost`; one process, the leader)."""
    if not run.is_leader:
        return []
    log(f"schedule: build cost at P=8, {cfg.schedule_tokens_per_rank} tokens per rank, "
        f"{cfg.schedule_documents} documents")
    result = measure(8, cfg.schedule_tokens_per_rank, cfg.schedule_documents, cfg.problem.heads,
                     cfg.problem.kv_heads, cfg.problem.head_dim, cfg.repeats, cfg.problem.dtype)
    return [{"section": "schedule", **result}]


ULYSSES_HEADS = ((8, 8), (8, 4), (32, 8))  # (q heads, kv heads): MHA and GQA


def ulysses(run: Launcher, cfg: Config, log: Callable[[str], None]) -> list[Record]:
    """Our Ulysses against DeepSpeed's DistributedAttention on 2 ranks for MHA and GQA head
    shapes: ``ulysses_rounds`` rounds of ``repeats`` calls, the two modes alternating call by
    call; per round the ratio of medians (ours / DeepSpeed), then the median over rounds."""
    modes = [Mode("Ulysses", "ulysses", "contiguous"), DEEPSPEED]
    records = []
    for heads, kv_heads in ULYSSES_HEADS:
        for n in cfg.ulysses_seq_lens:
            problem = replace(cfg.problem, seq_len=n, heads=heads, kv_heads=kv_heads)
            log(f"ulysses: {heads}/{kv_heads} heads, N={n}, {cfg.ulysses_rounds} rounds on 2 ranks")
            ratios: dict[str, list[float]] = {"fwd": [], "fwd_bwd": []}
            medians: dict[str, list[float]] = {f"{m.name} {k}": [] for m in modes for k in ratios}
            for _ in range(cfg.ulysses_rounds):
                results = run.run(timing_case, 2, problem, modes, cfg.warmup, cfg.repeats, cfg.backend)
                if any("error" in results[0][m.name] for m in modes):
                    break
                for kind in ratios:
                    ours, theirs = (step_time([r[m.name][kind] for r in results]) for m in modes)
                    ratios[kind].append(ours / theirs)
                    medians[f"{modes[0].name} {kind}"].append(ours)
                    medians[f"{modes[1].name} {kind}"].append(theirs)
            if not ratios["fwd"]:
                continue
            records.append({
                "section": "ulysses", "heads": heads, "kv_heads": kv_heads, "seq_len": n, "world_size": 2,
                "rounds": len(ratios["fwd"]),
                **{f"ours_over_deepspeed_{k}": statistics.median(v) for k, v in ratios.items()},
                **{f"ours_over_deepspeed_{k}_rounds": v for k, v in ratios.items()},
                "ours_fwd_bwd_s": statistics.median(medians["Ulysses fwd_bwd"]),
                "deepspeed_fwd_bwd_s": statistics.median(medians[f"{DEEPSPEED.name} fwd_bwd"]),
            })
    return records


SECTIONS: dict[str, Callable[[Launcher, Config, Callable[[str], None]], list[Record]]] = {
    "timing": timing, "profile": profile, "memory": memory, "activations": activations, "overlap": overlap,
    "heads": heads, "schedule": schedule, "ulysses": ulysses, "kv_exchange": kv_exchange, "length": length_section,
}
