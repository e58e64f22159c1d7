"""Issue 40 item 1: ALST's one-GPU recipe on transformers' Llama (benchmarks/gpu_check/alst.py).

Liger's kernels are Triton (CUDA only), so its application is checked with a stand-in module
that patches transformers the way ``apply_liger_kernel_to_llama`` does (module globals, and the
instance with ``model=``): the globals are restored at once, and Liger's RoPE is held only while
an ALST step runs, so a ring_sp model in the same process keeps transformers' RoPE.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks.gpu_check import alst, llama  # noqa: E402


def test_liger_patches_are_held_only_while_an_alst_step_runs(monkeypatch) -> None:
    from transformers.models.llama import modeling_llama

    calls = []

    def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls.append(q.shape)
        return original_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def apply_liger_kernel_to_llama(rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy, model):
        assert (rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy) == (True, True, False, False, True)
        modeling_llama.apply_rotary_pos_emb = liger_rope  # what Liger does to the module
        modeling_llama.LlamaRMSNorm = object

    original_rope, original_norm = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm
    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    model = llama.build_model(llama.TINY, torch.device("cpu"), torch.float32, "sdpa")
    rope = alst._apply_liger(model)
    assert rope is liger_rope
    assert modeling_llama.apply_rotary_pos_emb is original_rope and modeling_llama.LlamaRMSNorm is original_norm
    with llama.patched(modeling_llama, "apply_rotary_pos_emb", rope):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    assert len(calls) == llama.TINY.layers and modeling_llama.apply_rotary_pos_emb is original_rope


def test_liger_is_off_on_the_cpu_and_a_forced_liger_says_why() -> None:
    assert "Triton kernels for CUDA" in alst.liger_unavailable(torch.device("cpu"))
    pytest.importorskip("deepspeed")
    with pytest.raises(RuntimeError, match=r"AlstRecipe\(liger=True\): Liger's kernels are Triton"):
        alst.alst_step(llama.TINY, torch.device("cpu"), torch.float32, alst.AlstRecipe(liger=True))
