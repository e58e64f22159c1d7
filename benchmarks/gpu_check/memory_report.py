"""The ``memory`` section's tables and targets in ``gpu_check.md`` (records of :mod:`.memory`)."""

from __future__ import annotations

from typing import Any

from ..tables import table

Record = dict[str, Any]
MODEL_TARGET = 0.10  # the model within 10% of max_memory_allocated at every length, both libraries
SLOPE_TARGET = 0.7  # ring_sp's bytes per token at most 0.7x ALST's
LONGEST_TARGET = 1.3  # ring_sp's longest N at least 1.3x ALST's, confirmed by a probe
PLANNER_TARGET = 1.4  # the planner's 8-GPU ratio, from constants the card confirms


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def _steps(records: list[Record]) -> list[list[str]]:
    body = []
    for r in records:
        cells = [r["library"], str(r["layers"]), f"{r['seq_len']:,}", _mib(r["model_added_bytes"])]
        if "added_bytes" in r:
            reserved = "-" if r["reserved_bytes"] is None else _mib(r["reserved_bytes"])
            cells += [_mib(r["added_bytes"]), f"**{r['measured_over_model']:.3f}**", _mib(r["peak_bytes"]), reserved,
                      f"{r['step_s']:.2f}", f"{r['loss']:.4f}"]
        else:
            cells += [r.get("skipped") or r.get("out_of_memory", "-"), "", "", "", "", ""]
        body.append(cells)
    return table(["library", "layers", "N", "model", "measured", "measured / model", "peak", "reserved", "step s",
                  "loss"], body)


def _longest(records: list[Record]) -> list[list[str]]:
    body = []
    for r in records:
        if "skipped" in r:
            body.append([r["library"], r["skipped"], "", "", "", "", ""])
            continue
        probes = "; ".join(f"{p['seq_len']:,} {'fits' if p['fits'] else 'fails'}"
                           + (f" ({p['step_s']:.0f} s)" if "step_s" in p else "") for p in r["probes"])
        if r.get("stopped"):
            probes += ("; " if probes else "") + r["stopped"]
        slope = f"{r['slope_bytes_per_token']:,.0f}" if "slope_bytes_per_token" in r else "-"
        extrapolated = f"{r['extrapolated_longest']:,}" if r.get("extrapolated_longest") is not None else "-"
        longest = f"**{r['longest_fits']:,}**" if r.get("longest_fits") else "not confirmed"
        body.append([r["library"], slope, extrapolated, probes or "-", longest, f"{r['model_longest']:,}",
                     _mib(r["free_bytes"])])
    return table(["library", "bytes / token (line)", "extrapolated N", "probes", "longest N", "model N", "free MiB"],
                 body)


def markdown(records: list[Record]) -> list[str]:
    """The pieces each library ran, the steps against the model, the layer check, the longest N."""
    out: list[str] = []
    pieces = [r for r in records if r["section"] == "memory_pieces"]
    for r in pieces:
        what = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in r.items()
                         if k not in ("section", "library", "name", "command"))
        out.append(f"* {r['library']} (`{r['name']}`): {what}.")
    steps = [r for r in records if r["section"] == "memory" and "library" in r]
    if steps:
        out += ["" if out else None, f"{steps[0]['model'].split(',')[0]} (`LlamaForCausalLM` from a config), one "
                "forward + backward per row, gradients allocated before it: what the step adds above parameters, "
                "gradients and the ballast (MiB), modelled (`ring_sp.plan.step_memory`) and measured (`max_memory_allocated`); "
                f"the absolute peak and `max_memory_reserved` beside it. Target: measured / model within "
                f"{MODEL_TARGET:.0%}.", ""]
        out += _steps(steps)
    layers = [r for r in records if r["section"] == "memory_layers" and "measured_delta_bytes" in r]
    if layers:
        out += ["", "Layers: what the step adds on 2 layers less on the line's stack, at one length (MiB); the "
                "model counts only the device checkpoints a deeper stack holds:", ""]
        out += table(["library", "N", "measured", "model", "one checkpoint"],
                     [[r["library"], f"{r['seq_len']:,}", _mib(r["measured_delta_bytes"]), _mib(r["model_delta_bytes"]),
                       _mib(r["checkpoint_bytes"])] for r in layers])
    found = [r for r in records if r["section"] == "memory_longest"]
    if found:
        budget = next((r["budget_bytes"] for r in found if r.get("budget_bytes")), None)
        where = "on the card" if budget is None else f"in a {_mib(budget)} MiB budget"
        if any(r.get("budget_held") is False for r in found):
            where += " (**a probe's peak passed the budget: the allocator did not hold it**)"
        out += ["" if out else None, f"The longest sequence whose step fits {where}: each library's line (least "
                "squares through its steps on the line's stack) extrapolated to the free memory, then a probe there "
                "(it should fit) and one 5% longer (it should fail), each only if its predicted time fits:", ""]
        out += _longest(found)
    return [line for line in out if line is not None]


def targets(records: list[Record]) -> list[list[str]]:
    """(target, measured, verdict) rows of issue 40's memory targets."""
    verdict = {True: "met", False: "**not met**"}
    rows = []
    measured = [r for r in records if r["section"] == "memory" and "measured_over_model" in r]
    libraries = sorted({r["library"] for r in measured})
    model_holds = False
    if measured:
        worst = max(measured, key=lambda r: abs(r["measured_over_model"] - 1))
        model_holds = abs(worst["measured_over_model"] - 1) <= MODEL_TARGET
        rows.append([f"step memory model within {MODEL_TARGET:.0%} of max_memory_allocated ({', '.join(libraries)})",
                     f"worst {worst['library']} N={worst['seq_len']:,}: measured / model "
                     f"{worst['measured_over_model']:.3f} ({len(measured)} points)", verdict[model_holds]])
    for p in (r for r in records if r["section"] == "memory_planner"):
        ratio = p["ring_sp_longest"] / p["ALST_longest"]
        calibrated = model_holds and libraries == ["ALST", "ring_sp"]
        rows.append([f"the planner's 8-GPU longest N >= {PLANNER_TARGET}x ALST's, from constants this card confirms "
                     f"(`{p['planner_command']}`)",
                     f"{p['ring_sp_longest']:,} ({p['ring_sp_grid']}) / {p['ALST_longest']:,} = {ratio:.2f}, modelled",
                     verdict[ratio >= PLANNER_TARGET] if calibrated else "unconfirmed: the model rows above are "
                     "missing or outside the target for a library"])
    found = {r["library"]: r for r in records if r["section"] == "memory_longest" and "probes" in r}
    ours, alst = found.get("ring_sp"), found.get("ALST")
    if ours and alst and "slope_bytes_per_token" in ours and "slope_bytes_per_token" in alst:
        ratio = ours["slope_bytes_per_token"] / alst["slope_bytes_per_token"]
        rows.append([f"ring_sp bytes per token <= {SLOPE_TARGET}x ALST's (line slopes)",
                     f"{ours['slope_bytes_per_token']:,.0f} / {alst['slope_bytes_per_token']:,.0f} = {ratio:.2f}",
                     verdict[ratio <= SLOPE_TARGET]])
    if ours and alst:
        a, b = ours.get("longest_fits"), alst.get("longest_fits")
        if a and b:
            rows.append([f"longest N on the card >= {LONGEST_TARGET}x ALST's, confirmed by a probe",
                         f"{a:,} / {b:,} = {a / b:.2f}", verdict[a / b >= LONGEST_TARGET]])
        else:
            ea, eb = ours.get("extrapolated_longest"), alst.get("extrapolated_longest")
            ratio = f"{ea:,} / {eb:,} = {ea / eb:.2f} extrapolated" if ea and eb else "no line"
            rows.append([f"longest N on the card >= {LONGEST_TARGET}x ALST's, confirmed by a probe",
                         f"{ratio}; not confirmed (a probe did not run or did not fit)", "**not confirmed**"])
    return rows


__all__ = ["markdown", "targets"]
