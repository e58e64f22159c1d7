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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .launch import Launcher, PoolLauncher, TorchrunLauncher, device, sp_group
from .memory import PeakMemory

VOCAB = 32768


@dataclass(frozen=True)
class LengthMode:
    """One way to train the step: ``kind`` "ring_sp", "alst" or "single"."""

    name: str
    kind: str
    ulysses: int = 1
    tiled: bool = False

    def world_size(self, sp: int) -> int:
        return 1 if self.kind == "single" else sp


UNTILED = LengthMode("ring_sp untiled U2xR2", "ring_sp", 2)
TILED_2X2 = LengthMode("ring_sp tiled U2xR2", "ring_sp", 2, tiled=True)
TILED_1X4 = LengthMode("ring_sp tiled U1xR4", "ring_sp", 1, tiled=True)
ALST = LengthMode("ALST Ulysses SP4 + TiledMLP + tiled loss", "alst", 4, tiled=True)
SINGLE = LengthMode("one rank untiled", "single")
LENGTH_MODES = (UNTILED, TILED_2X2, TILED_1X4, ALST, SINGLE)


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


def _ring_sp_step(mode: LengthMode, config, batch: dict[str, torch.Tensor], tile_tokens: int | None):
    import ring_sp
    import ring_sp.integrations.transformers as rsp_hf

    p = torch.distributed.get_world_size(sp_group())
    topo = ring_sp.init_sequence_parallel(mode.ulysses, p // mode.ulysses)
    rsp_hf.register(topo, layout="zigzag")
    model = _model(config, "ring_sp")
    if mode.tiled:
        rsp_hf.enable_long_sequence(model, tiled_mlp=True, tiled_loss=True, tile_tokens=tile_tokens)
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
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF

    from examples.common.deepspeed_cpu import skip_cpu_inference_comm_build

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
    import ring_sp.integrations.transformers as rsp_hf

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


@dataclass(frozen=True)
class LengthConfig:
    seq_lens: tuple[int, ...] = (8192, 16384, 32768, 65536)
    sp: int = 4
    tile_tokens: int | None = None  # ring_sp's tiled modes: None = its default
    loss_tile_tokens: int = 1024  # ALST's loss tiles
    budget_bytes: float = 6 * 2**30  # points whose untiled estimate exceeds this per process are skipped
    machine_bytes: float = 8 * 2**30  # ... or whose processes together would exceed this


# Bytes per token of the untiled step on one process (4 fp32 copies of the logits dominate),
# used only to skip points that would not fit this shared machine; measured 566 KiB/token.
UNTILED_BYTES_PER_TOKEN = 566 * 1024


def skip_reason(mode: LengthMode, seq_len: int, cfg: LengthConfig) -> str | None:
    """Why a point is not run here, or None: untiled modes whose estimate exceeds the budget."""
    if mode.tiled:
        return None
    ranks = mode.world_size(cfg.sp)
    per_rank = UNTILED_BYTES_PER_TOKEN * seq_len / ranks
    if per_rank > cfg.budget_bytes or per_rank * ranks > cfg.machine_bytes:
        return (f"skipped: about {per_rank / 2**30:.1f} GiB per rank x {ranks} rank(s) (untiled) would exceed "
                f"this shared machine's budget")
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
    """Every mode at every length (the big points one at a time, each in fresh processes)."""
    lc = length_cfg or (LengthConfig(seq_lens=(2048, 4096)) if cfg.seq_lens[0] < 1024 else LengthConfig())
    records = []
    for n in lc.seq_lens:
        for mode in LENGTH_MODES:
            record = {"section": "length", "mode": mode.name, "seq_len": n, "world_size": mode.world_size(lc.sp)}
            reason = skip_reason(mode, n, lc)
            if reason is not None:
                records.append({**record, "skipped": reason})
                continue
            log(f"length N={n}: {mode.name}")
            records.append({**record, **run_point(run, mode, n, lc)})
    return records
