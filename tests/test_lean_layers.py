"""Issue 30.1: the lean layer pieces (ring_sp.lean) and their Hugging Face switch (lean_layers).

Oracle: transformers' own modules (outputs, input and parameter gradients), on the same inputs:
1e-6 relative in fp32; bitwise in bf16 (the same roundings in the same places: the pieces run
autograd's own backward ops, and hand x its gradients in the order autograd would, so even a
residual stream's sum rounds alike). Memory: the tensors kept for the backward, counted as
distinct storages with saved_tensors_hooks; transformers' modules are the negative control.
Runs in ~8 s on one process (one 1-rank gloo group for ring_sp's attention).
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
from torch import nn

from ring_sp.lean import gated_mlp, rms_norm, rotary

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
DTYPES = [torch.float32, torch.bfloat16]


def _kept_bytes(fn, *inputs: torch.Tensor, params: tuple = ()) -> tuple[object, int]:
    """fn() and the bytes of the distinct storages its graph keeps, beyond ``inputs`` and ``params``."""
    own = {t.untyped_storage().data_ptr() for t in (*inputs, *params)}
    kept = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    """fp32: within 1e-6 of the largest value; bf16: bit for bit."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.dtype == torch.bfloat16:
        assert torch.equal(got, want), (what, (got.float() - want.float()).abs().max().item())
    else:
        assert (got - want).abs().max() <= 1e-6 * want.abs().max().clamp(min=1e-30), what


# ---------------------------------------------------------------- the pieces

def _norms():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    return [(LlamaRMSNorm, "llama"), (Olmo2RMSNorm, "olmo"), (Gemma3RMSNorm, "gemma")]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_rms_norm_equals_the_module_and_keeps_input_and_rstd_only(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for cls, variant in _norms():
        module = cls(64).to(dtype)
        with torch.no_grad():
            module.weight.add_(0.1 * torch.randn(64).to(dtype))
        x = (3 * torch.randn(2, 40, 64)).to(dtype).requires_grad_()
        dy = torch.randn(2, 40, 64).to(dtype)
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        want, hf_kept = _kept_bytes(lambda: module(x), x, params=(module.weight,))
        got, lean_kept = _kept_bytes(lambda: rms_norm(x, module.weight, eps, variant), x, params=(module.weight,))
        _assert_same(got, want, cls)
        for g, w in zip(torch.autograd.grad(got, (x, module.weight), dy), torch.autograd.grad(want, (x, module.weight), dy)):
            _assert_same(g, w, cls)
        assert lean_kept == 2 * 40 * 4, (cls, lean_kept)  # one fp32 rstd per row, nothing [..., H]
        assert hf_kept >= 2 * 40 * 64 * 2, (cls, hf_kept)  # the control: the module keeps [..., H] copies
    with pytest.raises(ValueError, match=r"variant='rms' is not an RMSNorm style.*'llama', 'olmo', 'gemma'"):
        rms_norm(x, module.weight, 1e-6, "rms")
    with pytest.raises(ValueError, match=r"weight \(64,\) must be \[H\] for x \(2, 40, 32\)"):
        rms_norm(x[..., :32], module.weight, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lean_rotary_equals_transformers_and_keeps_only_the_positions(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
    from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb as olmo2_rope

    torch.manual_seed(0)
    b, n, d = 2, 24, 16
    q = torch.randn(b, n, 4, d).to(dtype).transpose(1, 2).requires_grad_()  # HF's [b, h, n, d] view
    k = torch.randn(b, n, 2, d).to(dtype).transpose(1, 2).requires_grad_()
    positions = torch.arange(3, 3 + n).expand(b, n)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    calls = []

    def tables(table_dtype: torch.dtype):
        def cos_sin(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            calls.append(p)
            emb = torch.cat([p[..., None].float() * inv_freq] * 2, dim=-1)
            return emb.cos().to(table_dtype), emb.sin().to(table_dtype)
        return cos_sin

    # Llama's tables in the model dtype; OLMo 2's in fp32, its result cast back to q's dtype
    for hf_rope, table_dtype, cast in ((llama_rope, dtype, False), (olmo2_rope, torch.float32, True)):
        cos_sin = tables(table_dtype)
        cos, sin = cos_sin(positions)
        want, hf_kept = _kept_bytes(lambda: hf_rope(q, k, cos, sin), q, k)
        got, lean_kept = _kept_bytes(lambda: rotary(q, k, cos, sin, positions, cos_sin, cast_to_input=cast), q, k,
                                     params=(positions,))
        dq, dk = torch.randn_like(want[0]), torch.randn_like(want[1])
        calls.clear()
        for g, w in zip((*got, *torch.autograd.grad(got, (q, k), (dq, dk))), (*want, *torch.autograd.grad(want, (q, k), (dq, dk)))):
            _assert_same(g, w, hf_rope.__module__)
        assert len(calls) == 1 and calls[0] is positions  # the tables made again, from the kept positions
        assert lean_kept == 0 and hf_kept == 2 * b * n * d * cos.element_size()  # the control keeps cos and sin
    bad = lambda p: tuple(t[:, :-1] for t in tables(dtype)(p))  # noqa: E731
    out = rotary(q, k, cos.to(dtype), sin.to(dtype), positions, bad)
    with pytest.raises(RuntimeError, match=r"cos_sin\(positions\) must return what the forward was given"):
        torch.autograd.grad(out, (q, k), (dq, dk))


def _mlp_inputs(dtype: torch.dtype, act: str, bias: bool):
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act=act, mlp_bias=bias)).to(dtype)
    params = [mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias, mlp.down_proj.weight,
              mlp.down_proj.bias]
    return mlp, params, lambda x: gated_mlp(x, mlp.act_fn, *params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act,bias", [("silu", False), ("gelu_pytorch_tanh", True)])  # Llama's, Gemma's (biased)
def test_lean_gated_mlp_equals_transformers_and_keeps_gate_and_up_only(dtype: torch.dtype, act: str, bias: bool) -> None:
    mlp, params, lean = _mlp_inputs(dtype, act, bias)
    x = torch.randn(2, 20, 32).to(dtype).requires_grad_()
    trained = [x] + [p for p in params if p is not None]
    want, hf_kept = _kept_bytes(lambda: mlp(x), x, params=trained)
    got, lean_kept = _kept_bytes(lambda: lean(x), x, params=trained)
    dy = torch.randn_like(want)
    for g, w in zip((got, *torch.autograd.grad(got, trained, dy)), (want, *torch.autograd.grad(want, trained, dy))):
        _assert_same(g, w, act)
    tile = 2 * 20 * 48 * x.element_size()  # one [tokens, ffn] tensor
    assert lean_kept == 2 * tile, lean_kept  # gate and up
    assert hf_kept == 4 * tile, hf_kept  # the control: gate, up, act(gate) and the product


@pytest.mark.parametrize("leaf", [True, False])
def test_lean_gated_mlp_under_autocast_equals_transformers(leaf: bool) -> None:
    """fp32 weights, bf16 autocast: the backward casts as autocast did (and for a leaf input,
    whose one cast both linears share, sums its two gradients in bf16 first, as autograd does)."""
    mlp, params, lean = _mlp_inputs(torch.float32, "silu", True)
    x0 = torch.randn(2, 20, 32, requires_grad=True)
    trained = [x0] + [p for p in params if p is not None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = x0 if leaf else x0 * 1.0
        want, got = mlp(x), lean(x)
    dy = torch.randn_like(want)
    assert want.dtype == got.dtype == torch.bfloat16 and torch.equal(got, want)
    for g, w in zip(torch.autograd.grad(got, trained, dy, retain_graph=True), torch.autograd.grad(want, trained, dy)):
        assert g.dtype == w.dtype and torch.equal(g, w)


# ---------------------------------------------------------------- whole models

def _config(arch: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Olmo2Config, Qwen3Config

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    if arch == "gemma3":  # sliding and full layers, each with its own RoPE tables; q/k norms on [b, h, n, d]
        return Gemma3TextConfig(**common, sliding_window=8, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention", "full_attention"])
    return {"llama": LlamaConfig, "qwen3": Qwen3Config, "olmo2": Olmo2Config}[arch](**common)


def _model(arch: str, dtype: torch.dtype, attention: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), attn_implementation=attention).to(dtype).train()
    with torch.no_grad():  # norms away from their init, so their weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids, use_cache=False).logits
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "olmo2"])
def test_whole_model_with_lean_layers_equals_transformers(arch: str, dtype: torch.dtype) -> None:
    """Loss and every gradient; OLMo 2 also feeds its MLP the residual stream itself (three
    consumers of one tensor) and rotates in fp32 tables."""
    from ring_sp.integrations.transformers.lean_layers import (LeanAttention, LeanGatedMLP, LeanRMSNorm, LeanRotary,
                                                               set_lean_layers)

    reference = _model(arch, dtype)
    lean = set_lean_layers(copy.deepcopy(reference), True)
    kinds = {type(m).__bases__[0] for m in lean.modules()}
    assert {LeanRMSNorm, LeanRotary, LeanAttention, LeanGatedMLP} <= kinds, kinds
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    (want, want_grads), (got, got_grads) = _step(reference, ids), _step(lean, ids)
    _assert_same(got, want, "loss")
    for name, w in want_grads.items():
        _assert_same(got_grads[name], w, name)


def test_lean_layers_under_activation_checkpointing_and_generation() -> None:
    from ring_sp.integrations.transformers.lean_layers import set_lean_layers

    reference = _model("gemma3", torch.float32)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    want, want_grads = _step(reference, ids)
    for reentrant in (False, True):  # the re-run finds its cos / sin tags: passed by keyword, not detached
        lean = set_lean_layers(copy.deepcopy(reference), True)
        lean.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        lean.zero_grad()
        got, got_grads = _step(lean, ids)
        _assert_same(got, want, reentrant)
        for name, w in want_grads.items():
            _assert_same(got_grads[name], w, (reentrant, name))
    lean = set_lean_layers(copy.deepcopy(reference), True).eval()
    with torch.no_grad():  # a KV cache: the tables of the new positions only
        assert torch.equal(lean.generate(ids[:1, :5], max_new_tokens=5, do_sample=False),
                           reference.eval().generate(ids[:1, :5], max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_keeps_q_k_v_and_out_once_with_ring_sp(ring_sp_one_rank, dtype: torch.dtype) -> None:
    """transformers' attention + ring_sp's (one rank, CPU kernel: out comes head-major) keep out
    twice (the ring's, and o_proj's contiguous copy) and the cos / sin tables; the lean one keeps
    q, k, v, out and lse once, and the positions. Bit for bit the same layer."""
    from ring_sp.integrations.transformers.lean_layers import set_lean_layers

    reference = _model("llama", dtype, attention="ring_sp")
    lean = set_lean_layers(copy.deepcopy(reference), True)
    b, n, e = 1, 64, torch.empty((), dtype=dtype).element_size()
    x = torch.randn(b, n, 32).to(dtype).requires_grad_()
    positions = torch.arange(n)[None]
    kept, outs = [], []
    for model in (reference, lean):
        attn = model.model.layers[0].self_attn
        cos, sin = model.model.rotary_emb(x, positions)
        out, nbytes = _kept_bytes(lambda: attn(x, position_embeddings=(cos, sin), attention_mask=None,
                                               position_ids=positions)[0], x, params=tuple(model.parameters()))
        kept.append(nbytes)
        outs.append((out, *torch.autograd.grad(out, (x, *attn.parameters()), torch.ones_like(out))))
    for got, want in zip(*reversed(outs)):
        _assert_same(got, want, "attention")
    q, kv, lse = b * n * 4 * 8 * e, b * n * 2 * 8 * e, b * 4 * n * 4
    tables = 2 * b * n * 8 * e
    assert kept[0] == q + 2 * kv + 2 * q + lse + tables, kept  # out twice, and cos / sin
    assert kept[1] == q + 2 * kv + q + lse + b * n * 8, kept  # out once; int64 positions
    # the whole model, lean or not, trains alike on ring_sp
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    (want, want_grads), (got, got_grads) = _step(reference, ids), _step(lean, ids)
    _assert_same(got, want, "loss")
    for name, w in want_grads.items():
        _assert_same(got_grads[name], w, name)


# ---------------------------------------------------------------- the switch

def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def test_switch_is_reversible_and_leaves_tiled_mlps_tiled() -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.transformers.lean_layers import (LeanGatedMLP, LeanRMSNorm, check_lean_layers, hf_class,
                                                               set_lean_layers)

    model = _qwen3()
    classes = {name: type(m) for name, m in model.named_modules()}
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    found = check_lean_layers(model)
    # every norm (input/post, q/k, final), both attentions, both MLPs, the rotary embedding
    assert len(found) == len(norms) + 2 + 2 + 1 == 14 and {type(m) for m in model.modules()} == set(classes.values())
    set_lean_layers(model, True)
    assert all(isinstance(m, LeanRMSNorm) for m in norms) and hf_class(norms[0]).__name__ == "Qwen3RMSNorm"
    assert check_lean_layers(model) == found  # idempotent
    set_lean_layers(model, False)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    rsp_hf.enable_long_sequence(model)  # lean by default with tiling: the tiled MLPs stay tiled
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "RingSPTiledQwen3MLP" and not isinstance(mlp, LeanGatedMLP)
    assert all(isinstance(m, LeanRMSNorm) for m in norms) and rsp_hf.long_sequence_config(model).lean_layers
    rsp_hf.enable_long_sequence(model, tiled_mlp=False)  # untiled: the MLP keeps gate and up
    assert isinstance(model.model.layers[0].mlp, LeanGatedMLP)
    rsp_hf.enable_long_sequence(model, tiled_mlp=False, tiled_loss=False, lean_layers=False)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    with pytest.raises(TypeError, match=r"lean_layers must be True or False"):
        rsp_hf.enable_long_sequence(model, lean_layers="yes")
    with pytest.raises(TypeError, match=r"on must be True or False"):
        set_lean_layers(model, 1)


def test_unknown_modules_raise_before_any_change_and_liger_is_left_alone(monkeypatch) -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.transformers.lean_layers import LeanAttention, check_lean_layers, set_lean_layers

    model = _qwen3()

    class LigerRMSNorm(nn.Module):  # stands for liger-kernel's (already lean): left as it is
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))

    model.model.norm = LigerRMSNorm()
    assert len(check_lean_layers(model)) == 14 - 1
    set_lean_layers(model, True)
    assert type(model.model.norm) is LigerRMSNorm
    set_lean_layers(model, False)

    class OtherRMSNorm(LigerRMSNorm):
        pass

    model.model.norm = OtherRMSNorm()
    with pytest.raises(ValueError, match=r"model\.norm is a OtherRMSNorm, which ring_sp's lean layers do not know.*"
                                         r"lean_layers=False"):
        rsp_hf.enable_long_sequence(model)
    model.model.norm = LigerRMSNorm()
    layer = model.model.layers[1]

    def refused(pattern: str) -> None:
        before = {name: type(m) for name, m in model.named_modules()}
        with pytest.raises(ValueError, match=pattern + r".*lean_layers=False"):
            set_lean_layers(model, True)
        assert {name: type(m) for name, m in model.named_modules()} == before  # nothing switched

    up = layer.mlp.up_proj
    layer.mlp.up_proj = nn.Sequential(up)  # a wrapped projection (as LoRA wraps it)
    refused(r"layers\[1\]\.mlp is a Qwen3MLP.*plain nn\.Linear")
    layer.mlp.up_proj = up
    layer.self_attn.forward = lambda *args, **kwargs: None  # a forward replaced on the instance
    refused(r"layers\[1\]\.self_attn is a Qwen3Attention.*replaced on the instance")
    del layer.self_attn.forward
    model.model.rotary_emb.rope_type = "dynamic"
    refused(r"rotary_emb uses rope_type 'dynamic'")
    model.model.rotary_emb.rope_type = "default"
    # Liger's RoPE patched into the family: its attentions are left to Liger (and need no tagged tables)
    modeling = sys.modules[type(layer.self_attn).__module__]
    liger_rope = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)  # noqa: E731
    liger_rope.__module__ = "liger_kernel.transformers.rope"
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", liger_rope)
    assert len(check_lean_layers(model)) == 14 - 1 - 2 - 1  # no attention, no rotary embedding
    monkeypatch.undo()
    # cos / sin the model's rotary embedding did not make: the lean attention refuses them
    set_lean_layers(model, True)
    x = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match=r"position_embeddings its model's rotary embedding did not make.*"
                                         r"lean_layers=False"):
        layer.self_attn(x, position_embeddings=(torch.ones(1, 4, 8), torch.zeros(1, 4, 8)), attention_mask=None)
    assert isinstance(layer.self_attn, LeanAttention)
