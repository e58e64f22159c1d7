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
import re
import subprocess
import sys
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'ring-sp[transformers]')")

VOCAB = 64
DOCS = (5, 12, 1, 9, 5)  # packed row of 32 tokens: a 1-token document, documents across shard borders
ODD_DOCS = (5, 12, 1, 9, 2)  # 29 tokens: not a multiple of 2 x SP = 8
FP32_LOGITS, FP32_GRADS = 2e-4, 1e-4
WINDOW = 6  # a sliding window smaller than every sequence here, crossing the shard borders (4 tokens per chunk)


# ---------------------------------------------------------------- helpers run on the ranks

def _config(arch: str, *, heads: int = 4, kv_heads: int = 2, **overrides: Any):
    from transformers import DeepseekV3Config, Gemma3TextConfig, GptOssConfig, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=256,
                  attention_dropout=0.0, tie_word_embeddings=False)
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(**common, use_sliding_window=False)
    elif arch == "mistral":
        config = MistralConfig(**common, sliding_window=None)
    elif arch == "gpt_oss":  # attention sinks; a sliding layer then a full one (gpt-oss's pattern)
        config = GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"])
    elif arch == "gemma3":  # its own scale (query_pre_attn_scalar), sliding and full layers with their own RoPE
        config = Gemma3TextConfig(**common, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention"])
    elif arch == "deepseek_v3":  # MLA: keys of a no-RoPE and a RoPE part (8 + 4), values of their own size (6);
        # every expert routed (top-2 of 2): a top-1 router's near-ties flip under the float differences of any
        # sharding (measured: the gate's gradient 0.3-0.4 off, every other gradient exact), a discrete change
        config = DeepseekV3Config(**{**common, "num_key_value_heads": heads, "head_dim": 4}, q_lora_rank=None, kv_lora_rank=16,
                                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, moe_intermediate_size=16,
                                  n_routed_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=1)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _global_batch(packed: bool, rows: int = 2, seq: int = 32, docs: tuple[int, ...] = DOCS) -> dict[str, torch.Tensor]:
    """The same GLOBAL batch on every rank. Packed: one row of ``docs`` in DataCollatorWithFlattening's form."""
    g = torch.Generator().manual_seed(7)
    if not packed:
        ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # ranks then hold different numbers of valid tokens
        return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    ids = torch.randint(0, VOCAB, (1, sum(docs)), generator=g)
    positions = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    labels = ids.clone()
    labels[positions == 0] = -100  # the collator's separator: no target across documents
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def _models(arch: str, dtype: torch.dtype, how: str, **config_overrides: Any):
    """(reference with "sdpa", or "eager" for gpt-oss's sinks, SP copy with "ring_sp"): same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference_impl = "eager" if arch == "gpt_oss" else "sdpa"  # transformers' sdpa path has no sinks
    reference = AutoModelForCausalLM.from_config(_config(arch, **config_overrides), attn_implementation=reference_impl)
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


def _packed_masks(model, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt-oss's masks with packed documents: its model (transformers 5.18) builds them without
    position_ids, so its eager/sdpa paths would let documents see each other."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = dict(config=model.config, inputs_embeds=model.get_input_embeddings()(inputs["input_ids"]), attention_mask=None,
                  past_key_values=None, position_ids=inputs["position_ids"])
    return {"full_attention": create_causal_mask(**kwargs), "sliding_attention": create_sliding_window_causal_mask(**kwargs)}


def _reference_run(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    inputs = {k: v for k, v in batch.items() if k != "attention_mask"}
    if model.config.model_type == "gpt_oss" and "position_ids" in inputs:
        inputs["attention_mask"] = _packed_masks(model, inputs)
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
    real = batch["input_ids"].numel() if cu is not None else None  # one flattened row: drop its tail padding
    gathered = {key: topo.gather_sequence(shard[key], layout=layout, cu_seqlens=cu, seq_len=real)
                for key in ("input_ids", "position_ids")}
    gathered["logits"] = topo.gather_sequence(logits.detach().float(), layout=layout, cu_seqlens=cu, seq_len=real)
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
    if "cu_seq_lens_q" in shard:  # one flattened row (padding already dropped): back to the batch's rows
        rows = batch["input_ids"].shape
        logits, ids, positions = logits.reshape(*rows, -1), ids.reshape(rows), positions.reshape(rows)
    return {**_scaled(logits, ref_logits, grads, ref_grads), "loss": abs(loss - ref_loss),
            "ids_equal": torch.equal(ids, batch["input_ids"]), "positions_equal": torch.equal(positions, want_positions)}


def equivalence_case(arch: str, u: int, r: int, packed: bool, dtype_name: str = "fp32", how: str = "from_config",
                     rows: int = 2, seq: int = 32, docs: tuple[int, ...] = DOCS, kv_exchange: str = "ring",
                     **config_overrides: Any) -> dict[str, Any]:
    """SP model vs the same model with sdpa (eager for sinks) on one rank (see the module docstring)."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    topo = dist_cases.topology(u, r)
    assert rsp_hf.register(topo, layout="zigzag", kv_exchange=kv_exchange) == "ring_sp"
    batch = _global_batch(packed, rows=rows, seq=seq, docs=docs)
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


# ---------------------------------------------------------------- one process: translation, batches, import

class _Attention(torch.nn.Module):
    """What ring_sp_call_options reads of an HF attention module."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__()
        self.config = type("Config", (), {"architectures": ["ToyForCausalLM"], "model_type": "toy"})()
        self.layer_idx, self.is_causal = 3, True
        for key, value in attrs.items():
            setattr(self, key, value)


def _options(module=None, mask=None, kv_len: int = 8, **kwargs: Any) -> dict[str, Any]:
    from ring_sp.integrations.transformers.features import ring_sp_call_options

    q, k = torch.zeros(1, 4, 8, 8), torch.zeros(1, 2, kv_len, 8)
    return ring_sp_call_options(module or _Attention(), q, k, mask, kwargs, layout="zigzag", backend="auto")


def test_call_options_translate_an_hf_call() -> None:
    assert _options(scaling=0.25, dropout=0.0, sliding_window=None, s_aux=None, position_ids=None, use_cache=True) == \
        dict(causal=True, layout="zigzag", softmax_scale=0.25, backend="auto", cu_seqlens=None, spans=None,
             sliding_window=None, sinks=None)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    packed = _options(cu_seq_lens_q=cu, cu_seq_lens_k=cu, is_causal=False)
    assert (packed["layout"], packed["cu_seqlens"], packed["causal"]) == ("document_zigzag", (0, 8, 16), False)
    assert _options(_Attention(is_causal=False))["causal"] is False
    sinks = torch.nn.Parameter(torch.zeros(4))
    assert _options(sliding_window=4, s_aux=sinks)["sliding_window"] == 4 and _options(s_aux=sinks)["sinks"] is sinks
    module = _options(_Attention(sliding_window=16, sinks=sinks))  # gpt-oss keeps both on the module too
    assert module["sliding_window"] == 16 and module["sinks"] is sinks


def test_model_config_takes_sliding_layers_and_refuses_chunks() -> None:
    from ring_sp.integrations.transformers.features import UnsupportedFeatureError, check_model_config

    config = type("Config", (), {"model_type": "toy", "sliding_window": 4})()
    config.layer_types = ["full_attention", "sliding_attention"]
    check_model_config(config)  # Mistral-style config.sliding_window and mixed layer types run
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedFeatureError, match=r"attention layer types \['chunked_attention'\]"):
        check_model_config(config)


@pytest.mark.parametrize("module,kwargs,mask,kv_len,pattern", [
    (None, {"dropout": 0.1}, None, 8, r"uses attention dropout 0.1"),
    (None, {"softcap": 30.0}, None, 8, r"uses attention logit softcapping"),
    (None, {"position_bias": torch.zeros(1)}, None, 8, r"uses an additive attention bias \(position_bias\)"),
    (None, {}, torch.zeros(1, 1, 8, 8), 8, r"uses a 4-D attention mask"),
    (None, {}, None, 12, r"uses keys of length 12 for queries of length 8"),
])
def test_unsupported_call_names_model_feature_and_fix(module, kwargs, mask, kv_len, pattern) -> None:
    import ring_sp.integrations.transformers as rsp_hf

    with pytest.raises(rsp_hf.UnsupportedFeatureError, match=r"ToyForCausalLM \(model_type 'toy'\), _Attention of layer 3 " + pattern):
        _options(module, mask, kv_len, **kwargs)


def test_cu_seq_lens_must_agree() -> None:
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k must both be given and equal"):
        _options(cu_seq_lens_q=torch.tensor([0, 8]), cu_seq_lens_k=torch.tensor([0, 4, 8]))


def test_shard_batch_takes_data_collator_with_flattening() -> None:
    """The collator's packed row (with its flash kwargs): boundaries found, labels shifted inside documents."""
    from transformers import DataCollatorWithFlattening

    import ring_sp.integrations.transformers as rsp_hf

    docs = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    shard = rsp_hf.shard_batch(batch, None)
    assert sorted(shard) == ["cu_seq_lens_k", "cu_seq_lens_q", "input_ids", "position_ids", "ring_sp_shard", "shift_labels"]
    assert shard["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and shard["cu_seq_lens_q"].dtype == torch.int32
    assert shard["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert shard["shift_labels"].tolist() == [[12, 13, -100, 22, -100, 32, 33, 34, -100]]
    assert torch.equal(shard["input_ids"], batch["input_ids"])


def test_shard_batch_flattens_packed_rows_and_keeps_plain_rows() -> None:
    import ring_sp.integrations.transformers as rsp_hf

    ids = torch.arange(12).reshape(2, 6)
    packed = rsp_hf.shard_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])}, None)
    assert packed["input_ids"].tolist() == [list(range(12))] and packed["cu_seq_lens_q"].tolist() == [0, 3, 6, 12]
    plain = rsp_hf.shard_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                "position_ids": torch.arange(6).unsqueeze(0)}, None)
    assert sorted(plain) == ["input_ids", "position_ids", "ring_sp_shard", "shift_labels"]
    assert plain["shift_labels"].tolist() == [[1, 2, 3, 4, 5, -100], [7, 8, 9, 10, 11, -100]]
    assert plain["position_ids"].tolist() == [list(range(6))] * 2


@pytest.mark.parametrize("batch,error,pattern", [
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])},
     ValueError, r"attention_mask'\] has zeros \(padding\).*DataCollatorWithFlattening"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]]),
      "cu_seq_lens_q": torch.tensor([0, 4])}, ValueError, r"describe different documents"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 2, 4])},
     ValueError, r"must describe ONE flattened row"),
    ({"input_ids": torch.ones(4)}, ValueError, r"must be an integer tensor \[batch, seq\]"),
    ({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": [1, 2, 3, 4]}, TypeError, r"batch\['labels'\] must be a tensor"),
    ({"tokens": torch.ones(1, 4)}, ValueError, r"mapping with 'input_ids'"),
])
def test_shard_batch_errors(batch, error, pattern) -> None:
    import ring_sp.integrations.transformers as rsp_hf

    with pytest.raises(error, match=pattern):
        rsp_hf.shard_batch(batch, None)


def test_import_needs_no_transformers() -> None:
    code = ("import sys, ring_sp.integrations.transformers, ring_sp.integrations.deepspeed; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_causal_lm_loss_needs_one_gradient_convention() -> None:
    import ring_sp.integrations.transformers as rsp_hf

    logits, labels = torch.randn(1, 4, 8), torch.tensor([[1, 2, -100, 3]])
    plain = torch.nn.functional.cross_entropy(logits[0], labels[0])
    assert torch.allclose(rsp_hf.causal_lm_loss(logits, labels), plain)  # no SP: the plain mean
    with pytest.raises(ValueError, match="pass engine= alone"):
        rsp_hf.causal_lm_loss(logits, labels, engine=object(), gradients_averaged_over_sp=True)
    with pytest.raises(ValueError, match="gradients_averaged_over_sp= needs topology="):
        rsp_hf.causal_lm_loss(logits, labels, gradients_averaged_over_sp=True)
    with pytest.raises(ValueError, match="must agree on \\[batch, seq\\]"):
        rsp_hf.causal_lm_loss(logits, labels[:, :3])


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


def test_llama_gqa_all_gather_kv_fp32(pools) -> None:
    """register(kv_exchange="all_gather"): every layer's ring group gathers its KV (packed, U2xR2)."""
    _check_fp32(pools.get(4).run(equivalence_case, "llama", 2, 2, True, kv_exchange="all_gather", timeout=300))


@pytest.mark.parametrize("arch,u,r,packed,how", [
    ("qwen3", 2, 2, False, "set"),
    ("qwen3", 1, 4, True, "set"),
    ("mistral", 4, 1, False, "from_config"),
    ("mistral", 2, 2, True, "set"),
])
def test_qwen3_mistral_fp32(pools, arch: str, u: int, r: int, packed: bool, how: str) -> None:
    _check_fp32(pools.get(4).run(equivalence_case, arch, u, r, packed, "fp32", how, timeout=300))


def test_deepseek_v3_mla_fp32(pools) -> None:
    """MLA (keys of a no-RoPE and a RoPE part, values of their own head size) at U2xR2, packed documents."""
    _check_fp32(pools.get(4).run(equivalence_case, "deepseek_v3", 2, 2, True, "fp32", "set", timeout=300))


WINDOWED = {  # a window on every layer (Mistral), on some layers (Qwen3 layer_types, Gemma 3), sinks + alternating (gpt-oss)
    "mistral": dict(sliding_window=WINDOW),
    "gemma3": {},
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"]),
    "gpt_oss": {},
}


@pytest.mark.parametrize("arch,u,r,packed", [
    ("mistral", 2, 2, False),
    ("mistral", 1, 4, True),
    ("qwen3", 2, 2, True),
    ("gpt_oss", 2, 2, False),
    ("gpt_oss", 2, 2, True),
    ("gemma3", 2, 2, False),
    ("gemma3", 2, 2, True),
])
def test_sliding_windows_and_sinks_fp32(pools, arch: str, u: int, r: int, packed: bool) -> None:
    """Windows smaller than the sequence and crossing shard borders, and gpt-oss's sinks (their
    gradient summed over the SP group), equal the same model on one rank."""
    _check_fp32(pools.get(4).run(equivalence_case, arch, u, r, packed, "fp32", "from_config", **WINDOWED[arch],
                                 timeout=300))


@pytest.mark.parametrize("arch,packed", [("llama", False), ("mistral", True)], ids=["unpacked", "packed"])
def test_any_length_fp32(pools, arch: str, packed: bool) -> None:
    """29 tokens per row (not a multiple of 2 x SP = 8) on U2xR2: unpacked rows become documents of one
    flattened row; packed documents of any length; the tail padding never reaches loss or logits."""
    _check_fp32(pools.get(4).run(equivalence_case, arch, 2, 2, packed, "fp32", "from_config", 2, 29, ODD_DOCS,
                                 **WINDOWED.get(arch, {}), timeout=300))


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


# ---------------------------------------------------------------- a checkpoint from an SP run

def checkpoint_case(path: str) -> dict[str, float]:
    """One SP training step (U2 x R2), save_pretrained on rank 0, load in plain transformers: same logits."""
    import json

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    topo = dist_cases.topology(2, 2)
    rsp_hf.register(topo)
    _, model = _models("llama", torch.float32, "from_config")
    batch = _global_batch(packed=False)
    shard = rsp_hf.shard_batch(batch, topo)
    loss = rsp_hf.causal_lm_loss(model(**shard).logits, shard["shift_labels"], topology=topo,
                                 gradients_averaged_over_sp=False)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():  # SGD on the SP-summed gradient: the same weights on every rank
            dist.all_reduce(p.grad, group=topo.sp_group)
            p -= 0.5 * p.grad
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    with open(f"{path}/config.json") as f:
        saved = json.load(f)
    assert "ring_sp" not in json.dumps(saved), "the saved config names the ring_sp attention"
    model.eval()
    with torch.no_grad():
        sp_logits = topo.gather_sequence(model(**shard).logits, layout="zigzag")
        plain = AutoModelForCausalLM.from_pretrained(path).eval()  # default attention: sdpa
        assert plain.config._attn_implementation == "sdpa"
        plain_logits = plain(input_ids=batch["input_ids"]).logits
        again = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring_sp").eval()
        again_logits = topo.gather_sequence(again(**shard).logits, layout="zigzag")
    scale = max(1.0, plain_logits.abs().max().item())
    return {"plain": (sp_logits - plain_logits).abs().max().item() / scale,
            "reloaded": (again_logits - plain_logits).abs().max().item() / scale}


def test_save_pretrained_from_sp_loads_in_plain_transformers(pools, tmp_path) -> None:
    for rank, res in enumerate(pools.get(4).run(checkpoint_case, str(tmp_path), timeout=300)):
        assert res["plain"] <= FP32_LOGITS and res["reloaded"] <= FP32_LOGITS, f"rank {rank}: {res}"


# ---------------------------------------------------------------- unsupported features: every rank, no collective

# (not isend/irecv themselves: P2POp checks their identity; ring_sp posts them through batch_isend_irecv)
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_to_all_single", "batch_isend_irecv", "broadcast",
                "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")


class _CountCollectives:
    """Counts calls of torch.distributed's collectives inside the block (ring_sp calls them through the module)."""

    def __enter__(self):
        import torch.distributed as dist

        self.calls, self._saved = 0, {}
        for name in _COLLECTIVES:
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args, __original=original, **kwargs):
                self.calls += 1
                return __original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)


def unsupported_features_case() -> dict[str, tuple[str, int]]:
    """Each scenario's error message on this rank and the collectives issued before it (must be 0)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    topo = dist_cases.topology(2, 2)
    rsp_hf.register(topo)
    shard = rsp_hf.shard_batch(_global_batch(packed=False), topo)

    def build(arch: str, **overrides: Any):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(_config(arch, **overrides), attn_implementation="ring_sp").train()

    mask = torch.ones_like(shard["input_ids"])
    mask[:, -1] = 0
    n = shard["input_ids"].shape[1]
    cache = DynamicCache(config=_config("llama"))  # as if generation had seen the n tokens of the shard
    for layer in range(2):
        cache.update(torch.zeros(2, 2, n, 8), torch.zeros(2, 2, n, 8), layer)
    scenarios = {
        "chunked": (build("llama", attention_chunk_size=8), {}),
        "dropout": (build("llama", attention_dropout=0.1), {}),
        "dropout_in_eval": (build("llama", attention_dropout=0.1).eval(), {}),  # transformers passes dropout=0.0: runs
        "padding_mask": (build("llama"), {"attention_mask": mask}),
        "mask_4d": (build("llama"), {"attention_mask": torch.zeros(2, 1, n, n)}),
        "local_positions": (build("llama"), {"position_ids": None}),  # forgot them: transformers numbers 0..n-1
        "kv_cache": (build("llama").eval(), {"input_ids": shard["input_ids"][:, :1], "position_ids": shard["position_ids"][:, :1],
                                            "past_key_values": cache, "shift_labels": None}),
    }
    out = {}
    for name, (model, extra) in scenarios.items():
        inputs = {**shard, **extra}
        inputs = {k: v for k, v in inputs.items() if v is not None}
        with _CountCollectives() as counter:
            try:
                model(**inputs)
            except ValueError as exc:  # UnsupportedFeatureError is a ValueError
                out[name] = (str(exc), counter.calls)
            else:
                out[name] = ("no error", counter.calls)
    return out


_EXPECTED = {
    "chunked": r"model_type 'llama'\)? uses chunked attention of 8 tokens .*attention_chunk_size = None",
    "dropout": r"model_type 'llama'\)?, LlamaAttention of layer 0 uses attention dropout 0.1 .*attention_dropout = 0.0",
    "padding_mask": r"model_type 'llama'\)? uses a padding attention_mask .*DataCollatorWithFlattening",
    "mask_4d": r"model_type 'llama'\)?, LlamaAttention of layer 0 uses a 4-D attention mask .*pass no attention_mask",
    "local_positions": r"model_type 'llama'\)?: position_ids are 0..7, the shard's LOCAL positions.*pass the GLOBAL",
    "kv_cache": r"model_type 'llama'\)? uses a KV cache holding .* earlier tokens \(generation with past_key_values\)",
}


def test_unsupported_features_raise_on_every_rank_before_any_collective(pools) -> None:
    results = pools.get(4).run(unsupported_features_case, timeout=300)
    for rank, res in enumerate(results):
        assert res["dropout_in_eval"][0] == "no error", f"rank {rank}: {res['dropout_in_eval']}"
        assert res["dropout_in_eval"][1] > 0, "the counter saw no collective in a forward that runs (it would prove nothing)"
        for name, pattern in _EXPECTED.items():  # every other scenario: an error and no collective before it
            message, calls = res[name]
            assert re.search(pattern, message), f"rank {rank}, {name}: {message}"
            assert name == "local_positions" or 'attn_implementation="ring_sp" does not support yet' in message
            # the one collective before the error is the agreement that raises it on every rank
            assert calls == 1, f"rank {rank}, {name}: {calls} collectives before the error"


# ---------------------------------------------------------------- generation

class _Collect:
    """A transformers streamer (``put`` / ``end``) that keeps what it is given."""

    def __init__(self, into: list) -> None:
        self.into = into

    def put(self, value: torch.Tensor) -> None:
        self.into.append(value.tolist())

    def end(self) -> None:
        self.into.append("end")


def generation_case() -> dict[str, Any]:
    """generate() at U2xR2 (a batch of 2 prompts) equals a model that never ran ring_sp; a training step
    after it, in the same processes, equals one rank's; and generate() after the step equals one rank's
    after the same step (the cache holds nothing of the first call); at SP size 1 generate() works."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    topo = dist_cases.topology(2, 2)
    rsp_hf.register(topo)
    reference, model = _models("llama", torch.float32, "from_config")
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    out: dict[str, Any] = {"sp_generates_the_same": torch.equal(model.generate(prompt, **options),
                                                                reference.generate(prompt, **options))}
    # eos_token_id (a token the first row emits at its 3rd step: that row stops, padded, the other goes on) and a
    # streamer: what each streams equals the reference's
    eos = int(reference.generate(prompt, **options)[0, 8])
    streamed: dict[str, list] = {"sp": [], "reference": []}
    for name, m in (("sp", model), ("reference", reference)):
        streamer = _Collect(streamed[name])
        streamed[name].append(m.generate(prompt, **options, eos_token_id=eos, streamer=streamer).tolist())
    out["eos_and_streamer_the_same"] = streamed["sp"] == streamed["reference"] and len(streamed["sp"]) > 2
    batch = _global_batch(packed=True)
    ref_logits, ref_loss, ref_grads = _reference_run(reference, batch)
    shard, gathered, loss, grads = _sp_run(model, batch, topo)
    out["train"] = _errors(ref_logits, gathered, shard, batch, ref_loss, loss, ref_grads, grads)
    with torch.no_grad():  # one SGD step on both (the SP ranks' summed gradients): generate from the trained weights
        for (name, p), q in zip(reference.named_parameters(), model.parameters()):
            p -= 0.5 * p.grad
            q -= 0.5 * grads[name]
    expected = reference.generate(prompt, **options)
    out["after_step_the_same"] = torch.equal(model.generate(prompt, **options), expected)
    rsp_hf.register(dist_cases.topology(1, 1))  # SP group of one rank (every rank its own replica)
    try:
        out["one_rank_generates_the_same"] = torch.equal(model.generate(prompt, **options), expected)
    finally:
        rsp_hf.register(topo)
    return out


def test_generate_on_sp_ranks_and_training_on_in_the_same_processes(pools) -> None:
    for rank, res in enumerate(pools.get(4).run(generation_case, timeout=300)):
        assert res["sp_generates_the_same"] and res["after_step_the_same"], (rank, res)
        assert res["eos_and_streamer_the_same"], (rank, res)
        assert res["one_rank_generates_the_same"], (rank, res)
        _check_fp32([res["train"]])


# ---------------------------------------------------------------- DeepSpeed: initialize adopts the registration

DS_ENV = {"DS_ACCELERATOR": "cpu"}  # read once, when deepspeed is first imported in a rank
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


def deepspeed_case(stage: int, packed: bool) -> dict[str, Any]:
    """rsp_ds.initialize on an HF model with attn_implementation="ring_sp": the engine adopts the
    registered topology; causal_lm_loss(engine=) + DeepSpeed's reduction give the sdpa gradients."""
    import os

    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    import ring_sp.integrations.deepspeed as rsp_ds
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.deepspeed import skip_cpu_inference_comm_build

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # DeepSpeed requires it; one host
    skip_cpu_inference_comm_build()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "ring_sp": {"ulysses_size": 2, "ring_size": 2, "layout": "zigzag"}}
    topology = rsp_ds.build_topology(config)
    rsp_hf.register(topology, layout="zigzag")
    reference, model = _models("llama", torch.float32, "from_config")
    batch = _global_batch(packed, rows=1)
    ref_logits, ref_loss, ref_grads = _reference_run(reference, batch)
    engine, *_ = rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    shard = rsp_hf.shard_batch(batch, topology)
    loss = rsp_hf.causal_lm_loss(engine(**shard).logits, shard["shift_labels"], engine=engine)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).detach().float().clone() for n, p in engine.module.named_parameters()}
    errors = {}
    try:  # transformers' own loss on a shard: shifted inside the shard, averaged over this rank
        engine(**{k: v for k, v in shard.items() if k != "shift_labels"}, labels=shard["input_ids"])
    except ValueError as exc:
        errors["labels"] = str(exc)
    plain = {k: v for k, v in config.items() if k != "ring_sp"}
    for key, bad_config in (("no_section", plain), ("disabled", {**config, "ring_sp": {**config["ring_sp"], "enabled": False}})):
        try:  # a ring_sp model under a DeepSpeed config that is not sequence parallel
            rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=bad_config)
        except ValueError as exc:
            errors[key] = str(exc)
    for key in ("layout", "ulysses_size"):  # a section that disagrees with the registration
        bad = {**config, "ring_sp": {**config["ring_sp"], **({"layout": "contiguous"} if key == "layout" else {"ulysses_size": 4, "ring_size": 1})}}
        try:
            rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=bad)
        except ValueError as exc:
            errors[key] = str(exc)
    return {"adopted": engine.ring_sp_topology is topology, "loss": abs(loss.item() - ref_loss),
            "grads": _scaled(ref_logits, ref_logits, grads, ref_grads)["grads"], "errors": errors}


@needs_deepspeed
@pytest.mark.parametrize("stage,packed", [(1, True), (3, False)])
def test_deepspeed_engine_adopts_registration(pools, stage: int, packed: bool) -> None:
    for rank, res in enumerate(pools.get(4, env=DS_ENV).run(deepspeed_case, stage, packed, timeout=300)):
        assert res["adopted"], f"rank {rank}: initialize built a second topology"
        assert res["loss"] <= 1e-5 and res["grads"] <= FP32_GRADS, f"rank {rank}: {res}"
        assert "ring_sp.layout='contiguous' but module 'attn_implementation=\"ring_sp\"' was built with layout='zigzag'" \
            in res["errors"]["layout"], res["errors"]
        assert "ring_sp.ulysses_size=4 but the model's attention topology has ulysses_size=2" in res["errors"]["ulysses_size"]
        assert "was given labels=Tensor(shape=(1, 8)) (and no shift_labels) while it runs on 4 sequence-parallel" \
            in res["errors"]["labels"], res["errors"]
        assert 'the model uses attn_implementation="ring_sp", but the DeepSpeed config passed to initialize is not ' \
            'sequence parallel (it has no "ring_sp" section)' in res["errors"]["no_section"], res["errors"]
        assert '(its "ring_sp" section has "enabled": false)' in res["errors"]["disabled"], res["errors"]


# ---------------------------------------------------------------- the example: SP = 2 x 2 vs one rank with sdpa

def _run_example(*args: str, ranks: int = 4) -> list[dict[str, Any]]:
    from pathlib import Path

    from example_scripts import run_launcher

    script = Path(__file__).resolve().parents[1] / "examples" / "transformers" / "pretrain_llama.sh"
    return run_launcher(script, *args, ranks=ranks, timeout=300)


_TINY = ["--seq-len", "64", "--d-model", "32", "--layers", "2", "--micro-batch", "2", "--lr", "1e-2", "--warmup", "2",
         "--corpus-bytes", "200000", "--steps", "3", "--pack-documents", "--log-json"]


@pytest.mark.slow  # a 4-rank launch of the script (the default suite launches one example: test_deepspeed.py)
@needs_deepspeed
def test_example_trains_and_saves_a_plain_checkpoint(tmp_path) -> None:
    """pretrain_llama.sh --cpu --pack-documents: U2 x R2 on 4 ranks, the loss falls, and its
    save_pretrained checkpoint loads in plain transformers."""
    from transformers import AutoModelForCausalLM

    lines = _run_example(*_TINY, "--save-pretrained", str(tmp_path), "--eval-interval", "3", "--eval-samples", "4")
    sp = [r for r in lines if "loss" in r]
    assert [r["step"] for r in sp] == [1, 2, 3] and all(r["tokens_per_s"] > 0 for r in sp)
    assert sp[-1]["loss"] < sp[0]["loss"] - 0.2, sp
    assert [(r["step"], r["eval_loss"] > 0) for r in lines if "eval_loss" in r] == [(3, True)], lines
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads == 2


@pytest.mark.slow  # two 4-rank launches (generate_long.py's generation itself: tests/test_generate.py)
@needs_deepspeed
def test_generate_long_example_from_the_saved_checkpoint(tmp_path) -> None:
    """pretrain_llama.sh saves a checkpoint trained under SP; generate_long.sh --load generates from it at
    U2 x R2 the tokens one rank generates, each rank caching about a quarter of the KV cache."""
    from pathlib import Path

    from example_scripts import run_launcher

    _run_example(*_TINY, "--save-pretrained", str(tmp_path))
    script = Path(__file__).resolve().parents[1] / "examples" / "transformers" / "generate_long.sh"
    tiny = [a for a in _TINY if a != "--pack-documents"]
    (row,) = run_launcher(script, *tiny, "--load", str(tmp_path), "--prompt-len", "1000", "--new-tokens", "8",
                          ranks=4, timeout=300)
    assert row["tokens_equal_one_rank"] and row["new_tokens"] == 8, row
    per_token = row["cache_bytes_one_rank"] / 1007  # the cache holds the prompt and 7 of the 8 new tokens
    slots = row["cache_bytes_this_rank"] / (per_token + 8 * 2)  # + an int64 position per slot of each of 2 layers
    assert slots <= 1007 / 4 + 256, row  # a quarter of the tokens + one growth block


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_example_sp_2x2_matches_one_rank_sdpa(packed: bool) -> None:
    """The example's loss curve and its held-out loss every 2 steps (--eval-interval) at U2 x R2 on 4 ranks
    equal sdpa on one rank, step for step (~3 min)."""
    args = _TINY if packed else [a for a in _TINY if a != "--pack-documents"]
    args = [*args, "--eval-interval", "2", "--eval-samples", "6"]
    sp, one = _run_example(*args), _run_example(*args, "--no-ring-sp", ranks=1)
    assert [r["step"] for r in sp] == [r["step"] for r in one] == [1, 2, 2, 3, 3]
    for a, b in zip(sp, one):
        key = "loss" if "loss" in b else "eval_loss"
        assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (sp, one)


# ---------------------------------------------------------------- the figures of the issue note

def _report() -> None:
    """``python tests/test_transformers.py``: max errors per configuration as a markdown table (not a test)."""
    from harness import PoolManager

    rows = [("llama", u, r, p, "fp32", 4) for u, r in GRID4 for p in (False, True)]
    rows += [("qwen3", 2, 2, False, "fp32", 4), ("qwen3", 1, 4, True, "fp32", 4), ("mistral", 4, 1, False, "fp32", 4),
             ("mistral", 2, 2, True, "fp32", 4), ("llama", 2, 4, False, "fp32", 8), ("llama", 2, 4, True, "fp32", 8),
             ("llama", 2, 2, False, "bf16", 4), ("llama", 2, 2, True, "bf16", 4)]
    rows = [(*row, {}) for row in rows]
    rows += [("mistral", 2, 2, False, "fp32", 4, WINDOWED["mistral"]), ("mistral", 1, 4, True, "fp32", 4, WINDOWED["mistral"]),
             ("qwen3", 2, 2, True, "fp32", 4, WINDOWED["qwen3"]), ("gpt_oss", 2, 2, False, "fp32", 4, {}),
             ("gpt_oss", 2, 2, True, "fp32", 4, {}), ("gpt_oss", 1, 4, True, "fp32", 4, {}),
             ("llama", 2, 2, False, "fp32", 4, {"seq": 29}), ("mistral", 2, 2, True, "fp32", 4, {"docs": ODD_DOCS, **WINDOWED["mistral"]})]
    pools = PoolManager(max_alive=1)
    print("| model | options | U x R | batch | dtype | logits err / max(1, max abs logit) | max param grad err / its max | loss err |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for arch, u, r, packed, dtype, world, options in rows:
            results = pools.get(world).run(equivalence_case, arch, u, r, packed, dtype, "from_config",
                                           1 if world == 8 else 2, **options, timeout=300)
            if dtype == "bf16":
                worst = {k: max(res["sp"][k] for res in results) for k in ("logits", "grads", "loss")}
                one = {k: max(res["one_rank"][k] for res in results) for k in ("logits", "grads", "loss")}
                cells = [f"{worst[k]:.2e} (1 rank bf16: {one[k]:.2e})" for k in ("logits", "grads", "loss")]
            else:
                cells = [f"{max(res[k] for res in results):.2e}" for k in ("logits", "grads", "loss")]
            print(f"| {arch} | {options or ''} | {u}x{r} | {'packed' if packed else 'unpacked'} | {dtype} | " + " | ".join(cells) + " |",
                  flush=True)
    finally:
        pools.close()


if __name__ == "__main__":
    _report()
