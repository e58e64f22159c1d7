"""The README's figures: throughput vs sequence length per mode, memory per rank vs P,
and the overlap check. Small PNGs (matplotlib's Agg backend, 80 dpi)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter  # noqa: E402

Record = dict[str, Any]
MiB = 2**20


def _log_axes(ax: plt.Axes, xs: list[int]) -> None:
    """Log-log axes labelled with the measured x values and plain numbers."""
    ax.set(xscale="log", yscale="log")
    ax.set_xticks(xs, labels=[str(x) for x in xs])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def throughput(records: list[Record], path: Path) -> Path | None:
    rows = [r for r in records if r["section"] == "timing" and "fwd_bwd_s" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["seq_len"])
        style = "k--" if mode == "1 rank" else "o-"
        ax.plot([r["seq_len"] for r in mine], [r["seq_len"] / r["fwd_bwd_s"] for r in mine], style, label=mode)
    p = max(r["world_size"] for r in rows)
    _log_axes(ax, sorted({r["seq_len"] for r in rows}))
    ax.set(xlabel="sequence length N (tokens)", ylabel="tokens / s (forward+backward)", title=f"Throughput, {p} ranks vs 1")
    ax.legend(fontsize=8)
    return _save(fig, path)


def memory_vs_world_size(records: list[Record], path: Path) -> Path | None:
    rows = [r for r in records if r["section"] == "memory_vs_world_size" and "peak_bytes" in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["world_size"])
        ax.plot([r["world_size"] for r in mine], [r["peak_bytes"] / MiB for r in mine], "o-", label=mode)
    single = [r for r in rows if r["world_size"] == 1]
    if single:
        sizes = sorted({r["world_size"] for r in rows})
        ax.plot(sizes, [single[0]["peak_bytes"] / MiB / p for p in sizes], "k:", label="1 rank / P")
    _log_axes(ax, sorted({r["world_size"] for r in rows}))
    ax.set(xlabel="ranks P", ylabel="peak memory added per rank (MiB)", title=f"Memory per rank, N={rows[0]['seq_len']}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def memory_checkpointing(records: list[Record], path: Path) -> Path | None:
    """Per rank vs N: memory one attention layer keeps for its backward, and its peak, with
    and without activation checkpointing; ours next to DeepSpeed's Ulysses."""
    rows = [r for r in records if r["section"] == "activations" and "kept_bytes" in r]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    seq_lens = sorted({r["seq_len"] for r in rows})
    for ax, what, title in ((axes[0], "kept_bytes", "kept per layer for backward"),
                            (axes[1], "peak_bytes", "peak of one layer's fwd+bwd")):
        for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
            mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["seq_len"])
            color = f"C{i}"
            ax.plot([r["seq_len"] for r in mine], [r[what] / MiB for r in mine], "o-", color=color, label=mode)
            ckpt = [(r["seq_len"], r[what + "_checkpointed"] / MiB) for r in mine if r[what + "_checkpointed"] > 0]
            if ckpt:
                ax.plot(*zip(*ckpt), "s--", color=color, label=f"{mode}, checkpointed")
        _log_axes(ax, seq_lens)
        ax.set(xlabel="sequence length N (tokens)", ylabel="MiB per rank", title=title)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"One attention layer on {rows[0]['world_size']} ranks (dashed: activation checkpointing; "
                 "DeepSpeed keeps nothing then)", fontsize=9)
    return _save(fig, path)


def overlap(records: list[Record], path: Path) -> Path | None:
    rows = [r for r in records if r["section"] == "overlap"]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    for ax, kind in zip(axes, ("fwd", "fwd_bwd")):
        mine = sorted((r for r in rows if r["pass"] == kind), key=lambda r: r["delay_s"])
        x = [r["delay_over_step_compute"] for r in mine]
        base = mine[0]["compute_s"]
        ax.plot(x, [r["sum_s"] / base for r in mine], "r:", label="compute + comm")
        ax.plot(x, [r["max_s"] / base for r in mine], "k--", label="max(compute, comm)")
        ax.plot(x, [r["pipeline_s"] / base for r in mine], "g-.", label="ring pipeline, ideal")
        ax.plot(x, [r["measured_s"] / base for r in mine], "o-", label="measured")
        ax.set(xlabel="delay per exchange / ring step compute", title="forward" if kind == "fwd" else "forward+backward")
    axes[0].set_ylabel("time / compute alone")
    axes[0].legend(fontsize=8)
    return _save(fig, path)
