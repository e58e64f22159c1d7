"""``python -m benchmarks.packed``: packed batches of real documents, three layouts side by side.

Packs are drawn from published document-length statistics (each a distribution fitted to the
figures its source publishes; none of them ships its length list):

* ``prolong``: ProLong's long-context training mix (Gao et al., "How to Train Long-Context
  Language Models (Effectively)", 2024): lognormal with median 3.2K tokens, 99th percentile 26K;
* ``wlb``: Meta's 128K pretraining job (WLB-LLM, OSDI 2025: documents shorter than half the
  context carry over 75% of the tokens): lognormal, median 1.9K, 99th percentile 16K;
* ``bytescale``: ByteDance's production data (ByteScale, 2025: about 80% of samples 4K tokens or
  shorter, the 1% at 128K or longer carrying 44% of the tokens): 99% lognormal (median 1.6K,
  80th percentile 4K) and 1% log-uniform in [128K, 512K];
* ``short``: the worst case for cutting every document, 64-512 tokens (uniform);
* ``single``: one document as long as the pack.

Documents are packed in order until the pack is full, the last one cut to fit (a document
longer than the pack is the pack). For every pack, ``N`` = 128K and 1M tokens, ``P`` = 4, 8, 16
SP ranks and ``U`` = 1, 2 (the ring has ``R = P / U`` ranks), each layout's ring schedule is
counted by the library's pure functions (no kernel runs; exact on any machine), for a GPU kernel
that takes bands and varlen calls (FlashAttention-2/3, cuDNN) with 128 x 64 tiles:

* **balance**: max / mean over the ring ranks of the tile-rounded score pairs their calls compute,
  alone and with the per-token linear work of a Llama-3-8B layer (26,620 pairs' worth of FLOPs per
  token: equal on every rank, as every rank holds N/P tokens);
* **tiles**: score pairs computed in 128 x 64 tiles / pairs the mask needs (sum over ranks);
* **bytes**: KV moved per pass (forward), Llama-3-8B's 8 KV heads x 128 in bf16 (4 KiB a token,
  all U rings together), the rows moved over the rows some block reads, the share of the
  rows ``document_zigzag`` moves, what relaying the same rows neighbour to neighbour would move
  instead of the direct sends (a row read ``t`` ranks away crosses ``t`` links; why the ring
  sends at offset ``t``), and the part crossing nodes of 8 GPUs (P = 16 spans two);
* **calls**: kernel calls per step of the busiest rank (its mean over the steps that compute);
* **build**: one rank's schedule, built cold (placement, both ends of every message, kernel calls),
  without a window and with a 4K one.

``--measure`` also times one training step (forward + backward) of a small Llama on 4 gloo CPU
ranks, 32K tokens, for ``document_zigzag`` and ``document_balanced`` (the two layouts the Hugging
Face integration shards packed batches with; ``zigzag`` with documents is the core API's).

Writes ``packed.md``, ``packed.jsonl`` and ``packed.png`` into ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ring_sp.layouts import shard_runs
from ring_sp.placement import causal_tile_pairs
from ring_sp.runs import MEMOS
from ring_sp.schedule import KernelCaps, call_pairs, exchange_plan, mask_pairs, read_rows, row_count, step_calls

from .tables import table

LAYOUTS = ("zigzag", "document_zigzag", "document_balanced")
CAPS = KernelCaps(bands=True, varlen=True)
TILE = (128, 64)
LINEAR_PAIRS_PER_TOKEN = 26_620  # Llama-3-8B: 2 x (2 x 4096^2 + 2 x 4096 x 1024 + 3 x 4096 x 14336) FLOPs / (4 x 128 x 32)
KV_BYTES_PER_TOKEN = 8 * 128 * 2 * 2  # 8 KV heads x 128 x (k, v) x bf16
GPUS_PER_NODE = 8
WINDOW = 4096  # the build is also timed with this sliding window


def _lognormal(median: float, p: float, quantile_z: float) -> tuple[float, float]:
    return math.log(median), math.log(p / median) / quantile_z


def draw(distribution: str, rng: random.Random) -> int:
    """One document length (tokens) of ``distribution`` (module docstring)."""
    if distribution == "prolong":
        mu, sigma = _lognormal(3200, 26000, 2.326)
    elif distribution == "wlb":
        mu, sigma = _lognormal(1900, 16000, 2.326)
    elif distribution == "bytescale":
        if rng.random() < 0.01:
            return int(math.exp(rng.uniform(math.log(128 << 10), math.log(512 << 10))))
        mu, sigma = _lognormal(1600, 4096, 0.8416)
    elif distribution == "short":
        return rng.randint(64, 512)
    else:
        raise ValueError(f"unknown distribution {distribution!r}")
    return max(1, int(math.exp(rng.gauss(mu, sigma))))


DISTRIBUTIONS = ("prolong", "wlb", "bytescale", "short", "single")


def pack(distribution: str, seq_len: int, seed: int) -> tuple[int, ...]:
    """Document boundaries of one pack of ``seq_len`` tokens (the last document cut to fit)."""
    if distribution == "single":
        return (0, seq_len)
    rng = random.Random(f"{distribution}-{seq_len}-{seed}")
    cuts = [0]
    while cuts[-1] < seq_len:
        cuts.append(min(seq_len, cuts[-1] + draw(distribution, rng)))
    return tuple(cuts)


def _cold(fn: Any) -> tuple[Any, float]:
    """``fn()`` and its seconds, every memo of layouts and placements emptied first."""
    for memo in MEMOS:
        memo.cache_clear()
    causal_tile_pairs.cache_clear()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def schedule_record(distribution: str, cu: tuple[int, ...], layout: str, world_size: int, ulysses: int) -> dict:
    """The counts of the module docstring for one pack, layout and grid."""
    seq_len, ring = cu[-1], world_size // ulysses
    n = seq_len // ring

    def build(window: int | None) -> list:
        return [step_calls(t, CAPS) for t in exchange_plan(layout, True, 0, ring, n, cu, window, True,
                                                              ulysses_size=ulysses).schedule]

    # the best of three (the first also warms torch's ops; a busy moment of the machine hits one)
    build_s, window_s = (min(_cold(lambda: build(window))[1] for _ in range(3)) for window in (None, WINDOW))
    positions = [shard_runs(layout, ulysses, ring, seq_len, r, cu).positions() for r in range(ring)]
    computed, needed, calls, moved, read, inter, relayed = [], 0, [], 0, 0, 0, 0
    for rank in range(ring):
        plan = exchange_plan(layout, True, rank, ring, n, cu, None, True, ulysses_size=ulysses)
        steps = [step_calls(tasks, CAPS) for tasks in plan.schedule]
        computed.append(sum(call_pairs(c, CAPS, TILE) for step in steps for c in step))
        needed += sum(mask_pairs(positions[rank], keys, causal=True, cu_seqlens=cu) for keys in positions)
        busy = [len(step) for step in steps if step]
        calls.append(statistics.mean(busy) if busy else 0.0)
        for step in range(1, ring):
            sent = row_count(plan.send_rows[step])
            moved += sent
            relayed += sent * step  # the same rows relayed neighbour to neighbour: step hops each
            read += row_count(read_rows(plan.schedule[step]))
            if (rank * ulysses) // GPUS_PER_NODE != (((rank + step) % ring) * ulysses) // GPUS_PER_NODE:
                inter += sent
    tokens = seq_len // world_size
    mean = sum(computed) / ring
    linear = LINEAR_PAIRS_PER_TOKEN * tokens * ulysses  # a ring rank's U members' tokens
    return {"distribution": distribution, "seq_len": seq_len, "documents": len(cu) - 1, "world_size": world_size,
            "ulysses": ulysses, "layout": layout, "balance": max(computed) / mean if mean else 1.0,
            "balance_with_linear": (max(computed) + linear) / (mean + linear), "tiles": sum(computed) / max(1, needed),
            "kv_mb": moved * KV_BYTES_PER_TOKEN / 2**20, "moved_rows": moved, "read_rows": read, "relayed_rows": relayed,
            "inter_node_mb": inter * KV_BYTES_PER_TOKEN / 2**20, "calls_per_step": max(calls), "build_ms": 1e3 * build_s,
            "window_build_ms": 1e3 * window_s}


# ---- a measured CPU step -----------------------------------------------------------------

def small_llama():
    """A Llama small enough that its attention is a visible share of a CPU step: 2 layers, hidden
    64, 4 q / 2 KV heads of 16, ffn 128, a 256-token vocabulary (bytes)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1 << 20,
                       attention_dropout=0.0, tie_word_embeddings=False)


def step_case(layout: str, cu: tuple[int, ...], repeats: int) -> dict:
    """One training step (forward + backward) of :func:`small_llama` on this block of ranks (U = 1),
    the packed row sharded by the Hugging Face integration with ``layout``."""
    import torch.distributed as dist

    import ring_sp
    import ring_sp.integrations.transformers as rsp_hf

    from .launch import sp_group
    from .length import _model

    group = sp_group()
    topo = ring_sp.init_sequence_parallel(1, dist.get_world_size(group))
    rsp_hf.register(topo, layout=layout)
    model = _model(small_llama(), "ring_sp")
    seq_len = cu[-1]
    ids = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]
    shard = rsp_hf.shard_batch({"input_ids": ids, "position_ids": positions}, topo, layout=layout)
    times = []
    for _ in range(repeats + 1):  # the first builds the schedule and warms up
        start = time.perf_counter()
        logits = model(**shard).logits
        rsp_hf.causal_lm_loss(logits, shard["shift_labels"], topology=topo, gradients_averaged_over_sp=True).backward()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return {"layout": layout, "step_s": statistics.median(times[1:])}


def measured(repeats: int) -> list[dict]:
    from .launch import launcher

    run = launcher()
    records = []
    try:
        for distribution in ("prolong", "wlb", "short"):
            cu = pack(distribution, 32768, seed=0)
            best: dict[str, float] = {}
            for _ in range(3):  # the layouts in turn, three times: a busy moment of the machine hits both alike
                for layout in ("document_zigzag", "document_balanced"):
                    slowest = max(r["step_s"] for r in run.run(step_case, 4, layout, cu, repeats))
                    best[layout] = min(best.get(layout, slowest), slowest)
            records += [{"distribution": distribution, "documents": len(cu) - 1, "layout": layout, "step_s": s}
                        for layout, s in best.items()]
    finally:
        run.close()
    return records


# ---- report ------------------------------------------------------------------------------

def _rows(records: list[dict]) -> list[list[str]]:
    zigzag_mb = {(r["distribution"], r["seq_len"], r["world_size"], r["ulysses"]): r["kv_mb"]
                 for r in records if r["layout"] == "document_zigzag"}
    rows = []
    for r in records:
        key = (r["distribution"], r["seq_len"], r["world_size"], r["ulysses"])
        share = r["kv_mb"] / zigzag_mb[key] if zigzag_mb.get(key) else float("nan")
        rows.append([r["distribution"], f"{r['seq_len'] >> 10}K", str(r["documents"]), f"U{r['ulysses']}xR{r['world_size'] // r['ulysses']}",
                     r["layout"], f"{r['balance']:.3f}", f"{r['balance_with_linear']:.3f}", f"{r['tiles']:.2f}",
                     f"{r['kv_mb']:.0f}", f"{r['moved_rows'] / max(1, r['read_rows']):.2f}" if r["read_rows"] else "-",
                     f"{share:.2f}", f"{r['relayed_rows'] / max(1, r['moved_rows']):.1f}" if r.get("relayed_rows") else "-",
                     f"{r['inter_node_mb']:.0f}" if r["world_size"] > GPUS_PER_NODE else "-",
                     f"{r['calls_per_step']:.1f}", f"{r['build_ms']:.0f}",
                     f"{r['window_build_ms']:.0f}" if "window_build_ms" in r else "-"])
    return rows


HEADER = ["pack", "N", "docs", "grid", "layout", "balance", "with linear", "tiles", "KV MiB/pass", "moved/read",
          "of doc_zigzag", "relay/direct", "inter-node MiB", "calls/step", "build ms", "build ms, W = 4K"]


def _plot(records: list[dict], path: Path) -> None:
    from .plots import _save, plt  # matplotlib with the Agg backend, chosen there

    picks = [r for r in records if r["ulysses"] == 1 and r["world_size"] == 8 and r["seq_len"] == 131072]
    packs = list(dict.fromkeys(r["distribution"] for r in picks))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (field, title) in zip(axes, [("balance", "max / mean tile-rounded pairs"), ("tiles", "computed / needed pairs (128x64)"),
                                         ("kv_mb", "KV MiB per pass (forward)")]):
        for i, layout in enumerate(LAYOUTS):
            values = [next((r[field] for r in picks if r["distribution"] == p and r["layout"] == layout), 0) for p in packs]
            ax.bar([x + 0.27 * (i - 1) for x in range(len(packs))], values, width=0.27, label=layout)
        ax.set_xticks(range(len(packs)), packs, rotation=20)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("Packed 128K tokens, P = 8 (U1 x R8)", fontsize=10)
    _save(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.packed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 1 << 20])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--ulysses", type=int, nargs="+", default=[1, 2])
    p.add_argument("--distributions", nargs="+", default=list(DISTRIBUTIONS), choices=DISTRIBUTIONS)
    p.add_argument("--measure", action="store_true", help="also time a CPU step on 4 gloo ranks (minutes)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--records", type=Path, help="the counts from a file of their JSON lines (a run's output) instead")
    args = p.parse_args(argv)

    records = [] if args.records is None else [
        json.loads(line) for line in args.records.read_text().splitlines() if line.startswith('{"distribution"')]
    for seq_len in args.seq_lens if args.records is None else ():
        for distribution in args.distributions:
            cu = pack(distribution, seq_len, seed=0)
            for world_size in args.world_sizes:
                for ulysses in args.ulysses:
                    if world_size % ulysses or world_size // ulysses < 2:
                        continue
                    for layout in LAYOUTS:
                        records.append(schedule_record(distribution, cu, layout, world_size, ulysses))
                        print(json.dumps(records[-1]), flush=True)
    steps = measured(args.repeats) if args.measure else []
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "packed.jsonl", "w") as f:
        for record in records + steps:
            f.write(json.dumps(record) + "\n")
    text = ["# Packed documents: three layouts side by side", "",
            f"`python -m benchmarks.packed{' --measure' if args.measure else ''}` "
            f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); packs, columns and model: the module docstring.", ""]
    text += table(HEADER, _rows(records))
    if steps:
        text += ["", "One training step (forward + backward) of a small Llama (2 layers, hidden 64, 4 q / 2 KV heads of 16, "
                 "vocabulary 256: its attention a visible share of the step), 32K tokens on 4 gloo CPU ranks (U1 x R4), "
                 "fp32: the slowest rank's median step, the best of three turns of the layouts:", ""]
        base = {r["distribution"]: r["step_s"] for r in steps if r["layout"] == "document_zigzag"}
        text += table(["pack", "docs", "layout", "step s", "vs document_zigzag"],
                      [[r["distribution"], str(r["documents"]), r["layout"], f"{r['step_s']:.2f}",
                        f"{base[r['distribution']] / r['step_s']:.2f}x"] for r in steps])
    (args.out / "packed.md").write_text("\n".join(text) + "\n")
    try:
        _plot(records, args.out / "packed.png")
    except ImportError:
        print("matplotlib is not installed (pip install 'ring-sp[bench]'): no packed.png")
    print("\n".join(text))


if __name__ == "__main__":
    main()
