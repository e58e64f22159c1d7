"""Issue 38.1: a whole bf16 training step of each integration runs no matmul on fp32 operands.

``ring_sp.gemm_audit.GemmAudit`` (a TorchDispatchMode) records every matmul-family op of the
step with its operand dtypes; ``check()`` fails on any on fp32 / fp64 operands of >= 2**20
multiply-adds. Steps (one process, an SP group of one rank: the ring and Ulysses add attention
ops and collectives, no matmul, so more ranks take no other GEMM):

* Hugging Face Llama with ``enable_long_sequence`` defaults (tiled MLP and loss, lean layers,
  head chunks "auto") and ring_sp's attention, through ``model_loss``;
* the DeepSpeed example's GPT (``examples/deepspeed/pretrain_gpt.py``) with its long-sequence
  switches on (tiled MLP and loss, checkpointed blocks offloaded) and ring_sp's attention;
* megatron-core's ``GPTModel`` with the ring_sp core-attention spec and Megatron's DDP.

Sizes are chosen so that the big GEMMs (projections, MLP, the head and its gradient) cross 2**20
multiply-adds (asserted: else the check could not fail). Negative controls: the audit names an
upcast op of each matmul family, and the HF step with the tiled loss's old upcast head-gradient
GEMM (``addmm_`` on fp32 copies) fails the check.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

import ring_sp.tiling
from ring_sp.gemm_audit import UPCAST_MIN_MULTIPLY_ADDS, GemmAudit

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")
needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed")

VOCAB, HIDDEN, FFN, TOKENS = 1000, 64, 256, 256
BIG = UPCAST_MIN_MULTIPLY_ADDS


def _big(audit: GemmAudit) -> list:
    return [c for c in audit.calls if c.multiply_adds >= BIG]


# ---------------------------------------------------------------- the audit itself

def _each_family(dtype: torch.dtype) -> None:
    """One op of each matmul family of >= 2**20 multiply-adds on ``dtype`` operands."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=g).to(dtype) for s in ((2, 64, 128), (128, 128), (128,)))
    F.linear(x, w, b)  # addmm (2-D after the flatten) or mm
    x @ w  # matmul -> mm
    torch.einsum("bnk,bmk->bnm", x, x)  # bmm
    torch.baddbmm(torch.zeros(2, 64, 64, dtype=dtype), x, x.transpose(1, 2))
    acc = torch.zeros(128, 128, dtype=dtype)
    acc.addmm_(w, w)  # in place: its own op
    torch.mm(w, w, out=acc)


def test_audit_names_an_upcast_op_of_each_matmul_family_and_passes_their_bf16_twins() -> None:
    with GemmAudit() as low:
        _each_family(torch.bfloat16)
    with GemmAudit() as wide:
        _each_family(torch.float32)
    ops = ["addmm", "mm", "bmm", "baddbmm", "addmm_", "mm"]
    assert [c.op for c in low.calls] == [c.op for c in wide.calls] == ops
    assert all(c.multiply_adds >= BIG for c in wide.calls)
    low.check()
    with pytest.raises(AssertionError, match=r"6 matmul\(s\) of >= 1,048,576 multiply-adds ran on fp32/fp64 operands"
                                             r"[\s\S]*addmm_ \[128, 128\] x \[128, 128\] \(float32 x float32, 2,097,152"):
        wide.check()
    wide.check(min_multiply_adds=2**30)  # smaller than the threshold: allowed
    with GemmAudit() as outer:  # k = 1 (transformers' RoPE angles at 32K tokens): sums nothing, allowed
        torch.ones(1, 64, 1) @ torch.ones(1, 1, 32768)
        torch.ones(1, 64, 2) @ torch.ones(1, 2, 32768)  # k = 2: refused
    assert [c.k for c in outer.calls] == [1, 2] and [c.k for c in outer.upcast()] == [2]
    with GemmAudit() as attention:  # an attention kernel is not a matmul here
        q = torch.randn(1, 4, 256, 32, dtype=torch.bfloat16)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert attention.calls == []


# ---------------------------------------------------------------- whole bf16 steps

def _upcast_head_gradient(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """The tiled loss's head-gradient GEMM before issue 38: fp32 copies of the bf16 operands."""
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@needs_transformers
@pytest.mark.parametrize("upcast", [False, True], ids=["bf16", "old-upcast-head-gradient"])
def test_hf_long_sequence_step_runs_no_upcast_gemm(ring_sp_one_rank, monkeypatch, upcast: bool) -> None:
    from test_transformers import _config
    from transformers import AutoModelForCausalLM

    import ring_sp.integrations.transformers as rsp_hf

    topology = ring_sp_one_rank
    torch.manual_seed(0)
    config = _config("llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_sp").to(torch.bfloat16).train()
    rsp_hf.enable_long_sequence(model)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    shard = rsp_hf.shard_batch({"input_ids": ids, "labels": ids.clone()}, topology)
    if upcast:
        monkeypatch.setattr(ring_sp.tiling, "accumulate_matmul", _upcast_head_gradient)
    with GemmAudit() as audit:
        rsp_hf.model_loss(model, shard, topology=topology).backward()
    head_gradient = [c for c in _big(audit) if c.shapes[0][0] == VOCAB]  # [vocab, t] x [t, hidden]
    assert len(_big(audit)) >= 20 and len(head_gradient) == 2  # two loss tiles of 128 tokens
    if upcast:  # the negative control: what main ran before
        with pytest.raises(AssertionError, match=r"2 matmul\(s\).*\n  addmm_ \[1000, 128\] x \[128, 64\] \(float32"):
            audit.check()
    else:
        audit.check()
        assert all(c.dtypes == (torch.bfloat16, torch.bfloat16) for c in head_gradient)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_gpt_example_long_sequence_step_runs_no_upcast_gemm(single_rank) -> None:
    import ring_sp
    from examples.deepspeed.pretrain_gpt import GPT, GPTConfig, tiled_loss

    topology = ring_sp.init_sequence_parallel(1, 1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, d_model=HIDDEN, n_layer=2, n_head=4, n_kv_head=2), topology)
    model = model.to(torch.bfloat16).train()
    model.checkpointing = True
    model.enable_long_sequence(tiled_mlp=True, tiled_loss=True, offload_checkpoints=True, tile_tokens=None)
    ids = torch.randint(0, VOCAB, (1, TOKENS))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    with GemmAudit() as audit:
        tiled_loss(model(ids, torch.arange(TOKENS)[None], labels=labels), labels, None).backward()
    audit.check()
    mlp_weight_gradients = [c for c in _big(audit) if c.shapes == ((FFN, 128), (128, HIDDEN))]  # up's, per tile
    assert len(_big(audit)) >= 20 and len(mlp_weight_gradients) == 2 * 2  # 2 layers x 2 tiles
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


@needs_megatron
def test_megatron_gpt_model_step_runs_no_upcast_gemm(single_rank) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    import ring_sp.integrations.megatron as rsm

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        config = TransformerConfig(
            num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=4, num_query_groups=2,
            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
            hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True,
            use_cpu_initialization=True, masked_softmax_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
            persist_layer_norm=False)
        spec = rsm.get_gpt_layer_ring_sp_spec(rsm.RingSPConfig(), normalization="RMSNorm")
        torch.manual_seed(0)
        model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=TOKENS, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        rsm.install_layout_rope(model)
        with rsm.ddp_buffers_on_cpu():
            model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        tokens = torch.randint(0, VOCAB, (1, TOKENS + 1))
        with GemmAudit() as audit:
            losses = model(tokens[:, :-1], torch.arange(TOKENS)[None], None, labels=tokens[:, 1:])
            losses.float().mean().backward()
        model.finish_grad_sync()
    finally:
        parallel_state.destroy_model_parallel()
    audit.check()
    head = [c for c in _big(audit) if VOCAB in c.shapes[0] + c.shapes[1]]  # output layer: forward, dx, dW
    assert len(_big(audit)) >= 20 and len(head) == 3
    assert all(p.main_grad.dtype == torch.float32 and p.main_grad.abs().sum() > 0 for p in model.module.parameters())
