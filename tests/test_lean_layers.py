"""Issue 30.1: lean RMSNorm (ring_sp.lean.rms_norm and its Hugging Face switch).

Oracle: the transformers module itself (outputs, input and weight gradients): 1e-6 relative in
fp32, bitwise in bf16 (the same roundings, in the same places). Memory: the tensors kept for the
backward, counted with saved_tensors_hooks: the input, the weight and one fp32 rstd per row
(transformers' module keeps [..., H] fp32 copies on top: the negative control).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from ring_sp.lean import rms_norm

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")


def _norms():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return [(LlamaRMSNorm, "llama"), (Olmo2RMSNorm, "olmo"), (Gemma3RMSNorm, "gemma")]


def _kept_bytes(fn, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fn(x) and the bytes of the distinct storages its graph keeps for the backward, beyond x and weight."""
    own = {t.untyped_storage().data_ptr() for t in (x, weight)}
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rms_norm_equals_the_module_and_keeps_input_and_rstd_only(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for cls, variant in _norms():
        module = cls(64).to(dtype)
        with torch.no_grad():
            module.weight.add_(0.1 * torch.randn(64).to(dtype))
        x = (3 * torch.randn(2, 40, 64)).to(dtype).requires_grad_()
        dy = torch.randn(2, 40, 64).to(dtype)
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        want, hf_kept = _kept_bytes(module, x, module.weight)
        got, lean_kept = _kept_bytes(lambda t: rms_norm(t, module.weight, eps, variant), x, module.weight)
        want_grads = torch.autograd.grad(want, (x, module.weight), dy)
        got_grads = torch.autograd.grad(got, (x, module.weight), dy)
        assert got.dtype == want.dtype and torch.equal(got, want), cls
        for g, w in zip(got_grads, want_grads):
            if dtype == torch.bfloat16:
                assert torch.equal(g, w), cls
            else:
                assert (g - w).abs().max() <= 1e-6 * w.abs().max(), cls
        assert lean_kept == 2 * 40 * 4, (cls, lean_kept)  # one fp32 rstd per row, nothing [..., H]
        assert hf_kept >= 2 * 40 * 64 * 2, (cls, hf_kept)  # the control: the module keeps [..., H] copies


def test_switch_covers_every_norm_refuses_unknown_ones_and_leaves_liger_alone() -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.transformers.lean_layers import LeanRMSNorm, check_lean_layers, set_lean_layers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(check_lean_layers(model)) == len(norms) == 2 * 4 + 1  # input/post norms, q/k norms, final
    rsp_hf.enable_long_sequence(model)  # lean by default with tiling
    assert all(isinstance(m, LeanRMSNorm) for m in norms) and rsp_hf.long_sequence_config(model).lean_layers
    rsp_hf.enable_long_sequence(model, lean_layers=False)
    assert not any(isinstance(m, LeanRMSNorm) for m in model.modules())

    class LigerRMSNorm(nn.Module):  # stands for liger-kernel's (already lean): left as it is
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))

    model.model.norm = LigerRMSNorm()
    assert len(check_lean_layers(model)) == 2 * 4
    set_lean_layers(model, True)
    assert type(model.model.norm) is LigerRMSNorm

    class OtherRMSNorm(LigerRMSNorm):
        pass

    model.model.norm = OtherRMSNorm()
    with pytest.raises(ValueError, match=r"model\.norm is a OtherRMSNorm, which ring_sp's lean layers do not know.*"
                                         r"lean_layers=False"):
        rsp_hf.enable_long_sequence(model)
    with pytest.raises(TypeError, match=r"lean_layers must be True or False"):
        rsp_hf.enable_long_sequence(model, lean_layers="yes")
