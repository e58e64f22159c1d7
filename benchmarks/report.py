"""Results on disk: ``results.jsonl`` (one record per line), ``results.md`` (the tables and
the targets of issue 6 with their measured values).

The report imports the sections' own renderers (:func:`.kv_exchange.kv_exchange_table`) and
the shared formatter (:mod:`.tables`); no section imports the report."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .kv_exchange import kv_exchange_table
from .tables import MiB, Record, select, table


def write_jsonl(records: Iterable[Record], path: Path) -> None:
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _modes(records: list[Record]) -> list[str]:
    return list(dict.fromkeys(r["mode"] for r in records))


def _spread(values: list[float]) -> float:
    """max/min - 1: how far a quantity that should be constant strays."""
    return max(values) / min(values) - 1


def timing_tables(records: list[Record]) -> list[str]:
    rows = select(records, "timing")
    if not rows:
        return []
    seq_lens = sorted({r["seq_len"] for r in rows})
    parallel = [m for m in _modes(rows) if m != "1 rank"]
    cell = {(r["mode"], r["seq_len"]): r for r in rows}
    p = next(r["world_size"] for r in rows if r["world_size"] > 1)
    out = [f"Speedup over one rank holding the whole sequence, forward / forward+backward, and in brackets the "
           f"forward+backward parallel efficiency (speedup / {p}; on CPU ranks its ceiling is min(cores, P) / P):", ""]
    body = []
    for mode in parallel:
        cells = []
        for n in seq_lens:
            r = cell.get((mode, n), {})
            cells.append(f"{r['speedup_fwd']:.2f} / {r['speedup_fwd_bwd']:.2f} ({r['efficiency_fwd_bwd']:.2f})"
                         if "speedup_fwd_bwd" in r else "refused")
        body.append([mode] + cells)
    out += table(["mode"] + [f"N={n}" for n in seq_lens], body)
    out += ["", "Time relative to DeepSpeed Ulysses on the same problem, forward / forward+backward (< 1 = faster):", ""]
    body = []
    for mode in parallel:
        cells = []
        for n in seq_lens:
            r, ds = cell.get((mode, n), {}), cell.get(("DeepSpeed Ulysses", n), {})
            ok = "fwd_s" in r and "fwd_s" in ds
            cells.append(f"{r['fwd_s'] / ds['fwd_s']:.2f} / {r['fwd_bwd_s'] / ds['fwd_bwd_s']:.2f}" if ok else "-")
        body.append([mode] + cells)
    return out + table(["mode"] + [f"N={n}" for n in seq_lens], body)


def profile_table(records: list[Record]) -> list[str]:
    rows = select(records, "profile")
    if not rows:
        return []
    timing = {r["mode"]: r for r in select(records, "timing", seq_len=rows[0]["seq_len"])}
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["mode"], r["error"]] + [""] * 6)
            continue
        balance = timing.get(r["mode"], {}).get("rank_time_max_over_mean")
        body.append([
            r["mode"], f"{r['work_max_over_mean']:.3f}", f"{balance:.2f}" if balance else "-",
            f"{r['bytes_fwd']:,}", f"{r['bytes_fwd'] / r['bytes_fwd_formula']:.4f}" if r["bytes_fwd_formula"] else "-",
            f"{r['bytes_bwd']:,}", f"{r['bytes_bwd'] / r['bytes_bwd_formula']:.4f}" if r["bytes_bwd_formula"] else "-",
            f"{r['peak_bytes'] / MiB:.1f}",
        ])
    n, p = rows[0]["seq_len"], rows[0]["world_size"]
    return [f"N={n} on {p} ranks. Work: attention scores each rank computes, counted at the kernel calls. Bytes: the "
            "most any rank sends per layer, counted at the communication calls, and measured/formula (DESIGN section "
            "5). Peak: the most memory the call adds on any rank.", ""] + table(
        ["mode", "causal work max/mean", "rank time max/mean", "bytes fwd", "/ formula", "bytes bwd", "/ formula",
         "peak MiB/rank"], body)


def _replicates_kv(record: Record) -> bool:
    """Ulysses with more ranks than KV heads gives each rank a whole KV head (by design), so
    its KV memory stops falling with P."""
    return record["kv_heads"] % record["ulysses"] != 0


def _memory_cell(record: Record | None) -> str:
    if record is None:
        return "-"
    if "error" in record:
        return "refused"
    return f"{record['peak_bytes'] / MiB:.1f}{'*' if _replicates_kv(record) else ''}"


def _per_token_spread(rows: list[Record]) -> float | None:
    """Spread of peak x P / N over the points with P >= 2 that do not replicate KV heads."""
    values = [r["peak_bytes"] * r["world_size"] / r["seq_len"] for r in rows
              if "peak_bytes" in r and r["world_size"] > 1 and not _replicates_kv(r)]
    return _spread(values) if len(values) > 1 else None


def memory_tables(records: list[Record]) -> list[str]:
    out = []
    for section, axis, label in (("memory_vs_seq_len", "seq_len", "N"), ("memory_vs_world_size", "world_size", "P")):
        rows = select(records, section)
        if not rows:
            continue
        points = sorted({r[axis] for r in rows})
        cell = {(r["mode"], r[axis]): r for r in rows}
        body = []
        for mode in _modes(rows):
            spread = _per_token_spread([r for r in rows if r["mode"] == mode])
            body.append([mode] + [_memory_cell(cell.get((mode, x))) for x in points]
                        + [f"{spread:.1%}" if spread is not None else "-"])
        fixed = f"P={rows[0]['world_size']}" if axis == "seq_len" else f"N={rows[0]['seq_len']}"
        out += [f"Peak memory added per rank (MiB) at {fixed}; spread = max/min - 1 of peak x P / N over the points "
                "with P >= 2 (* = more Ulysses ranks than KV heads: each rank holds a whole KV head, by design; "
                "not in the spread):", ""]
        out += table(["mode"] + [f"{label}={x}" for x in points] + ["spread"], body) + [""]
    return out[:-1]


def overlap_table(records: list[Record]) -> list[str]:
    rows = select(records, "overlap")
    if not rows:
        return []
    body = [[r["pass"], f"{r['delay_over_step_compute']:.1f}", f"{r['comm_s'] / r['compute_s']:.2f}",
             f"{r['measured_s'] / r['compute_s']:.2f}", f"{r['sum_s'] / r['max_s']:.2f}",
             f"{r['pipeline_s'] / r['max_s']:.2f}", f"**{r['measured_over_max']:.3f}**",
             f"{r['measured_s'] / r['pipeline_s']:.3f}"] for r in rows]
    return [f"Ring (zigzag), N={rows[0]['seq_len']} on {rows[0]['world_size']} ranks, every exchange delayed by a "
            "multiple of one forward ring step's compute. Times relative to compute alone (no delay); comm alone: the "
            "same call on 2P tokens, where compute is negligible; max = max(compute, comm). Pipeline: the best the "
            "ring's schedule allows, (R-1) max(step, delay) + step, plus the last [dk; dv] hop in backward.", ""] + table(
        ["pass", "delay / step", "comm alone", "with delay", "sum / max", "pipeline / max", "with delay / max",
         "with delay / pipeline"], body)


def heads_table(records: list[Record]) -> list[str]:
    rows = select(records, "heads")
    if not rows:
        return []
    body = []
    for r in rows:
        if "error" in r:
            result = f"refused: {r['error'][:110]}"
        else:
            result = f"exact: max error out {r['out']:.1e}, dq {r['dq']:.1e}, dk {r['dk']:.1e}, dv {r['dv']:.1e}"
        body.append([f"{r['heads']} / {r['kv_heads']}", str(r["world_size"]), r["mode"], result])
    return ["float64 against one rank running the whole sequence (reference kernel):", ""] + table(
        ["q / kv heads", "P", "mode", "result"], body)


def targets(records: list[Record]) -> list[tuple[str, str, bool]]:
    """(target, measured value, met) for every target of issue 6 with data in ``records``."""
    found: list[tuple[str, str, bool]] = []
    prof = [r for r in select(records, "profile") if "error" not in r]
    balanced = [r for r in prof if r["mode"] in ("ring zigzag", "ring striped")]
    if balanced:
        worst = max(r["work_max_over_mean"] for r in balanced)
        found.append(("zigzag and striped causal work max/mean <= 1.01",
                      ", ".join(f"{r['mode']} {r['work_max_over_mean']:.4f}" for r in balanced), worst <= 1.01))
    sent = [r for r in records if "bytes_fwd_formula" in r and r["bytes_fwd_formula"]]
    if sent:
        ratios = [r[f"bytes_{d}"] / r[f"bytes_{d}_formula"] for r in sent for d in ("fwd", "bwd")]
        worst = max(abs(x - 1) for x in ratios)
        found.append(("bytes equal the formula within 1%",
                      f"{len(ratios)} counts, measured/formula {min(ratios):.4f}-{max(ratios):.4f}", worst <= 0.01))
    for section, what in (("memory_vs_seq_len", "N grows"), ("memory_vs_world_size", "P grows")):
        rows = select(records, section)
        spreads = {m: _per_token_spread([r for r in rows if r["mode"] == m]) for m in _modes(rows)}
        spreads = {m: s for m, s in spreads.items() if s is not None}
        if spreads:
            measured = ", ".join(f"{m} {s:.1%}" for m, s in spreads.items())
            for r in (r for r in rows if "peak_bytes" in r and _replicates_kv(r)):
                others = [o["peak_bytes"] * o["world_size"] / o["seq_len"] for o in rows
                          if o["mode"] == r["mode"] and "peak_bytes" in o and not _replicates_kv(o) and o["world_size"] > 1]
                if others:
                    excess = r["peak_bytes"] * r["world_size"] / r["seq_len"] / min(others) - 1
                    measured += (f"; not counted: {r['mode']} at P={r['world_size']} > {r['kv_heads']} KV heads "
                                 f"replicates them, {excess:+.0%}")
            found.append((f"memory per rank proportional to N/P within 10% ({what})", measured,
                          max(spreads.values()) <= 0.10))
    over = select(records, "overlap", delay_over_step_compute=1.0)
    if over:
        worst = max(r["measured_over_max"] for r in over)
        found.append(("injected delay: step time <= 1.1 x max(compute, comm)",
                      ", ".join(f"{r['pass']} {r['measured_over_max']:.3f}" for r in over), worst <= 1.1))
    times = select(records, "timing")
    pairs = [(r, d) for r in times if r["mode"] == "Ulysses" and "fwd_s" in r
             for d in times if d["mode"] == "DeepSpeed Ulysses" and d["seq_len"] == r["seq_len"] and "fwd_s" in d]
    if pairs:
        ratios = [d["fwd_bwd_s"] / r["fwd_bwd_s"] for r, d in pairs]
        best = [min(d["fwd_bwd_repeats_s"]) / min(r["fwd_bwd_repeats_s"]) for r, d in pairs]
        found.append(("our Ulysses at least as fast as DeepSpeed's (DeepSpeed time / ours, fwd+bwd, medians; "
                      "in brackets the fastest repeats)",
                      ", ".join(f"N={r['seq_len']} {x:.3f} ({y:.3f})" for (r, _), x, y in zip(pairs, ratios, best)),
                      min(ratios) >= 1.0))
    peaks = {r["mode"]: r["peak_bytes"] for r in select(records, "profile") if "peak_bytes" in r}
    if "Ulysses" in peaks and "DeepSpeed Ulysses" in peaks:
        layer = {(r["mode"], r["seq_len"]): r["peak_bytes"] for r in select(records, "activations") if "peak_bytes" in r}
        ratios = [layer[("Ulysses", n)] / layer[("DeepSpeed Ulysses", n)] for (m, n) in layer
                  if m == "Ulysses" and ("DeepSpeed Ulysses", n) in layer]
        ratio = peaks["Ulysses"] / peaks["DeepSpeed Ulysses"]
        found.append(("our Ulysses' peak memory <= DeepSpeed's (ours / DeepSpeed's: the call; inside a layer, every N)",
                      f"{ratio:.3f}" + (f"; {min(ratios):.3f}-{max(ratios):.3f}" if ratios else ""),
                      ratio <= 1.0 and all(x <= 1.0 for x in ratios)))
    hd = select(records, "heads")
    if hd:
        cases = {(r["heads"], r["kv_heads"]) for r in hd}
        refused = [r for r in hd if r["mode"] == "DeepSpeed Ulysses" and "error" in r]
        exact = [r for r in hd if r["mode"].startswith("hybrid") and "error" not in r]
        worst = max((max(r[k] for k in ("out", "dq", "dk", "dv")) for r in exact), default=float("inf"))
        found.append(("hybrid exact where DeepSpeed cannot run (heads < SP degree)",
                      f"DeepSpeed refused {len(refused)}/{len(cases)} head cases; hybrid max float64 error {worst:.1e}",
                      len(refused) == len(cases) and len(exact) == len(cases) and worst < 1e-10))
    return found


def activations_table(records: list[Record]) -> list[str]:
    rows = [r for r in select(records, "activations") if "error" not in r]
    if not rows:
        return []
    body = []
    for r in sorted(rows, key=lambda r: (r["mode"], r["seq_len"])):
        model = r.get("model_kept_bytes")
        body.append([
            r["mode"], str(r["seq_len"]), f"{r['kept_bytes'] / MiB:.2f}",
            f"{r['kept_bytes'] / model:.3f}" if model else "-",
            f"{r['kept_bytes_checkpointed'] / MiB:.2f}",
            f"{r['kept_bytes_checkpointed'] / r['model_kept_bytes_checkpointed']:.3f}" if model else "-",
            f"{r['peak_bytes'] / MiB:.2f}", f"{r['peak_bytes'] / r['model_peak_bytes']:.3f}" if model else "-",
            f"{r['peak_bytes_checkpointed'] / MiB:.2f}",
        ])
    p = rows[0]["world_size"]
    return [f"One attention layer (`attend(q, k, v) * 1`) on {p} ranks, per rank: kept = memory alive between its "
            "forward and its backward, its returned output excluded; peak = the most it adds during forward+backward. "
            "Checkpointed: `torch.utils.checkpoint(use_reentrant=False)` around the layer (ring_sp keeps out + lse "
            "for the re-run). / model: measured over `ring_sp.plan.attention_memory`.", ""] + table(
        ["mode", "N", "kept MiB", "/ model", "kept checkpointed MiB", "/ model", "peak MiB", "/ model",
         "peak checkpointed MiB"], body)


def schedule_table(records: list[Record]) -> list[str]:
    rows = select(records, "schedule")
    if not rows:
        return []
    body = [[str(r["world_size"]), str(r["tokens_per_rank"]), str(r["documents"]), str(r["blocks"]),
             f"{r['build_s'] * 1e3:.1f}", f"{r['fwd_s'] * 1e3:.0f}", f"{r['fwd_bwd_s'] * 1e3:.0f}",
             f"{r['build_over_fwd']:.2%}", f"{r['build_over_fwd_bwd']:.2%}"] for r in rows]
    return ["`document_zigzag` on ring rank 0: one schedule build (done once per distinct `cu_seqlens`, "
            "then reused by every layer and the backward) against one layer's attention (exchanges replaced "
            "by local copies: a lower bound of the layer, so the ratio is an upper bound); medians.", ""] + table(
        ["P", "tokens/rank", "documents", "blocks", "build ms", "layer fwd ms", "layer fwd+bwd ms",
         "build / fwd", "build / fwd+bwd"], body)


def ulysses_table(records: list[Record]) -> list[str]:
    rows = select(records, "ulysses")
    if not rows:
        return []
    body = [[f"{r['heads']}/{r['kv_heads']}", str(r["seq_len"]), str(r["rounds"]),
             f"{r['ours_over_deepspeed_fwd']:.3f}", f"{r['ours_over_deepspeed_fwd_bwd']:.3f}",
             f"{min(r['ours_over_deepspeed_fwd_bwd_rounds']):.3f}-{max(r['ours_over_deepspeed_fwd_bwd_rounds']):.3f}",
             f"{r['ours_fwd_bwd_s'] * 1e3:.0f} / {r['deepspeed_fwd_bwd_s'] * 1e3:.0f}"] for r in rows]
    return ["Ulysses / DeepSpeed `DistributedAttention` on 2 ranks (same kernel), time ratio (< 1: ours "
            "faster): per round the ratio of medians, the two alternating call by call; median over rounds.",
            ""] + table(["q/kv heads", "N", "rounds", "fwd", "fwd+bwd", "fwd+bwd range", "fwd+bwd ms ours / DS"],
                         body)


def markdown(records: list[Record], header: list[str]) -> str:
    lines = header + [""]
    for title, section in (("Speed", timing_tables), ("Work balance, bytes and memory", profile_table),
                           ("Memory per rank", memory_tables), ("Activation memory per layer", activations_table),
                           ("Overlap with a slow link", overlap_table),
                           ("Fewer heads than ranks", heads_table),
                           ("Packed schedule build cost", schedule_table),
                           ("Ulysses against DeepSpeed, head shapes", ulysses_table),
                           ("All-gathered KV against the ring", kv_exchange_table)):
        body = section(records)
        if body:
            lines += [f"### {title}", ""] + body + [""]
    found = targets(records)
    if found:
        verdict = {True: "met", False: "**not met**"}
        lines += ["### Targets", ""] + table(["target", "measured", ""], [[t, v, verdict[ok]] for t, v, ok in found])
    return "\n".join(lines) + "\n"
