"""Issue 20: the long-sequence step (tiled MLP, tiled logits + loss, offloaded checkpoints).

Oracle: the same model untiled, with transformers' own loss (one rank, ``sdpa``) — loss and
every parameter gradient within fp32 rounding (TESTING.md C19's 1e-5 loss / 1e-4 x the
largest entry per gradient). Memory: the largest tensor any op creates with a vocabulary or
ffn last dimension has at most ``tile_tokens`` rows (untiled: all tokens, the negative
control). ZeRO-3: a parameter is gathered as often tiled as untiled, however many tiles.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ring_sp.tiling import DEFAULT_TILE_TOKENS, check_tile_tokens, tiled_linear_cross_entropy, tiled_map

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def _rel_grad_error(model, reference) -> float:
    """Max over parameters of the gradient error over its largest reference entry (tied weights once)."""
    ref = dict(reference.named_parameters())
    return max(((p.grad - ref[n].grad).abs().max() / ref[n].grad.abs().max().clamp(min=1e-30)).item()
               for n, p in model.named_parameters())


# ---------------------------------------------------------------- the library pieces (ring_sp/tiling.py)

@pytest.mark.parametrize("tile", [1, 5, 37, 100])
def test_tiled_linear_cross_entropy_equals_untiled(tile: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(37, 8, requires_grad=True)
    weight, bias = torch.randn(50, 8, requires_grad=True), torch.randn(50, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    labels[:5] = -100
    labels[20] = -100
    for softcap in (None, 3.0):
        loss = tiled_linear_cross_entropy(hidden, weight, labels, bias=bias, tile_tokens=tile, softcap=softcap)
        grads = torch.autograd.grad(loss, (hidden, weight, bias))
        logits = F.linear(hidden, weight, bias)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        want = F.cross_entropy(logits.float(), labels, reduction="sum")
        want_grads = torch.autograd.grad(want, (hidden, weight, bias))
        assert abs(loss.item() - want.item()) <= 1e-6 * want.abs().item()
        for g, w in zip(grads, want_grads):
            assert (g - w).abs().max() <= 1e-5 * w.abs().max()
    # negative control: the check above sees a missing soft-cap
    capped = tiled_linear_cross_entropy(hidden, weight, labels, bias=bias, tile_tokens=tile, softcap=3.0)
    assert abs(capped.item() - F.cross_entropy(F.linear(hidden, weight, bias), labels, reduction="sum").item()) > 1.0


def test_tiled_loss_gradients_scale_with_the_incoming_gradient_and_eval_takes_none(monkeypatch) -> None:
    """The tiled loss takes its gradients in the forward: the backward must still scale them by the
    incoming gradient (a loss divided by the token count), and evaluation must not pay for them."""
    torch.manual_seed(1)
    hidden = torch.randn(29, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    labels = torch.randint(0, 40, (29,))
    labels[3] = -100
    scale = 0.37
    (tiled_linear_cross_entropy(hidden, weight, labels, tile_tokens=6) * scale).backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    (F.cross_entropy(F.linear(hidden, weight), labels, reduction="sum") * scale).backward()
    for g, w in zip(got, (hidden.grad, weight.grad)):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()
        assert (g / scale - w).abs().max() > 0.5 * w.abs().max()  # negative control: the scale is seen

    calls = []  # the softmax of each tile's logits is its gradient: counted
    real_softmax = torch.softmax
    monkeypatch.setattr(torch, "softmax", lambda *a, **k: calls.append(1) or real_softmax(*a, **k))
    with torch.no_grad():
        loss = tiled_linear_cross_entropy(hidden, weight, labels, tile_tokens=6)
    assert calls == [] and loss.grad_fn is None
    tiled_linear_cross_entropy(hidden, weight, labels, tile_tokens=6)
    assert len(calls) == 5  # one per tile with grad enabled: the negative control of the count


def test_tiled_map_equals_untiled_and_sums_parameter_gradients_once() -> None:
    torch.manual_seed(0)
    gate, up, down = torch.randn(24, 8), torch.randn(24, 8), torch.randn(8, 24)
    params = [p.requires_grad_() for p in (gate, up, down)]

    def mlp(x, g, u, d):
        return F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)

    x = torch.randn(3, 13, 8, requires_grad=True)
    hooks = []
    for p in params:  # autograd hands each parameter ONE gradient per backward (one ZeRO/DDP hook)
        p.register_hook(lambda g: hooks.append(g.shape))
    y = tiled_map(mlp, x, params, tile_tokens=5)
    grad_y = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, *params), grad_y)
    assert len(hooks) == 3
    want = mlp(x, *params)
    want_grads = torch.autograd.grad(want, (x, *params), grad_y)
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    for g, w in zip(grads, want_grads):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()


@pytest.mark.parametrize("bad,error,pattern", [
    (0, ValueError, r"tile_tokens=0 must be >= 1"), (-4, ValueError, r"tile_tokens=-4 must be >= 1"),
    (True, TypeError, r"tile_tokens must be a positive int"), (2.0, TypeError, r"tile_tokens must be a positive int"),
])
def test_bad_tile_tokens_name_the_option(bad, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        check_tile_tokens(bad)
    with pytest.raises(error, match=pattern):
        tiled_map(lambda x: x, torch.zeros(2, 2), [], tile_tokens=bad)
    assert check_tile_tokens(None) is None is DEFAULT_TILE_TOKENS  # None: sized by the library


# ---------------------------------------------------------------- Hugging Face models, one rank

def _hf(arch: str, **overrides: Any):
    from test_transformers import _config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    attention = "eager" if arch == "gpt_oss" else "sdpa"  # transformers' sdpa has no sinks
    return AutoModelForCausalLM.from_config(_config(arch, **overrides), attn_implementation=attention).train()


def _reference_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "attention_mask"}
    return model(**inputs, use_cache=False).loss


@needs_transformers
@pytest.mark.parametrize("arch,packed,tied", [
    ("llama", False, False), ("llama", True, True), ("qwen3", True, False), ("mistral", False, True),
    ("gemma3", True, True), ("gemma3", False, False),
])
def test_hf_tiled_step_equals_transformers(arch: str, packed: bool, tied: bool) -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch

    overrides = {"tie_word_embeddings": tied}
    if arch == "gemma3" and tied:
        overrides["final_logit_softcapping"] = 3.0  # Gemma 2's soft-capped logits, through the tiled head
    reference = _hf(arch, **overrides)
    model = rsp_hf.enable_long_sequence(copy.deepcopy(reference), tile_tokens=7)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    batch = _global_batch(packed)
    want = _reference_loss(reference, batch)
    want.backward()
    loss = rsp_hf.model_loss(model, rsp_hf.shard_batch(batch, None))
    loss.backward()
    assert abs(loss.item() - want.item()) <= LOSS_TOL
    assert _rel_grad_error(model, reference) <= GRAD_TOL
    # outside model_loss the head still returns logits without grad (generation, evaluation) ...
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    assert logits.shape == (*batch["input_ids"].shape, model.config.vocab_size)
    # ... and refuses a training forward, which would silently build the full logits
    with pytest.raises(RuntimeError, match=r"tiled_loss=True .*\.model_loss\(model, shard"):
        model(input_ids=batch["input_ids"])


@needs_transformers
def test_model_loss_untiled_is_the_same_loss() -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch

    reference = _hf("llama")
    model = rsp_hf.enable_long_sequence(copy.deepcopy(reference), tiled_mlp=False, tiled_loss=False)
    plain = copy.deepcopy(reference)  # never switched: model_loss computes from the logits
    batch = _global_batch(True)
    want = _reference_loss(reference, batch)
    switched_off = rsp_hf.enable_long_sequence(rsp_hf.enable_long_sequence(copy.deepcopy(reference)), tiled_mlp=False,
                                               tiled_loss=False)  # on, then off again: the HF classes are back
    assert type(switched_off.lm_head) is torch.nn.Linear and type(switched_off.model.layers[0].mlp).__name__ == "LlamaMLP"
    for m in (model, plain, switched_off):
        assert abs(rsp_hf.model_loss(m, rsp_hf.shard_batch(batch, None)).item() - want.item()) <= LOSS_TOL


@needs_transformers
def test_unknown_mlp_or_head_and_offload_without_checkpointing_raise_before_changing_anything() -> None:
    import ring_sp.integrations.transformers as rsp_hf

    gpt_oss = _hf("gpt_oss")
    with pytest.raises(ValueError, match=r"GptOssMLP \(gpt-oss's mixture-of-experts block\).*tiled_mlp=False"):
        rsp_hf.enable_long_sequence(gpt_oss)
    assert type(gpt_oss.model.layers[0].mlp).__name__ == "GptOssMLP" and rsp_hf.long_sequence_config(gpt_oss) is None
    rsp_hf.enable_long_sequence(gpt_oss, tiled_mlp=False)  # its head is known

    from transformers import GraniteConfig, GraniteForCausalLM, Phi3Config, Phi3ForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    granite = GraniteForCausalLM(GraniteConfig(**small, logits_scaling=2.0))  # its head divides the logits
    with pytest.raises(ValueError, match=r"does not know the LM head of GraniteForCausalLM.*tiled_loss=False"):
        rsp_hf.enable_long_sequence(granite, tiled_mlp=False)
    phi3 = Phi3ForCausalLM(Phi3Config(**small, pad_token_id=0))  # fused gate_up_proj
    with pytest.raises(ValueError, match=r"layers\[0\]\.mlp is a Phi3MLP, which ring_sp's tiled MLP does not know.*"
                                         r"tiled_mlp=False"):
        rsp_hf.enable_long_sequence(phi3, tiled_loss=False)
    llama = _hf("llama")
    with pytest.raises(ValueError, match=r"offload_checkpoints=True .* activation checkpointing off; call "
                                         r"model\.gradient_checkpointing_enable\(\).*or pass offload_checkpoints=False"):
        rsp_hf.enable_long_sequence(llama, offload_checkpoints=True)
    with pytest.raises(ValueError, match=r"tile_tokens=0 must be >= 1"):
        rsp_hf.enable_long_sequence(llama, tile_tokens=0)
    with pytest.raises(TypeError, match=r"tiled_mlp must be True or False"):
        rsp_hf.enable_long_sequence(llama, tiled_mlp="yes")
    assert type(llama.model.layers[0].mlp).__name__ == "LlamaMLP"  # nothing changed by a failed call
    # checkpointing switched off after enabling: model_loss refuses before the forward
    llama.gradient_checkpointing_enable()
    rsp_hf.enable_long_sequence(llama, offload_checkpoints=True)
    llama.gradient_checkpointing_disable()
    shard = rsp_hf.shard_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, None)
    with pytest.raises(ValueError, match=r"offload_checkpoints=True"):
        rsp_hf.model_loss(llama, shard)


class _LargestTile(torch.utils._python_dispatch.TorchDispatchMode):
    """Rows of the largest non-view tensor any op creates whose last dimension is one of ``widths``."""

    def __init__(self, widths: dict[str, int]) -> None:
        super().__init__()
        self.widths, self.rows = widths, {name: 0 for name in widths}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t._is_view():
                for name, width in self.widths.items():
                    if t.shape[-1] == width:
                        self.rows[name] = max(self.rows[name], t.numel() // width)
        return out


class _LiveOfShape(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak count of live tensor storages created inside the block with ``numel`` elements
    (``existing``: tensors whose storages were there before, e.g. the weight and its .grad)."""

    def __init__(self, numel: int, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.numel, self.live, self.peak = numel, set(), 0
        self.existing = {id(t.untyped_storage()) for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() == self.numel:
                storage = t.untyped_storage()  # one Python object per storage for its life: in-place ops return it again
                if id(storage) not in self.live and id(storage) not in self.existing:
                    self.live.add(id(storage))
                    weakref.finalize(storage, self.live.discard, id(storage))
                self.peak = max(self.peak, len(self.live))
        return out


@pytest.mark.parametrize("warm", [False, True])
def test_head_gradient_takes_one_buffer_beyond_grad(warm: bool) -> None:
    """Issue 30.4: the tiled loss sums the head's gradient into ONE [vocab, hidden] buffer (no per-tile
    product, no scaled copy in the backward); an fp32 head's gradient IS that buffer when .grad is unset."""
    torch.manual_seed(0)
    vocab, hidden_size = 48, 8  # [vocab, hidden] is the only tensor shape with 384 elements here
    hidden = torch.randn(50, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (50,))
    if warm:  # a steady-state step: .grad exists and is added to
        weight.grad = torch.zeros_like(weight)
    with _LiveOfShape(vocab * hidden_size, [weight] + ([weight.grad] if warm else [])) as counter:
        (tiled_linear_cross_entropy(hidden, weight, labels, tile_tokens=7) / 3.0).backward()
        created = counter.peak
    assert created == 1, created  # >= 1 is the control: the accumulator is seen
    reference = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight), labels, reduction="sum") / 3.0, weight)[0]
    assert torch.allclose(weight.grad, reference, rtol=1e-5, atol=1e-6)


@needs_transformers
def test_largest_logits_and_mlp_tensors_are_one_tile() -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch

    vocab, ffn, tile = 96, 80, 32  # hidden 32 = tile: weights and their gradients have <= tile rows too
    batch = _global_batch(False, rows=2, seq=64)
    tokens = batch["input_ids"].numel()
    rows = {}
    for tiled in (False, True):
        model = _hf("llama", vocab_size=vocab, intermediate_size=ffn)
        if tiled:
            rsp_hf.enable_long_sequence(model, tile_tokens=tile)
        shard = rsp_hf.shard_batch(batch, None)
        with _LargestTile({"vocab": vocab, "ffn": ffn}) as mode:
            rsp_hf.model_loss(model, shard).backward()
        rows[tiled] = mode.rows
    assert rows[False] == {"vocab": tokens, "ffn": tokens}  # the control: untiled, every token at once
    assert rows[True] == {"vocab": tile, "ffn": tile}, rows


@needs_transformers
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiled_mlp_keeps_its_norms_input_not_the_normalised_rows(monkeypatch, arch: str) -> None:
    """A lean norm feeding a tiled MLP: the MLP keeps the norm's input (the residual, kept anyway)
    and normalises each tile again, so the [n, hidden] normalised rows are kept by nobody."""
    import ring_sp.integrations.transformers.tiled_modules as tiled_modules
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.tiling import mark_rowwise_origin, rowwise_origin
    from test_transformers import _global_batch

    batch = _global_batch(False, rows=1, seq=32)
    kept = {}
    for fused in (True, False):
        if not fused:  # the control: the MLP told nothing of its input's origin keeps the normalised rows
            monkeypatch.setattr(tiled_modules, "rowwise_origin", lambda x: None)
        model = rsp_hf.enable_long_sequence(_hf(arch), tile_tokens=8)
        norm_name = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
        seen = {}  # the norm's input and output per layer, held so that their storage is not reused
        for i, layer in enumerate(model.model.layers):
            getattr(layer, norm_name).register_forward_hook(lambda m, args, out, i=i: seen.update({i: (args[0], out)}))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage()) or t, lambda t: t):
            loss = rsp_hf.model_loss(model, rsp_hf.shard_batch(batch, None))
        kept[fused] = [tuple(any(s is t.untyped_storage() for s in saved) for t in pair) for pair in seen.values()]
        loss.backward()
    assert kept[True] == [(True, False)] * len(kept[True]), kept
    assert all(out for _, out in kept[False]), kept
    # only the norm that feeds the MLP says where its output came from (the final norm's output,
    # which callers may hold, does not keep its input alive)
    assert rowwise_origin(model.model.norm(torch.randn(2, 3, model.config.hidden_size))) is None
    # changed in place after the norm: no longer the norm's rows, so no origin is claimed
    x = torch.randn(4, 8)
    y = mark_rowwise_origin(x * 2, x, lambda rows: rows * 2, lambda: ())
    assert rowwise_origin(y) is not None
    y.add_(1)
    assert rowwise_origin(y) is None
    y = mark_rowwise_origin(x * 2, x, lambda rows: rows * 2, lambda: ())
    x.add_(1)  # the source changed: fn(source) is no longer y
    assert rowwise_origin(y) is None


@needs_transformers
def test_lean_tiled_model_runs_under_inference_mode() -> None:
    """Inference tensors have no version counter: the lean RoPE's and norm's tags still work (no
    in-place check, no backward), and the logits equal transformers' own."""
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch

    reference = _hf("llama")
    model = rsp_hf.enable_long_sequence(copy.deepcopy(reference), tile_tokens=8)
    ids = _global_batch(False, rows=1, seq=32)["input_ids"]
    with torch.inference_mode():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def _act_rows(model) -> list[list[int]]:
    """Per layer, the tokens of every call of its MLP's activation (one call per MLP forward of a tile)."""
    calls: list[list[int]] = [[] for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        layer.mlp.act_fn.register_forward_hook(lambda m, args, out, i=i: calls[i].append(args[0].numel() // args[0].shape[-1]))
    return calls


@needs_transformers
def test_mlp_forwards_per_step_with_and_without_checkpointing() -> None:
    """Tiling adds exactly one MLP forward (the backward's recompute of each tile), with or without
    activation checkpointing: no recompute of a recompute."""
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch

    batch = _global_batch(False, rows=2, seq=16)
    tokens, tile = batch["input_ids"].numel(), 8
    passes = {}
    for tiled in (False, True):
        for checkpointing in (False, True):
            model = _hf("llama")
            model.config.use_cache = False
            if checkpointing:
                model.gradient_checkpointing_enable()
            if tiled:
                rsp_hf.enable_long_sequence(model, tile_tokens=tile)
            calls = _act_rows(model)
            rsp_hf.model_loss(model, rsp_hf.shard_batch(batch, None)).backward()
            assert all(max(c) <= (tile if tiled else tokens) for c in calls)
            assert len({tuple(c) for c in calls}) == 1  # the same for every layer
            passes[tiled, checkpointing] = sum(calls[0]) / tokens
    assert passes == {(False, False): 1, (False, True): 2, (True, False): 2, (True, True): 3}, passes


@needs_transformers
def test_head_and_mlp_modules_called_once_per_pass() -> None:
    """What ZeRO-3 hooks see: the LM head's module runs once per step (one gather of its weight),
    an MLP's once per layer, its Linear submodules never (their weights are read once per pass by
    the tiled function), however many tiles."""
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch

    model = rsp_hf.enable_long_sequence(_hf("llama", tie_word_embeddings=True), tile_tokens=4)
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, args, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
    rsp_hf.model_loss(model, rsp_hf.shard_batch(_global_batch(False), None)).backward()
    assert counts["lm_head"] == 1 and counts["model.embed_tokens"] == 1
    assert counts["model.layers.0.mlp"] == counts["model.layers.1.mlp"] == 1
    assert "model.layers.0.mlp.gate_proj" not in counts and "model.layers.1.mlp.down_proj" not in counts


# ---------------------------------------------------------------- checkpoint offload (ring_sp/offload.py)

@needs_transformers
def test_offloaded_checkpoints_move_each_layer_input_and_prefetch_one_layer_ahead() -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.offload import OffloadedCheckpoint
    from test_offload_prefetch import RecordingMover
    from test_transformers import _global_batch

    batch = _global_batch(True)
    results = []
    for offload in (False, True):
        model = _hf("llama", num_hidden_layers=3)
        model.gradient_checkpointing_enable()
        rsp_hf.enable_long_sequence(model, offload_checkpoints=offload, tile_tokens=8)
        if offload:
            mover = RecordingMover()
            model.ring_sp_offloader = OffloadedCheckpoint(mover)
        loss = rsp_hf.model_loss(model, rsp_hf.shard_batch(batch, None))
        moved_in_forward = list(mover.log) if offload else None
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (offloaded_loss, offloaded_grads) = results
    assert torch.equal(loss, offloaded_loss)
    assert all(torch.equal(grads[n], offloaded_grads[n]) for n in grads)  # bitwise: the same tensors came back
    hidden = (1, batch["input_ids"].numel(), model.config.hidden_size)
    assert mover.shapes == [hidden] * 3  # the forward: one hidden state per layer, nothing else
    assert moved_in_forward == [("to_host", 0), ("to_host", 1), ("to_host", 2)]
    # the backward: layer 2 fetched and layer 1 prefetched before layer 2 is used, and so on down
    assert mover.log[3:] == [("to_device", 2), ("to_device", 1), ("wait", 2), ("to_device", 0), ("wait", 1),
                             ("wait", 0)]


# ---------------------------------------------------------------- the DeepSpeed config section

def test_deepspeed_section_takes_and_checks_the_switches() -> None:
    from ring_sp.integrations.deepspeed import RingSPConfig

    assert RingSPConfig.from_dict({}).long_sequence is None  # off by default: existing configs unchanged
    section = {"tiled_mlp": True, "tiled_loss": True, "offload_checkpoints": False, "tile_tokens": 512}
    # lean_layers None: on with tiling; head_chunks null: "auto" with the long-sequence step
    assert RingSPConfig.from_dict(section).long_sequence == {**section, "lean_layers": None, "head_chunks": "auto"}
    assert RingSPConfig.from_dict({**section, "head_chunks": 2}).long_sequence["head_chunks"] == 2
    with pytest.raises(ValueError, match=r"ring_sp\.head_chunks"):
        RingSPConfig.from_dict({"tiled_mlp": True, "head_chunks": 0})
    assert RingSPConfig.from_dict({**section, "lean_layers": False}).long_sequence["lean_layers"] is False
    with pytest.raises(TypeError, match=r"ring_sp\.lean_layers must be true, false or null"):
        RingSPConfig.from_dict({"tiled_mlp": True, "lean_layers": 1})
    with pytest.raises(ValueError, match=r"ring_sp\.tile_tokens=0 must be >= 1"):
        RingSPConfig.from_dict({"tiled_mlp": True, "tile_tokens": 0})
    with pytest.raises(TypeError, match=r"ring_sp\.tiled_loss must be true or false"):
        RingSPConfig.from_dict({"tiled_loss": "yes"})


# ---------------------------------------------------------------- the grid

def sp_case(arch: str, u: int, r: int, packed: bool, tied: bool = False, head_chunks: int | None = None
            ) -> dict[str, Any]:
    """model_loss (tiled MLP + loss, lean layers, ``head_chunks``) on the U x R grid vs transformers'
    untiled loss on one rank; also the head_chunks every attention call was given."""
    import torch.distributed as dist

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from test_transformers import _global_batch, _models, _reference_run

    topology = dist_cases.topology(u, r)
    rsp_hf.register(topology, layout="zigzag")
    batch = _global_batch(packed)
    reference, model = _models(arch, torch.float32, "set", tie_word_embeddings=tied)
    _, ref_loss, ref_grads = _reference_run(reference, batch)
    rsp_hf.enable_long_sequence(model, tile_tokens=3, head_chunks=head_chunks)
    import ring_sp.integrations.transformers.attention as hf_attention

    seen, real = set(), hf_attention.hybrid_attention
    hf_attention.hybrid_attention = lambda *a, **k: seen.add(k.get("head_chunks")) or real(*a, **k)
    try:
        loss = rsp_hf.model_loss(model, rsp_hf.shard_batch(batch, topology), topology=topology)
    finally:
        hf_attention.hybrid_attention = real
    loss.backward()
    errors = []
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=topology.sp_group)  # gradients summed over SP (gradients_averaged_over_sp=False)
        errors.append(((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp(min=1e-30)).item())
    return {"loss": abs(loss.item() - ref_loss), "grads": max(errors), "head_chunks": seen}


@needs_transformers
@pytest.mark.parametrize("arch,u,r,packed,tied,chunks", [
    ("llama", 2, 2, True, False, None),
    ("qwen3", 1, 4, False, True, 2),
    pytest.param("mistral", 1, 4, True, False, None, marks=pytest.mark.slow),
    pytest.param("gemma3", 2, 2, False, True, None, marks=pytest.mark.slow),
])
def test_tiled_step_on_the_grid_equals_one_rank(pools, arch: str, u: int, r: int, packed: bool, tied: bool,
                                                chunks: int | None) -> None:
    """The long-sequence step (default head_chunks "auto"; 2 chunks from enable_long_sequence) against one rank."""
    for rank, res in enumerate(pools.get(4).run(sp_case, arch, u, r, packed, tied, chunks or "auto", timeout=300)):
        assert res["loss"] <= LOSS_TOL and res["grads"] <= GRAD_TOL, f"rank {rank}: {res}"
        assert res["head_chunks"] == {chunks or "auto"}, res  # what enable_long_sequence set reaches every call


DS_ENV = {"DS_ACCELERATOR": "cpu"}


def zero3_case(tile_tokens: int | None) -> dict[str, Any]:
    """ZeRO-3 on U2 x R2 with the section's tiling (tile_tokens None: tiling off): the gradients of
    one rank's sdpa model, and how often each parameter is all-gathered in the second step."""
    import os

    import torch.distributed as dist
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils import safe_get_full_grad

    import ring_sp.integrations.deepspeed as rsp_ds
    import ring_sp.integrations.transformers as rsp_hf
    from examples.common.deepspeed_cpu import skip_cpu_inference_comm_build
    from test_transformers import _global_batch, _models, _reference_run

    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    skip_cpu_inference_comm_build()
    section = {"ulysses_size": 2, "ring_size": 2, "layout": "zigzag"}
    if tile_tokens is not None:
        section.update(tiled_mlp=True, tiled_loss=True, tile_tokens=tile_tokens)
    # every parameter partitioned (none persistent) and released as soon as its module is done
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "ring_sp": section}
    topology = rsp_ds.build_topology(config)
    rsp_hf.register(topology, layout="zigzag")
    reference, model = _models("llama", torch.float32, "from_config", tie_word_embeddings=True)
    batch = _global_batch(False, rows=1)
    _, ref_loss, ref_grads = _reference_run(reference, batch)
    names = {id(p): n for n, p in model.named_parameters()}
    engine, *_ = rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    shard = rsp_hf.shard_batch(batch, topology)
    gathers: dict[str, int] = {}
    original = PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_

    def counting(self, params, forward, quantize=False):
        for p in params:
            if p.ds_status == ZeroParamStatus.NOT_AVAILABLE:
                gathers[names[id(p)]] = gathers.get(names[id(p)], 0) + 1
        return original(self, params, forward, quantize)

    for step in range(2):  # the second step runs on ZeRO-3's recorded trace
        if step == 1:
            PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_ = counting
        try:
            loss = rsp_hf.model_loss(engine, shard)
            engine.backward(loss)
            grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
            engine.step()
        finally:
            PartitionedParameterCoordinator._PartitionedParameterCoordinator__all_gather_params_ = original
    error = max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() for n, g in ref_grads.items())
    return {"loss": abs(loss.item() - ref_loss), "grads": error, "gathers": gathers,
            "tiled": type(engine.module.model.layers[0].mlp).__name__}


@needs_deepspeed
@needs_transformers
def test_zero3_tiled_step_is_exact_and_gathers_each_weight_once_per_pass(pools) -> None:
    pool = pools.get(4, env=DS_ENV)
    tiled = pool.run(zero3_case, 3, timeout=600)
    untiled = pool.run(zero3_case, None, timeout=600)
    for rank, (res, plain) in enumerate(zip(tiled, untiled)):
        assert res["tiled"] == "RingSPTiledLlamaMLP" and plain["tiled"] == "LlamaMLP"
        assert res["loss"] <= LOSS_TOL and res["grads"] <= GRAD_TOL, f"rank {rank}: {res}"
        assert plain["loss"] <= LOSS_TOL and plain["grads"] <= GRAD_TOL, f"rank {rank}: {plain}"
        # the same gathers, but the norm feeding each tiled MLP: the MLP reads its weight to normalise
        # its tiles again (it keeps the norm's input, not its output), one more gather of [hidden] in the
        # forward (not at ZeRO's default persistence threshold: norms stay gathered)
        renorm = {n: c + 1 for n, c in plain["gathers"].items() if n.endswith("post_attention_layernorm.weight")}
        assert len(renorm) == 2 and res["gathers"] == {**plain["gathers"], **renorm}, \
            f"rank {rank}: tiled {res['gathers']} vs untiled {plain['gathers']}"
        # not vacuous: the second step does gather the (tied) head and the MLP weights, once per pass
        assert res["gathers"].get("model.embed_tokens.weight", 0) >= 1, res["gathers"]
        assert 1 <= res["gathers"].get("model.layers.0.mlp.gate_proj.weight", 0) <= 2, res["gathers"]


# ---------------------------------------------------------------- the DeepSpeed GPT example's own model

def test_gpt_example_tiled_step_equals_untiled() -> None:
    """examples/deepspeed/pretrain_gpt.py's GPT (GELU MLP with biases, tied head): tiled MLP and loss,
    checkpointed blocks offloaded, vs the plain model (no SP: the pieces are the same on the grid)."""
    from examples.deepspeed.pretrain_gpt import GPT, GPTConfig, loss_fn, tiled_loss

    cfg = GPTConfig(vocab_size=96, d_model=32, n_layer=2, n_head=4, n_kv_head=2)
    torch.manual_seed(0)
    plain = GPT(cfg)
    tiled = copy.deepcopy(plain)
    tiled.checkpointing = True
    tiled.enable_long_sequence(tiled_mlp=True, tiled_loss=True, offload_checkpoints=True, tile_tokens=5)
    ids = torch.randint(0, 96, (2, 24))
    positions = torch.arange(24).expand(2, 24)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    want = loss_fn(plain(ids, positions), labels, None)
    want.backward()
    loss = tiled_loss(tiled(ids, positions, labels=labels), labels, None)
    loss.backward()
    assert abs(loss.item() - want.item()) <= LOSS_TOL
    assert _rel_grad_error(tiled, plain) <= GRAD_TOL
    bare = GPT(cfg)
    with pytest.raises(ValueError, match=r"offload_checkpoints=True needs activation checkpointing: pass "
                                         r"--checkpoint-activations"):
        bare.enable_long_sequence(tiled_mlp=True, tiled_loss=False, offload_checkpoints=True, tile_tokens=None)
    with pytest.raises(ValueError, match=r"tile_tokens=0 must be >= 1"):
        bare.enable_long_sequence(tiled_mlp=True, tiled_loss=False, offload_checkpoints=False, tile_tokens=0)


@pytest.mark.slow  # two 4-rank DeepSpeed launches
@needs_deepspeed
@pytest.mark.parametrize("example,extra", [("deepspeed/pretrain_gpt.sh", []),
                                           ("transformers/pretrain_llama.sh", ["--pack-documents"])])
def test_examples_long_sequence_flags_train_as_untiled(example: str, extra: list[str]) -> None:
    """The examples on U2 x R2 with --tiled-mlp --tiled-loss --checkpoint-activations --offload-checkpoints
    log the same losses as without (same seed, same data)."""
    from pathlib import Path

    from example_scripts import run_launcher

    script = Path(__file__).resolve().parents[1] / "examples" / example
    tiny = ["--seq-len", "64", "--d-model", "32", "--layers", "2", "--micro-batch", "2", "--corpus-bytes", "200000",
            "--steps", "3", "--log-json", *extra]
    plain = run_launcher(script, *tiny, timeout=600)
    tiled = run_launcher(script, *tiny, "--tiled-mlp", "--tiled-loss", "--tile-tokens", "5", "--checkpoint-activations",
                         "--offload-checkpoints", timeout=600)
    assert len(plain) == len(tiled) == 3
    for a, b in zip(plain, tiled):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (plain, tiled)


def test_offloaded_checkpoints_take_their_own_size_of_host_memory() -> None:
    """torch's pinned allocator rounds a block up to a power of two: the CUDA mover copies a checkpoint
    into power-of-two pieces instead, so a 4.1 GiB layer input takes 4.1 GiB of host RAM, not 8."""
    from ring_sp.offload import PIECE_GRANULE, copy_from_pieces, copy_into_pieces, pinned_piece_sizes

    for nbytes in (0, 1, PIECE_GRANULE, 3 * PIECE_GRANULE + 5, int(4.1 * 2**30), 2**33):
        sizes = pinned_piece_sizes(nbytes)
        assert all(s & (s - 1) == 0 and s >= PIECE_GRANULE for s in sizes)  # each block is taken as it is
        assert nbytes <= sum(sizes) < nbytes + PIECE_GRANULE
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert sum(pinned_piece_sizes(int(4.1 * 2**30))) < 1.001 * 4.1 * 2**30  # one power-of-two block: 8 GiB
    source = torch.randn(5, PIECE_GRANULE // 4 + 17, dtype=torch.bfloat16)  # 4 + 2 MiB pieces, the last partly filled
    raw = source.reshape(-1).view(torch.uint8)
    pieces = copy_into_pieces(raw, pin_memory=False)
    assert [p.numel() for p in pieces] == pinned_piece_sizes(raw.numel()) == [2 * PIECE_GRANULE, PIECE_GRANULE]
    back = torch.empty_like(source)
    copy_from_pieces(pieces, back.reshape(-1).view(torch.uint8))
    assert torch.equal(back, source)
