"""The ``length`` section: peak memory per rank of one training step of a small HF Llama
as the sequence grows, ring_sp untiled and tiled, DeepSpeed ALST, and one rank (issue 20).

Every mode trains the same model (:func:`small_llama_config`: hidden 256, 2 layers, ffn
1024, 8 q / 4 kv heads, vocab 32K, fp32; seed 0) on the same global batch for one step:
forward, the exact global-token-mean loss, backward, and an AdamW step. Memory is the peak
of live tensor bytes created during that step (:class:`benchmarks.memory.PeakMemory`; the
parameters existed before it, so they are not in it), in a fresh set of processes per
point. The modes:

* ``ring_sp untiled``: ``attn_implementation="ring_sp"`` at U2xR2, full logits of the shard,
  :func:`ring_sp.integrations.transformers.causal_lm_loss`;
* ``ring_sp tiled U2xR2`` / ``U1xR4``: the same after
  :func:`ring_sp.integrations.transformers.enable_long_sequence` (tiled MLP and loss), the
  loss from :func:`ring_sp.integrations.transformers.model_loss`;
* ``ALST``: DeepSpeed's ``UlyssesSPAttentionHF`` (Ulysses SP=4 over ``sdpa``), its
  ``TiledMLP`` (its default of ``ceil(n / hidden)`` tiles) and ``TiledFusedLogitsLoss``
  with tiles of ``loss_tile_tokens`` tokens (its own default, 1 GiB of fp32 logits per
  tile, would not tile at this scale);
* ``one rank``: the whole sequence with ``sdpa`` on one process.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ring_sp
import ring_sp.integrations.transformers as rsp_hf
from ring_sp.integrations.deepspeed import skip_cpu_inference_comm_build
from ring_sp.plan.step_memory import StepMemory, Training, Transformer, max_seq_len, step_memory

from .launch import Launcher, PoolLauncher, TorchrunLauncher, device, sp_group
from .memory import PeakMemory
from .tables import table

VOCAB = 32768


@dataclass(frozen=True)
class LengthMode:
    """One way to train the step: ``kind`` "ring_sp", "alst" or "single"."""

    name: str
    kind: str
    ulysses: int = 1
    tiled: bool = False
    head_chunks: int | str = "auto"  # ring_sp tiled: enable_long_sequence's head_chunks

    def world_size(self, sp: int) -> int:
        return 1 if self.kind == "single" else sp


UNTILED = LengthMode("ring_sp untiled U2xR2", "ring_sp", 2)
TILED_2X2 = LengthMode("ring_sp tiled U2xR2", "ring_sp", 2, tiled=True)
TILED_1X4 = LengthMode("ring_sp tiled U1xR4", "ring_sp", 1, tiled=True)
CHUNKED_1X4 = LengthMode("ring_sp tiled U1xR4, 4 head chunks", "ring_sp", 1, tiled=True, head_chunks=4)
ALST = LengthMode("ALST Ulysses SP4 + TiledMLP + tiled loss", "alst", 4, tiled=True)
SINGLE = LengthMode("one rank untiled", "single")
LENGTH_MODES = (UNTILED, TILED_2X2, TILED_1X4, CHUNKED_1X4, ALST, SINGLE)


def small_llama_config(layers: int = 2, vocab: int = VOCAB):
    """The issue's model: hidden 256, ffn 1024, 8 q / 4 kv heads of 32, fp32, untied head."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1 << 20,
                       attention_dropout=0.0, tie_word_embeddings=False)


def global_batch(seq_len: int, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """The same global batch on every rank: one row of ``seq_len`` random tokens."""
    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "labels": ids.clone()}


def _model(config, attn: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).train()


def _ring_sp_step(mode: LengthMode, config, batch: dict[str, torch.Tensor], tile_tokens: int | None, topo=None):
    """(model, loss function) of ring_sp on a ``mode.ulysses x R`` grid (``topo``: reuse one)."""
    if topo is None:
        p = torch.distributed.get_world_size(sp_group())
        topo = ring_sp.init_sequence_parallel(mode.ulysses, p // mode.ulysses)
    rsp_hf.register(topo, layout="zigzag")
    model = _model(config, "ring_sp")
    if mode.tiled:
        rsp_hf.enable_long_sequence(model, tiled_mlp=True, tiled_loss=True, tile_tokens=tile_tokens,
                                    head_chunks=mode.head_chunks)
    shard = rsp_hf.shard_batch(batch, topo)

    def loss() -> torch.Tensor:
        if mode.tiled:
            return rsp_hf.model_loss(model, shard, topology=topo)
        logits = model(**shard).logits
        return rsp_hf.causal_lm_loss(logits, shard["shift_labels"], topology=topo, gradients_averaged_over_sp=False)

    return model, loss


def _alst_step(mode: LengthMode, config, batch: dict[str, torch.Tensor], loss_tile_tokens: int):
    """DeepSpeed ALST as its tutorial wires it into an HF model, without a DeepSpeed engine
    (the step's memory is the model's; every mode here uses a plain AdamW)."""
    import deepspeed.comm
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF

    skip_cpu_inference_comm_build()
    if not deepspeed.comm.is_initialized():
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    model = _model(config, "sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=mode.ulysses,
        micro_batch_size=1, seq_length_is_variable=True)
    group = mpu.get_sequence_parallel_group()
    p, rank = dist.get_world_size(group), dist.get_rank(group)

    def tiled_mlp_forward(self, x):  # DeepSpeed's docstring recipe: ceil(n / hidden) tiles, the same on every rank
        shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]))
        dist.all_reduce(shards, op=dist.ReduceOp.MAX, group=group)

        def mlp(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        return TiledMLP.apply(mlp, self, x, int(shards), [self.down_proj.weight, self.gate_proj.weight,
                                                           self.up_proj.weight])

    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward.__get__(layer.mlp)
    ids, labels = batch["input_ids"], batch["labels"]
    n = ids.shape[1] // p
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
    local = slice(rank * n, (rank + 1) * n)
    shard_ids, shard_labels = ids[:, local], shift[:, local].contiguous()
    positions = torch.arange(rank * n, (rank + 1) * n).unsqueeze(0)
    valid = torch.tensor(float((shift != -100).sum()))  # the global token count (every rank has the batch)
    head = model.lm_head

    def loss_sum(self, x, y):
        return F.cross_entropy(self(x).float().flatten(0, -2), y.flatten(), reduction="sum", ignore_index=-100)

    def loss() -> torch.Tensor:
        hidden = model.model(input_ids=shard_ids, position_ids=positions).last_hidden_state
        tiles = max(1, math.ceil(n / loss_tile_tokens))
        return TiledFusedLogitsLoss.apply(loss_sum, head, hidden, shard_labels, None, tiles, [head.weight],
                                          "sum") / valid

    return model, loss


def _single_step(config, batch: dict[str, torch.Tensor]):
    model = _model(config, "sdpa")
    shard = rsp_hf.shard_batch(batch, None)
    return model, lambda: rsp_hf.causal_lm_loss(model(**shard).logits, shard["shift_labels"])


def _build(mode: LengthMode, seq_len: int, tile_tokens: int | None, loss_tile_tokens: int, layers: int):
    config, batch = small_llama_config(layers), global_batch(seq_len)
    if mode.kind == "ring_sp":
        return _ring_sp_step(mode, config, batch, tile_tokens)
    if mode.kind == "alst":
        return _alst_step(mode, config, batch, loss_tile_tokens)
    return _single_step(config, batch)


def warm_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """An AdamW in its steady state: its two fp32 moments and every gradient (zeros) exist,
    as in any step after the first (gradients zeroed in place, not freed)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return optimizer


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and the optimizer state, as allocated."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def length_case(mode: LengthMode, seq_len: int, tile_tokens: int | None, loss_tile_tokens: int,
                layers: int = 2) -> dict[str, Any]:
    """One steady-state training step of ``mode`` at ``seq_len`` tokens on this rank (forward,
    loss, backward, AdamW update; moments and gradients already allocated): ``peak_bytes``,
    the peak of the tensor bytes it adds; ``resident_bytes``, what existed before it
    (parameters, gradients, optimizer state); the loss and the step's seconds."""
    torch.set_num_threads(1)
    model, loss_fn = _build(mode, seq_len, tile_tokens, loss_tile_tokens, layers)
    optimizer = warm_optimizer(model)
    start = time.perf_counter()
    with PeakMemory(device()) as memory:
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    seconds = time.perf_counter() - start
    value = loss.detach().clone()
    if mode.kind == "alst":  # each rank's loss is its shard's share of the global mean (gradients summed over SP)
        torch.distributed.all_reduce(value, group=sp_group())
    return {"peak_bytes": memory.peak_bytes, "resident_bytes": resident_bytes(model, optimizer), "loss": value.item(),
            "measured_step_s": seconds}


def step_time_case(seq_len: int, tile_tokens: int | None, rounds: int, layers: int = 2) -> dict[str, list[float]]:
    """Seconds of one training step (forward, loss, backward, AdamW) of ring_sp untiled and
    tiled at U2xR2, the same model and batch, alternating step by step (``rounds`` each)."""
    torch.set_num_threads(1)
    p = torch.distributed.get_world_size(sp_group())
    topo = ring_sp.init_sequence_parallel(UNTILED.ulysses, p // UNTILED.ulysses)
    config, batch = small_llama_config(layers), global_batch(seq_len)
    steps = {}
    for mode in (UNTILED, TILED_2X2):
        model, loss_fn = _ring_sp_step(mode, config, batch, tile_tokens, topo)
        steps[mode.name] = (loss_fn, warm_optimizer(model))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds + 1):  # the first round warms up
        for name, (loss_fn, optimizer) in steps.items():
            torch.distributed.barrier(group=sp_group())
            start = time.perf_counter()
            loss_fn().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            times[name].append(time.perf_counter() - start)
    return {name: t[1:] for name, t in times.items()}


@dataclass(frozen=True)
class LengthConfig:
    seq_lens: tuple[int, ...] = (8192, 16384, 32768, 65536)
    sp: int = 4
    tile_tokens: int | None = None  # ring_sp's tiles (MLP and loss); None: sized by the library
    loss_tile_tokens: int = 1024  # ALST's loss tiles: the same size (its MLP keeps its own ceil(n / hidden) rule)
    budget_bytes: float = 6 * 2**30  # points predicted above this per process are skipped
    machine_bytes: float = 8 * 2**30  # ... or whose processes together would exceed this
    timing_seq_lens: tuple[int, ...] = (4096, 8192)  # step time of ring_sp tiled vs untiled (U2xR2), alternated
    timing_rounds: int = 3
    demo_budget_bytes: float = 2**30  # the longest-sequence demo: this much per rank


SMALL_LLAMA = Transformer(hidden=256, ffn=1024, heads=8, kv_heads=4, head_dim=32, layers=2, vocab=VOCAB,
                          name="small HF Llama")
PROCESS_BYTES = 2**29  # a rank's interpreter, torch and transformers, beyond its tensors


def training_of(mode: LengthMode, cfg: LengthConfig) -> tuple[Training, int, int]:
    """How ``ring_sp.plan.step_memory`` describes ``mode`` (fp32, no ZeRO, AdamW, the benchmark's
    tile sizes), and its grid (U, R)."""
    ranks = mode.world_size(cfg.sp)
    ours = mode.kind != "alst"
    training = Training(dtype="fp32", attention_kernel="cpu", tiled_mlp=mode.tiled, tiled_loss=mode.tiled,
                        mlp_tile_tokens=cfg.tile_tokens if ours else None,
                        loss_tile_tokens=cfg.tile_tokens if ours else cfg.loss_tile_tokens,
                        library="ring_sp" if ours else "alst", lean_layers=ours and mode.tiled,  # on with tiling
                        head_chunks=mode.head_chunks if ours and mode.tiled else None)
    u = mode.ulysses if ranks > 1 else 1
    return training, u, ranks // u


def predict(mode: LengthMode, seq_len: int, cfg: LengthConfig | None = None) -> StepMemory:
    """``ring_sp.plan.step_memory``'s peak per rank for ``mode`` on :data:`SMALL_LLAMA`."""
    training, u, r = training_of(mode, cfg or LengthConfig())
    return step_memory(SMALL_LLAMA, training, seq_len=seq_len, ulysses=u, ring=r)


def skip_reason(mode: LengthMode, seq_len: int, cfg: LengthConfig) -> str | None:
    """Why a point is not run on this shared machine, or None: the step's predicted peak per
    rank (plus the process itself) over ``budget_bytes``, or all ranks together over
    ``machine_bytes``."""
    ranks = mode.world_size(cfg.sp)
    per_rank = predict(mode, seq_len, cfg).total + PROCESS_BYTES
    if per_rank > cfg.budget_bytes or per_rank * ranks > cfg.machine_bytes:
        return (f"skipped: predicted {per_rank / 2**30:.1f} GiB per rank x {ranks} rank(s) exceeds this shared "
                f"machine's budget ({cfg.budget_bytes / 2**30:.0f} GiB per process, "
                f"{cfg.machine_bytes / 2**30:.0f} GiB in all)")
    return None


def run_point(run: Launcher, mode: LengthMode, seq_len: int, cfg: LengthConfig) -> dict[str, Any]:
    """One point in a fresh set of processes (a new pool, closed after it; under torchrun the world)."""
    ranks = mode.world_size(cfg.sp)
    fresh = not isinstance(run, TorchrunLauncher)
    launcher = PoolLauncher() if fresh else run
    try:
        results = launcher.run(length_case, ranks, mode, seq_len, cfg.tile_tokens, cfg.loss_tile_tokens)
    except Exception as exc:  # a mode that cannot run (e.g. not installed) is reported, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
    finally:
        if fresh:
            launcher.close()
    return {"peak_bytes": max(r["peak_bytes"] for r in results), "peak_bytes_per_rank": [r["peak_bytes"] for r in results],
            "resident_bytes": results[0]["resident_bytes"], "loss": results[0]["loss"], "ranks": ranks}


def length(run: Launcher, cfg: Any, log: Callable[[str], None], length_cfg: LengthConfig | None = None
           ) -> list[dict[str, Any]]:
    """Every mode at every length (each point in fresh processes, one at a time), then the
    step time of ring_sp tiled vs untiled."""
    lc = length_cfg or (LengthConfig(seq_lens=(2048, 4096), timing_seq_lens=(2048,)) if cfg.seq_lens[0] < 1024
                        else LengthConfig())
    records = []
    for n in lc.seq_lens:
        for mode in LENGTH_MODES:
            record = {"section": "length", "mode": mode.name, "seq_len": n, "world_size": mode.world_size(lc.sp),
                      "predicted_bytes": predict(mode, n, lc).total}
            reason = skip_reason(mode, n, lc)
            if reason is not None:
                records.append({**record, "skipped": reason})
                continue
            log(f"length N={n}: {mode.name}")
            records.append({**record, **run_point(run, mode, n, lc)})
    for n in lc.timing_seq_lens:
        log(f"length: step time at N={n}, ring_sp tiled vs untiled")
        records.append(timing_record(run, lc, n))
    return records


def timing_record(run: Launcher, lc: LengthConfig, seq_len: int) -> dict[str, Any]:
    fresh = not isinstance(run, TorchrunLauncher)
    launcher = PoolLauncher() if fresh else run
    try:
        per_rank = launcher.run(step_time_case, lc.sp, seq_len, lc.tile_tokens, lc.timing_rounds)
    finally:
        if fresh:
            launcher.close()
    # a step lasts as long as its slowest rank; the median over rounds
    steps = {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(lc.timing_rounds))
             for name in per_rank[0]}
    return {"section": "length_timing", "seq_len": seq_len, "world_size": lc.sp, "step_s": steps,
            "tiled_over_untiled": steps[TILED_2X2.name] / steps[UNTILED.name]}


def _total(r: dict[str, Any]) -> float:
    return r["resident_bytes"] + r["peak_bytes"]


def markdown(records: list[dict[str, Any]], lc: LengthConfig | None = None) -> str:
    """The section's tables: peak per rank vs N, growth per token, the planner against the
    measurements, the step time, and the longest sequence within the demo budget."""
    lc = lc or LengthConfig()
    rows = [r for r in records if r["section"] == "length"]
    seq_lens = sorted({r["seq_len"] for r in rows})
    cell = {(r["mode"], r["seq_len"]): r for r in rows}
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    body = []
    for mode in LENGTH_MODES:
        cells = []
        for n in seq_lens:
            r = cell.get((mode.name, n), {})
            if "peak_bytes" in r:
                cells.append(f"{mib(_total(r))} ({mib(r['predicted_bytes'])})")
            elif "skipped" in r:
                cells.append(f"skipped ({mib(r['predicted_bytes'])} predicted)")
            else:
                cells.append(r.get("error", "-"))
        body.append([mode.name] + cells)
    out = ["Peak memory per rank of one training step, MiB (parameters, gradients and AdamW state, "
           f"{mib(rows[0].get('resident_bytes', 0) or predict(SINGLE, 1024, lc).params * 4)} MiB, included; "
           "in brackets the planner's prediction):", ""] + table(["mode"] + [f"N={n:,}" for n in seq_lens], body)
    body = []
    for mode in LENGTH_MODES:
        measured = [(n, _total(cell[mode.name, n])) for n in seq_lens if "peak_bytes" in cell.get((mode.name, n), {})]
        body += [[mode.name, f"{n0:,} -> {n1:,}", f"{(b1 - b0) / (n1 - n0):,.1f}"]
                 for (n0, b0), (n1, b1) in zip(measured, measured[1:])]
    out += ["", "Growth per token between measured lengths, bytes of peak per rank per token of N:", ""]
    out += table(["mode", "interval", "bytes / token"], body)
    spreads = []
    for n in seq_lens:
        losses = [r["loss"] for r in rows if r["seq_len"] == n and "loss" in r]
        if len(losses) > 1:
            spreads.append(f"N={n:,}: {max(losses) - min(losses):.1e} over {len(losses)} modes")
    out += ["", "Losses, largest difference between modes: " + "; ".join(spreads) + "."]
    worst = max((abs(r["predicted_bytes"] / _total(r) - 1) for r in rows if "peak_bytes" in r), default=0.0)
    out += ["", f"Planner (`ring_sp.plan.step_memory`) against every measured point: largest error {100 * worst:.1f}%."]
    timing = [r for r in records if r["section"] == "length_timing"]
    for t in timing:
        steps = ", ".join(f"{name} {sec:.2f} s" for name, sec in t["step_s"].items())
        out += ["", f"Step time at N={t['seq_len']:,} on {t['world_size']} ranks (median of the slowest rank, "
                    f"alternated): {steps}; tiled / untiled = {t['tiled_over_untiled']:.3f}."]
    body = []
    for mode in LENGTH_MODES:
        training, u, r = training_of(mode, lc)
        n, step = max_seq_len(SMALL_LLAMA, training, lc.demo_budget_bytes, ulysses=u, ring=r)
        fits = [(m, _total(cell[mode.name, m])) for m in seq_lens
                if "peak_bytes" in cell.get((mode.name, m), {}) and _total(cell[mode.name, m]) <= lc.demo_budget_bytes]
        measured = f"{fits[-1][0]:,} ({mib(fits[-1][1])})" if fits else f"none of {seq_lens[0]:,}..{seq_lens[-1]:,}"
        body.append([mode.name, measured, f"{n:,}", mib(step.total) if step else "-"])
    out += ["", f"Longest sequence within {lc.demo_budget_bytes / 2**30:.0f} GiB per rank: the longest measured N "
                "whose peak fits (a run), and the calibrated planner's (multiples of 2 x ranks):", ""]
    out += table(["mode", "longest measured N that fits (its peak MiB)", "planner's longest N",
                  "its predicted peak MiB"], body)
    return "\n".join(out) + "\n"


def plot(records: list[dict[str, Any]], path) -> Any:
    """Peak memory per rank vs N, log-log: measured points, the planner's predictions dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["section"] == "length"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    seq_lens = sorted({r["seq_len"] for r in rows})
    for i, mode in enumerate(LENGTH_MODES):
        mine = sorted((r for r in rows if r["mode"] == mode.name), key=lambda r: r["seq_len"])
        color = f"C{i}"
        measured = [r for r in mine if "peak_bytes" in r]
        ax.plot([r["seq_len"] for r in measured], [_total(r) / 2**20 for r in measured], "o-", color=color,
                label=mode.name)
        ax.plot([r["seq_len"] for r in mine], [r["predicted_bytes"] / 2**20 for r in mine], "--", color=color,
                alpha=0.5)
    ax.set(xscale="log", yscale="log", xlabel="sequence length N (tokens)", ylabel="peak MiB per rank",
           title="One training step, small HF Llama, 4 CPU ranks (dashed: planner)")
    ax.set_xticks(seq_lens, labels=[f"{n // 1024}K" for n in seq_lens])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
