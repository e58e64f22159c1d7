"""``python -m benchmarks.window``: a sliding-window layer, halo ring vs full rotation vs all-gather.

Three ways to run causal sliding-window attention over ``P`` ranks:

* **halo** (ring_sp with ``sliding_window``): a rank exchanges only the KV rows its partners'
  windows read (``W - 1`` tokens from one partner with ``contiguous``, two with ``zigzag``) and
  their fp32 dK/dV partials back.
* **full rotation**: the same windowed blocks, but every KV shard visits every rank (what a
  ring without window-aware communication does): ``P - 1`` shards per rank each way.
* **all-gather**: every rank gathers the whole KV (TransformerEngine's fallback for windows
  with context parallelism), ``P - 1`` shards out per rank forward, a reduce-scatter of dK/dV
  (input dtype) backward; the transfers are not overlapped with compute.

Modelled (the planner's figures, ``ring_sp.plan``): bytes and time per rank per layer for
``W = 4096``, ``N = 32K .. 128K`` on 8 ranks (one 8-GPU node: an H100-like GPU, 450 GB/s
links; and the same ranks over 50 GB/s inter-node links), a Llama-8B-like layer (32 q / 8 KV
heads, head_dim 128, bf16). Measured (gloo ranks on this CPU): the halo against the full
rotation at smaller ``N``, bytes counted by ``ring_sp.count_communication`` and times as the
median of the slowest rank. The full rotation is measured by swapping ring_sp's exchange planner
(``RingSpec.exchange_planner``, a seam for this benchmark) for one that moves every shard at
every step (same blocks, same kernel), in the benchmark only.

Writes ``window.jsonl``, ``window.md`` and ``window.png`` into ``--out`` (default
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ring_sp
from ring_sp.plan import BACKWARD_FLOP_RATIO, dtype_bytes, layer_bytes
from ring_sp.ring import RingSpec
from ring_sp.schedule import ExchangePlan, exchange_plan, row_count

from .launch import launcher, sp_group

MiB = 2**20
MODEL = dict(heads=32, kv_heads=8, head_dim=128)  # Llama-8B-like attention
GPU_FLOPS = 494.5e12  # H100 SXM bf16 dense at 50% efficiency, the planner's default
LINKS = {"NVLink 450 GB/s": 450e9, "IB 50 GB/s": 50e9}


# ---- modelled ---------------------------------------------------------------------------------

def _full_rotation(plan_: ExchangePlan, local_len: int) -> ExchangePlan:
    """The same blocks, every shard to every rank at every step."""
    whole = (((0, local_len),),) * len(plan_.schedule)
    return ExchangePlan(plan_.schedule, whole, whole)


def modelled(seq_len: int, window: int, ranks: int, layout: str, bandwidth: float, dtype: str = "bf16") -> list[dict]:
    """Bytes and seconds per rank per layer (forward + backward) of the three schemes."""
    elem, acc = dtype_bytes(dtype)
    chunk = seq_len // ranks
    shard = 2 * chunk * MODEL["kv_heads"] * MODEL["head_dim"] * elem  # one packed [k; v] shard
    flops_per_pair = 4 * MODEL["head_dim"] * MODEL["heads"]
    plans = [exchange_plan(layout, True, r, ranks, chunk, None, window) for r in range(ranks)]
    pairs = [max(sum(t.visible_pairs() for t in p.schedule[step]) for p in plans) for step in range(ranks)]
    compute = [n * flops_per_pair / GPU_FLOPS for n in pairs]
    fwd, bwd = layer_bytes(ulysses=1, ring=ranks, batch=1, local_len=chunk, dtype=dtype, layout=layout,
                           sliding_window=window, **MODEL)
    halo_bytes = sum(fwd.values()) + sum(bwd.values())

    def ring_time(step_rows: list[float]) -> float:
        """Steps in lockstep, each max(compute, transfer in flight); the last partials home exposed."""
        kv = [rows * shard / bandwidth for rows in step_rows] + [0.0]
        dkv = [k * acc / elem for k in kv]
        forward = sum(max(compute[t], kv[t + 1]) for t in range(ranks))
        backward = sum(max(BACKWARD_FLOP_RATIO * compute[t], kv[t + 1] + dkv[t]) for t in range(ranks))
        return forward + backward + max(dkv)

    halo_rows = [0.0] + [max((row_count(p.recv_rows[t]) / chunk for p in plans), default=0.0)
                         for t in range(1, ranks)]
    full_rows = [0.0] + [1.0] * (ranks - 1)
    full_bytes = (ranks - 1) * shard * (2 + acc / elem)  # KV forward and backward, fp32 partials home
    gather_bytes = (ranks - 1) * shard * 3  # all-gather forward, again backward, reduce-scatter of dK/dV (input dtype)
    total_compute = (1 + BACKWARD_FLOP_RATIO) * sum(compute)
    common = dict(seq_len=seq_len, window=window, ranks=ranks, layout=layout, bandwidth=bandwidth)
    return [
        dict(common, scheme="halo", bytes=halo_bytes, seconds=ring_time(halo_rows)),
        dict(common, scheme="full rotation", bytes=full_bytes, seconds=ring_time(full_rows)),
        dict(common, scheme="all-gather", bytes=gather_bytes, seconds=total_compute + gather_bytes / bandwidth),
    ]


# ---- measured ---------------------------------------------------------------------------------

def _full_rotation_planner(layout: str, causal: bool, rank: int, world_size: int, local_len: int,
                           cu_seqlens=None, window: int | None = None, native_window: bool = False, *,
                           ulysses_size: int = 1, spans=None) -> ExchangePlan:
    """:func:`ring_sp.schedule.exchange_plan` with every shard moved at every step when windowed."""
    plan_ = exchange_plan(layout, causal, rank, world_size, local_len, cu_seqlens, window, native_window,
                          ulysses_size=ulysses_size, spans=spans)
    return plan_ if window is None else _full_rotation(plan_, local_len)


@contextlib.contextmanager
def _every_shard_everywhere() -> Iterator[None]:
    """Inside the block ring_sp's windowed calls move every shard at every step (benchmark only),
    through the ring's planner seam :attr:`ring_sp.ring.RingSpec.exchange_planner` (which keys
    the schedule cache, so neither scheme is served the other's schedule)."""
    original = RingSpec.__dict__["exchange_planner"]
    RingSpec.exchange_planner = staticmethod(_full_rotation_planner)
    try:
        yield
    finally:
        RingSpec.exchange_planner = original


def measure_case(seq_len: int, window: int, layout: str, full: bool, repeats: int, heads: int, kv_heads: int,
                 head_dim: int) -> dict[str, Any]:
    """One rank's bytes and fwd+bwd times of a windowed layer (float32 on CPU)."""
    group = sp_group()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(rank)
    n = seq_len // size
    q = torch.randn(1, n, heads, head_dim, requires_grad=True)
    k, v = (torch.randn(1, n, kv_heads, head_dim, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    times: list[float] = []
    sent: dict[str, int] = {}
    with _every_shard_everywhere() if full else contextlib.nullcontext():
        for i in range(repeats + 1):  # the first call agrees on the arguments: untimed
            dist.barrier(group)
            start = time.perf_counter()
            with ring_sp.count_communication() as record:
                out = ring_sp.ring_attention(q, k, v, group=group, causal=True, layout=layout, sliding_window=window)
                out.backward(dout)
            if i:
                times.append(time.perf_counter() - start)
                sent = record.bytes_sent
    return {"times": times, "bytes": sum(sent.values())}


def measured(run, seq_lens: list[int], window: int, ranks: int, layout: str, repeats: int) -> list[dict]:
    records = []
    for seq_len in seq_lens:
        for full in (False, True):
            per_rank = run.run(measure_case, ranks, seq_len, window, layout, full, repeats, 8, 2, 64)
            step = statistics.median(max(r["times"][i] for r in per_rank) for i in range(repeats))
            records.append(dict(seq_len=seq_len, window=window, ranks=ranks, layout=layout,
                                scheme="full rotation" if full else "halo", seconds=step,
                                bytes=max(r["bytes"] for r in per_rank)))
    return records


# ---- report -----------------------------------------------------------------------------------

def _table(records: list[dict], title: str) -> list[str]:
    lines = [f"### {title}", "", "| N | link | scheme | MiB sent per rank (fwd+bwd) | ms per layer (fwd+bwd) | vs halo |",
             "|---|---|---|---|---|---|"]
    for r in records:
        halo = next(h for h in records if h["scheme"] == "halo" and h["seq_len"] == r["seq_len"]
                    and h.get("bandwidth") == r.get("bandwidth"))
        link = next((name for name, bw in LINKS.items() if bw == r.get("bandwidth")), "gloo (CPU)")
        lines.append(f"| {r['seq_len']} | {link} | {r['scheme']} | {r['bytes'] / MiB:.1f} | {1e3 * r['seconds']:.2f} "
                     f"| {r['seconds'] / halo['seconds']:.2f}x time, {r['bytes'] / max(halo['bytes'], 1):.1f}x bytes |")
    return lines + [""]


def _plot(model: list[dict], meas: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    schemes = ("halo", "full rotation", "all-gather")
    ib = [r for r in model if r["bandwidth"] == LINKS["IB 50 GB/s"]]
    nv = [r for r in model if r["bandwidth"] == LINKS["NVLink 450 GB/s"]]
    for scheme in schemes:
        rows = [r for r in ib if r["scheme"] == scheme]
        axes[0].plot([r["seq_len"] // 1024 for r in rows], [r["bytes"] / MiB for r in rows], "o-", label=scheme)
        for records, style, link in ((ib, "-", "IB"), (nv, "--", "NVLink")):
            rows = [r for r in records if r["scheme"] == scheme]
            axes[1].plot([r["seq_len"] // 1024 for r in rows], [1e3 * r["seconds"] for r in rows], style, marker="o",
                         label=f"{scheme} ({link})", color=axes[0].lines[schemes.index(scheme)].get_color())
    for scheme in schemes[:2]:
        rows = [r for r in meas if r["scheme"] == scheme]
        axes[2].plot([r["seq_len"] // 1024 for r in rows], [1e3 * r["seconds"] for r in rows], "o-", label=scheme,
                     color=axes[0].lines[schemes.index(scheme)].get_color())
    w, p = model[0]["window"], model[0]["ranks"]
    axes[0].set(title=f"modelled: MiB sent per rank per layer\nW={w}, P={p}, bf16, 32q/8kv x 128",
                xlabel="N (K tokens)", ylabel="MiB (fwd+bwd)", yscale="log")
    axes[1].set(title="modelled: ms per layer (fwd+bwd)", xlabel="N (K tokens)", ylabel="ms", yscale="log")
    mw, mp = meas[0]["window"], meas[0]["ranks"]
    axes[2].set(title=f"measured, gloo CPU: W={mw}, P={mp}, fp32\n8q/2kv x 64", xlabel="N (K tokens)",
                ylabel="ms per layer (fwd+bwd)")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.window", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "zigzag"))
    p.add_argument("--measured-seq-lens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--measured-window", type=int, default=512)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    model = [r for n in (32768, 65536, 131072) for bw in LINKS.values()
             for r in modelled(n, 4096, 8, args.layout, bw)]
    run = launcher()
    try:
        meas = measured(run, args.measured_seq_lens, args.measured_window, args.world_size, args.layout, args.repeats)
    finally:
        run.close()
    if not run.is_leader:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "window.jsonl", "w") as f:
        for record in model + meas:
            f.write(json.dumps({**record, "kind": "measured" if record in meas else "modelled"}) + "\n")
    text = ["# Sliding-window layer: halo vs full rotation vs all-gather", "",
            f"`python -m benchmarks.window --layout {args.layout}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
            "see the module docstring for the schemes and the model.", ""]
    text += _table(model, f"Modelled: W = 4096, P = 8, layout {args.layout}")
    text += _table(meas, f"Measured on gloo CPU ranks: W = {args.measured_window}, P = {args.world_size}, "
                         f"layout {args.layout}, fp32, 8 q / 2 KV heads x 64 (median of {args.repeats})")
    (args.out / "window.md").write_text("\n".join(text))
    _plot(model, meas, args.out / "window.png")
    print("\n".join(text))


if __name__ == "__main__":
    main()
