"""C19: Hugging Face transformers models on the grid (``attn_implementation="ring_sp"``).

Each distributed case builds a small model from a config (Llama GQA, Qwen3, Mistral
without a window), copies it, and compares on every rank

* the SP model (``"ring_sp"``, this rank's shard from ``shard_batch``): logits gathered over
  the SP group, the loss of ``causal_lm_loss``, and the parameter gradients summed over the
  SP group (the reduction ``gradients_averaged_over_sp=False`` assumes);
* the same model on one rank with transformers' own ``"sdpa"`` on the whole GLOBAL batch
  (packed rows through transformers' own position_ids packing detection), with
  transformers' own loss.

fp32 tolerances (TESTING.md C19): logits within 2e-4 x max(1, max |logit|); every
parameter's gradient within 1e-4 x its largest reference entry. bf16 (model in bf16, both
sides against the fp32 reference): the SP error at most 2x the one-rank bf16 error plus
1e-2 x max(1, max |logit|) (logits), 2x plus 2e-2 x the largest entry (gradients).
transformers is imported inside the case functions (ranks import it once per pool).
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'ring-sp[transformers]')")

VOCAB = 64
DOCS = (5, 12, 1, 9, 5)  # packed row of 32 tokens: a 1-token document, documents across shard borders
FP32_LOGITS, FP32_GRADS = 2e-4, 1e-4


# ---------------------------------------------------------------- helpers run on the ranks

def _config(arch: str, *, heads: int = 4, kv_heads: int = 2, **overrides: Any):
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=256,
                  attention_dropout=0.0, tie_word_embeddings=False)
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(**common, use_sliding_window=False)
    elif arch == "mistral":
        config = MistralConfig(**common, sliding_window=None)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _global_batch(packed: bool, rows: int = 2, seq: int = 32) -> dict[str, torch.Tensor]:
    """The same GLOBAL batch on every rank. Packed: one row in DataCollatorWithFlattening's form."""
    g = torch.Generator().manual_seed(7)
    if not packed:
        ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # ranks then hold different numbers of valid tokens
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    labels = ids.clone()
    labels[positions == 0] = -100  # the collator's separator: no target across documents
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _real_tokens(shard: dict[str, torch.Tensor]) -> torch.Tensor:
    """Indices of the global row's real tokens inside the (possibly padded) sharded row."""
    if "cu_seq_lens_q" not in shard:
        return torch.arange(sum(DOCS))  # unused for unpacked rows
    cu = shard["cu_seq_lens_q"].tolist()
    return torch.cat([torch.arange(a, a + n) for a, n in zip(cu, DOCS)])


def _models(arch: str, dtype: torch.dtype, how: str, **config_overrides: Any):
    """(reference with "sdpa", SP copy with "ring_sp"): same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(_config(arch, **config_overrides), attn_implementation="sdpa")
    reference = reference.to(dtype).train()
    if how == "set":
        model = copy.deepcopy(reference)
        model.set_attn_implementation("ring_sp")
    else:
        model = AutoModelForCausalLM.from_config(_config(arch, **config_overrides), attn_implementation="ring_sp")
        model.load_state_dict(reference.state_dict())
        model = model.to(dtype).train()
    assert model.config._attn_implementation == "ring_sp"
    return reference, model


def _reference_run(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    inputs = {k: v for k, v in batch.items() if k != "attention_mask"}
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    return out.logits.detach().float(), out.loss.item(), grads


def _sp_run(model, batch: dict[str, torch.Tensor], topo) -> tuple[dict, torch.Tensor, float, dict[str, torch.Tensor]]:
    import torch.distributed as dist

    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.transformers.features import layout_for

    shard = rsp_hf.shard_batch(batch, topo)
    logits = model(**shard).logits  # the config's default use_cache=True: a training forward must work
    loss = rsp_hf.causal_lm_loss(logits, shard["shift_labels"], topology=topo, gradients_averaged_over_sp=False)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().float().clone()
        dist.all_reduce(g, group=topo.sp_group)  # the sum over SP ranks is the full gradient
        grads[name] = g
    cu = shard.get("cu_seq_lens_q")
    layout = layout_for("zigzag", packed=cu is not None)
    gathered = {key: topo.gather_sequence(shard[key], layout=layout, cu_seqlens=cu) for key in ("input_ids", "position_ids")}
    gathered["logits"] = topo.gather_sequence(logits.detach().float(), layout=layout, cu_seqlens=cu)
    return shard, gathered, loss.item(), grads


def _scaled(logits, ref_logits, grads, ref_grads) -> dict[str, float]:
    """Max logit error over max(1, max |logit|); max over parameters of the gradient error over its largest entry."""
    return {
        "logits": (logits - ref_logits).abs().max().item() / max(1.0, ref_logits.abs().max().item()),
        "grads": max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() for n, g in ref_grads.items()),
    }


def _errors(ref_logits, gathered, shard, batch, ref_loss, loss, ref_grads, grads) -> dict[str, Any]:
    """C19's errors, plus whether the gathered shards' ids and positions are the global ones."""
    logits, ids, positions = gathered["logits"], gathered["input_ids"], gathered["position_ids"]
    want_positions = batch.get("position_ids", torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]))
    if "cu_seq_lens_q" in shard:  # packed: drop the padding document_zigzag added
        real = _real_tokens(shard)
        logits, ids, positions = logits[:, real], ids[:, real], positions[:, real]
    return {**_scaled(logits, ref_logits, grads, ref_grads), "loss": abs(loss - ref_loss),
            "ids_equal": torch.equal(ids, batch["input_ids"]), "positions_equal": torch.equal(positions, want_positions)}


def equivalence_case(arch: str, u: int, r: int, packed: bool, dtype_name: str = "fp32", how: str = "from_config",
                     rows: int = 2, **config_overrides: Any) -> dict[str, Any]:
    """SP model vs the same model with sdpa on one rank (see the module docstring)."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    topo = dist_cases.topology(u, r)
    assert rsp_hf.register(topo, layout="zigzag") == "ring_sp"
    batch = _global_batch(packed, rows=rows)
    if dtype_name == "fp32":
        reference, model = _models(arch, torch.float32, how, **config_overrides)
        ref_logits, ref_loss, ref_grads = _reference_run(reference, batch)
        shard, gathered, loss, grads = _sp_run(model, batch, topo)
        return _errors(ref_logits, gathered, shard, batch, ref_loss, loss, ref_grads, grads)
    # bf16: the SP error against the fp32 reference vs the one-rank bf16 error against it
    reference32, _ = _models(arch, torch.float32, how, **config_overrides)
    reference16, model = _models(arch, torch.bfloat16, how, **config_overrides)
    ref_logits, ref_loss, ref_grads = _reference_run(reference32, batch)
    one_logits, one_loss, one_grads = _reference_run(reference16, batch)
    shard, gathered, loss, grads = _sp_run(model, batch, topo)
    sp = _errors(ref_logits, gathered, shard, batch, ref_loss, loss, ref_grads, grads)
    one = {**_scaled(one_logits, ref_logits, one_grads, ref_grads), "loss": abs(one_loss - ref_loss)}
    return {"sp": sp, "one_rank": one}


# ---------------------------------------------------------------- fp32 / bf16 equivalence

GRID4 = [(1, 4), (2, 2), (4, 1)]


def _check_fp32(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["ids_equal"] and res["positions_equal"], f"rank {rank}: the shards are not the global batch"
        assert res["logits"] <= FP32_LOGITS, f"rank {rank}: logits error {res['logits']:.2e} > {FP32_LOGITS}"
        assert res["grads"] <= FP32_GRADS, f"rank {rank}: gradient error {res['grads']:.2e} > {FP32_GRADS}"
        assert res["loss"] <= 1e-5, f"rank {rank}: loss error {res['loss']:.2e}"


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("u,r", GRID4, ids=[f"U{u}xR{r}" for u, r in GRID4])
def test_llama_gqa_fp32(pools, u: int, r: int, packed: bool) -> None:
    _check_fp32(pools.get(4).run(equivalence_case, "llama", u, r, packed, timeout=300))


@pytest.mark.parametrize("arch,u,r,packed,how", [
    ("qwen3", 2, 2, False, "set"),
    ("qwen3", 1, 4, True, "set"),
    ("mistral", 4, 1, False, "from_config"),
    ("mistral", 2, 2, True, "set"),
])
def test_qwen3_mistral_fp32(pools, arch: str, u: int, r: int, packed: bool, how: str) -> None:
    _check_fp32(pools.get(4).run(equivalence_case, arch, u, r, packed, "fp32", how, timeout=300))


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_sp_degree_beyond_heads_u2xr4(pools, packed: bool) -> None:
    """2 KV heads / 4 query heads on 8 ranks (U2 x R4): beyond Ulysses' (and ALST's) head cap."""
    results = pools.get(8).run(equivalence_case, "llama", 2, 4, packed, "fp32", "from_config", 1, timeout=300)
    _check_fp32(results)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_llama_bf16(pools, packed: bool) -> None:
    for rank, res in enumerate(pools.get(4).run(equivalence_case, "llama", 2, 2, packed, "bf16", timeout=300)):
        sp, one = res["sp"], res["one_rank"]
        assert sp["ids_equal"] and sp["positions_equal"]
        assert sp["logits"] <= 2 * one["logits"] + 1e-2, f"rank {rank}: bf16 logits {sp['logits']:.2e} vs one rank {one['logits']:.2e}"
        assert sp["grads"] <= 2 * one["grads"] + 2e-2, f"rank {rank}: bf16 grads {sp['grads']:.2e} vs one rank {one['grads']:.2e}"
        assert sp["loss"] <= 2 * one["loss"] + 1e-2
