"""The ``kv_exchange`` section: ``kv_exchange="all_gather"`` against the ring, side by side.

For each head shape (MHA 8/8, GQA 8/2 and 8/1) on 2 and 4 ranks (zigzag, causal), the two
exchanges take turns call by call on identical shards, the order flipped every round, so a
change in the machine's load hits both alike. Reported per shape: the median over rounds of
the slowest rank's forward and forward+backward seconds, their ratio (all_gather / ring;
< 1: gathering is faster), the largest difference of the two outputs, and whether the bytes
:func:`ring_sp.count_communication` counted equal :func:`ring_sp.plan.layer_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

import ring_sp
from ring_sp.plan import layer_bytes

from .launch import Launcher, device, sp_group
from .modes import Problem
from .tables import MiB, select, table
from .timing import step_time, time_call

Record = dict[str, Any]
EXCHANGES = ("ring", "all_gather")
HEAD_SHAPES = ((8, 8), (8, 2), (8, 1))


def exchange_case(problem: Problem, warmup: int, repeats: int, backend: str) -> dict[str, Any]:
    """This rank's seconds per call of each exchange (fwd, fwd+bwd), its bytes, the outputs' difference."""
    dev, group = device(), sp_group()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shards = [ring_sp.shard_sequence(t, rank=rank, world_size=world, layout="zigzag").contiguous().requires_grad_(i < 3)
              for i, t in enumerate(problem.inputs(dev))]
    q, k, v, dout = shards

    def attend(exchange: str) -> torch.Tensor:
        return ring_sp.ring_attention(q, k, v, group=group, causal=problem.causal, layout="zigzag",
                                      softmax_scale=problem.scale, backend=backend, kv_exchange=exchange)

    def clear() -> None:
        for t in (q, k, v):
            t.grad = None

    outs, sent = {}, {}
    for exchange in EXCHANGES:  # the first call agrees on the shapes; count the second
        attend(exchange)
        with ring_sp.count_communication() as fwd:
            out = attend(exchange)
        with ring_sp.count_communication() as bwd:
            out.backward(dout)
        outs[exchange], sent[exchange] = out.detach(), (fwd.bytes_sent, bwd.bytes_sent)
        clear()
    steps: dict[str, Callable[[str], object]] = {"fwd": attend, "fwd_bwd": lambda x: attend(x).backward(dout)}
    times: dict[str, dict[str, list[float]]] = {x: {kind: [] for kind in steps} for x in EXCHANGES}
    for i in range(warmup + repeats):
        for exchange in EXCHANGES if i % 2 == 0 else EXCHANGES[::-1]:  # interleaved, order flipped per round
            for kind, step in steps.items():
                elapsed = time_call(lambda: step(exchange), group=group, device=dev, reset=clear)
                if i >= warmup:
                    times[exchange][kind].append(elapsed)
    diff = (outs["ring"].float() - outs["all_gather"].float()).abs().max().item()
    return {"times": times, "sent": sent, "out_diff": diff}


def kv_exchange(run: Launcher, cfg: Any, log: Callable[[str], None]) -> list[Record]:
    records = []
    dtype = cfg.problem.dtype
    for world_size in sorted({2, min(4, cfg.world_size)}):
        for heads, kv_heads in HEAD_SHAPES:
            problem = replace(cfg.problem, seq_len=cfg.profile_seq_len, heads=heads, kv_heads=kv_heads)
            log(f"kv_exchange: {heads}/{kv_heads} heads, N={problem.seq_len}, {world_size} ranks")
            results = run.run(exchange_case, world_size, problem, cfg.warmup, cfg.repeats, cfg.backend)
            record: Record = {"section": "kv_exchange", "world_size": world_size, "seq_len": problem.seq_len,
                              "heads": heads, "kv_heads": kv_heads, "dtype": dtype,
                              "out_diff": max(r["out_diff"] for r in results)}
            for exchange in EXCHANGES:
                for kind in ("fwd", "fwd_bwd"):
                    record[f"{exchange}_{kind}_s"] = step_time([r["times"][exchange][kind] for r in results])
                formula = layer_bytes(ulysses=1, ring=world_size, batch=problem.batch,
                                      local_len=problem.seq_len // world_size, heads=heads, kv_heads=kv_heads,
                                      head_dim=problem.head_dim, dtype=dtype, layout="zigzag", kv_exchange=exchange)
                record[f"{exchange}_bytes"] = sum(sum(d.values()) for d in formula)
                record[f"{exchange}_bytes_match"] = all(tuple(r["sent"][exchange]) == formula for r in results)
            for kind in ("fwd", "fwd_bwd"):
                record[f"ratio_{kind}"] = record[f"all_gather_{kind}_s"] / record[f"ring_{kind}_s"]
            records.append(record)
    return records


def kv_exchange_table(records: list[Record]) -> list[str]:
    rows = select(records, "kv_exchange")
    if not rows:
        return []
    body = [[f"{r['world_size']}", f"{r['heads']}/{r['kv_heads']}", f"{r['seq_len']}",
             f"{r['ring_fwd_s'] * 1e3:.1f} / {r['ring_fwd_bwd_s'] * 1e3:.1f}",
             f"{r['all_gather_fwd_s'] * 1e3:.1f} / {r['all_gather_fwd_bwd_s'] * 1e3:.1f}",
             f"**{r['ratio_fwd']:.3f} / {r['ratio_fwd_bwd']:.3f}**",
             f"{r['ring_bytes'] / MiB:.2f} / {r['all_gather_bytes'] / MiB:.2f}",
             "yes" if r["ring_bytes_match"] and r["all_gather_bytes_match"] else "**no**", f"{r['out_diff']:.1e}"]
            for r in rows]
    return (["`kv_exchange=\"all_gather\"` against the ring (zigzag, causal; medians of interleaved rounds, slowest "
             "rank), ms forward / forward+backward; ratio all_gather / ring (< 1: gathering is faster); MiB sent "
             "per rank fwd+bwd, ring / all_gather, and whether the counted bytes equal the planner's formula:", ""]
            + table(["P", "q/kv heads", "N", "ring ms", "all_gather ms", "ratio", "MiB ring / ag", "bytes = formula",
                      "max |out diff|"], body))
