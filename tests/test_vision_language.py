"""Issue 41: Gemma 3's vision-language model (``Gemma3ForConditionalGeneration``, a tiny config
with its SigLIP vision tower, no download) trained under ``attn_implementation="ring_sp"``
with images packed into long sequences, against the same model on one rank with ``sdpa``.

Images of 4 tokens (each between its begin/end-of-image tokens) are packed so that shard
edges cut most of them; the sliding layers' window (6) crosses the edges too. On every rank
of U2xR2 and U1xR4, the gathered logits, ``causal_lm_loss`` and every parameter's gradient
(summed over the SP group, the vision tower's included) equal the one-rank sdpa model's to
1e-5 relative (fp32); one DeepSpeed (ZeRO-1) step gives the same gradients and weights. A
malformed shard (spans dropped or moved, the model's own token_type_ids without spans, image
rows dropped, another image count) is a clear error on every rank; an unknown vision-language model
and a batch whose token_type_ids come without ``model=`` are refused by name.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'ring-sp[transformers]')")

VOCAB, IMAGE, BOI, EOI = 64, 60, 61, 62
TOKENS_PER_IMAGE = 4
REL = 1e-5  # fp32: logits, loss and gradients relative to the largest reference entry


def _config():
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                            sliding_window=6, query_pre_attn_scalar=16, attention_dropout=0.0,
                            layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=4)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                        image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI)


def global_batch(packed: bool) -> dict[str, torch.Tensor]:
    """The same batch on every rank. Unpacked: 2 rows of 40 tokens; packed: one row of documents
    of 29, 1, 18 and 16 tokens (position_ids restarting). Images start at positions that put
    shard edges (every 8 or 10 tokens) inside them."""
    g = torch.Generator().manual_seed(11)
    rows, n = (1, 64) if packed else (2, 40)
    ids = torch.randint(0, IMAGE - 1, (rows, n), generator=g)
    types = torch.zeros_like(ids)
    starts = ([[4, 15, 21], [7, 30]] if not packed else [[5, 14, 21, 33, 52]])
    for row, row_starts in enumerate(starts):
        for s in row_starts:
            ids[row, s - 1], ids[row, s + TOKENS_PER_IMAGE] = BOI, EOI
            ids[row, s:s + TOKENS_PER_IMAGE] = IMAGE
            types[row, s:s + TOKENS_PER_IMAGE] = 1
    labels = torch.where(types == 1, -100, ids)
    images = sum(len(s) for s in starts)
    batch = {"input_ids": ids, "token_type_ids": types, "labels": labels,
             "pixel_values": torch.randn(images, 3, 16, 16, generator=g)}
    if packed:
        docs = (29, 1, 18, 16)
        batch["position_ids"] = torch.cat([torch.arange(d) for d in docs]).unsqueeze(0)
        labels[batch["position_ids"] == 0] = -100
    return batch


def _models() -> tuple[Any, Any]:
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    reference = Gemma3ForConditionalGeneration._from_config(_config(), attn_implementation="sdpa").train()
    with torch.no_grad():  # transformers initialises it to zeros: images would reach nothing, their gradients none
        reference.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    model = Gemma3ForConditionalGeneration._from_config(_config(), attn_implementation="ring_sp")
    model.load_state_dict(reference.state_dict())
    return reference, model.train()


def _reference(model, batch) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    out = model(**batch, use_cache=False)
    out.loss.backward()
    # (the vision tower's pooling head is unused by Gemma 3: no gradient)
    return out.logits.detach(), out.loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                                  if p.grad is not None}


def _relative(got: torch.Tensor, want: torch.Tensor, floor: float = 1e-30) -> float:
    """Max error over the largest reference entry (at least ``floor``)."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=floor)).item()


def _grad_errors(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor], which: str = "") -> float:
    """Every parameter's gradient error relative to its largest entry; a gradient that is zero in
    exact arithmetic (SigLIP's key bias: the softmax ignores a shift shared by all keys) against
    1e-3 of the largest gradient of the model instead of its own rounding noise."""
    floor = 1e-3 * max(g.abs().max().item() for g in ref_grads.values())
    return max(_relative(grads[n], g, floor) for n, g in ref_grads.items() if which in n)


def vlm_case(u: int, r: int, packed: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    topo = dist_cases.topology(u, r)
    rsp_hf.register(topo, layout="zigzag")
    batch = global_batch(packed)
    reference, model = _models()
    ref_logits, ref_loss, ref_grads = _reference(reference, batch)
    shard = rsp_hf.shard_batch(batch, topo, model=model)
    logits = model(**shard).logits
    loss = rsp_hf.causal_lm_loss(logits, shard["shift_labels"], topology=topo, gradients_averaged_over_sp=False)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if name in ref_grads:
            grads[name] = p.grad.detach().clone()
            dist.all_reduce(grads[name], group=topo.sp_group)
        else:
            assert p.grad is None, name
    cu = shard["cu_seq_lens_q"]
    gathered = topo.gather_sequence(logits.detach(), layout="document_zigzag", cu_seqlens=cu,
                                    seq_len=batch["input_ids"].numel())
    errors = {"logits": _relative(gathered.reshape(ref_logits.shape), ref_logits),
              "loss": abs(loss.item() - ref_loss) / abs(ref_loss),
              "grads": _grad_errors(grads, ref_grads), "vision_grads": _grad_errors(grads, ref_grads, "vision_tower"),
              "vision_grad_size": max(g.abs().max().item() for n, g in ref_grads.items() if "vision_tower" in n),
              "images_here": shard["pixel_values"].shape[0], "images": batch["pixel_values"].shape[0],
              "spans": shard["ring_sp_spans"].tolist()}
    for name, (mutated, extra) in _mutations(shard).items():  # every one a clear error on every rank
        try:
            model(**mutated, **extra)
            errors[name] = "no error"
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


MUTATIONS = {  # what a malformed vision-language shard raises (on every rank)
    "token_type_ids to the model, spans dropped": "tokens see later tokens",
    "spans dropped": "holds bidirectional spans \\(images\\) but the attention got none",
    "a span moved by one": "was cut with other bidirectional spans",
    "image token rows dropped": "pixel_values and 'ring_sp_image_tokens' are not the shard's",
    "pixel_values of one image more": "pixel_values and 'ring_sp_image_tokens' are not the shard's",
}


def _mutations(shard: dict[str, torch.Tensor]) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    def without(key: str) -> dict[str, torch.Tensor]:
        return {k: v for k, v in shard.items() if k != key}

    return {
        "token_type_ids to the model, spans dropped": (without("ring_sp_spans"),
                                                       {"token_type_ids": torch.ones_like(shard["input_ids"])}),
        "spans dropped": (without("ring_sp_spans"), {}),
        "a span moved by one": ({**shard, "ring_sp_spans": shard["ring_sp_spans"] + 1}, {}),
        "image token rows dropped": (without("ring_sp_image_tokens"), {}),
        "pixel_values of one image more": ({**shard, "pixel_values": torch.cat([shard["pixel_values"]] * 2)[:1 + len(
            shard["pixel_values"])]}, {}),
    }


def _check(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["logits"] <= REL and res["loss"] <= REL and res["grads"] <= REL, f"rank {rank}: {res}"
        assert res["vision_grads"] <= REL and res["vision_grad_size"] > 0, f"rank {rank}: the vision tower's gradients {res}"
        assert res["images_here"] < res["images"], f"rank {rank} encoded every image: {res}"
        for name, pattern in MUTATIONS.items():
            assert re.search(pattern, res[name]) and "on rank(s) [0, 1, 2, 3]" in res[name], (rank, name, res[name])
        assert "model_type 'gemma3_text'" in res["token_type_ids to the model, spans dropped"]


@pytest.mark.parametrize("u,r,packed", [(2, 2, True), (1, 4, False)], ids=["U2xR2-packed", "U1xR4-rows"])
def test_gemma3_vision_language_equals_one_rank(pools, u: int, r: int, packed: bool) -> None:
    _check(pools.get(4).run(vlm_case, u, r, packed, timeout=300))


def deepspeed_case() -> dict[str, float]:
    """One DeepSpeed (ZeRO-1, SGD, no clipping: DeepSpeed clips at 1.0 by default) training step at
    U2xR2: its gradients and updated weights equal the one-rank sdpa model's after the same SGD step."""
    import os

    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    import ring_sp.integrations.deepspeed as rsp_ds
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.deepspeed import skip_cpu_inference_comm_build

    os.environ["LOCAL_RANK"] = str(dist.get_rank())  # DeepSpeed requires it; one host
    skip_cpu_inference_comm_build()
    lr = 0.5
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "ring_sp": {"ulysses_size": 2, "ring_size": 2, "layout": "zigzag"}}
    topology = rsp_ds.build_topology(config)
    rsp_hf.register(topology, layout="zigzag")
    batch = global_batch(packed=True)
    reference, model = _models()
    _, ref_loss, ref_grads = _reference(reference, batch)
    engine, *_ = rsp_ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=config)
    shard = rsp_hf.shard_batch(batch, topology, model=engine.module)
    loss = rsp_hf.causal_lm_loss(engine(**shard).logits, shard["shift_labels"], engine=engine)
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters() if n in ref_grads}
    engine.step()
    return {"loss": abs(loss.item() - ref_loss) / abs(ref_loss), "grads": _grad_errors(grads, ref_grads),
            "weights": _grad_errors({n: safe_get_full_fp32_param(p).detach() for n, p in engine.module.named_parameters()
                                     if n in ref_grads},
                                    {n: reference.get_parameter(n).detach() - lr * g for n, g in ref_grads.items()})}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_gemma3_vision_language_deepspeed_step(pools) -> None:
    for rank, res in enumerate(pools.get(4).run(deepspeed_case, timeout=300)):
        assert res["loss"] <= REL and res["grads"] <= REL and res["weights"] <= REL, f"rank {rank}: {res}"


# ---- one process: the spans and images of a shard, the mask probe, refusals by name ----------

LLAVA = type("Config", (), {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                            "vision_config": object()})()


def test_shard_batch_turns_token_type_ids_into_spans_and_refuses_unknown_models() -> None:
    import ring_sp.integrations.transformers as rsp_hf
    from ring_sp.integrations.transformers.multimodal import vision_model_error

    batch = global_batch(packed=False)  # two rows: they become two documents of one row
    shard = rsp_hf.shard_batch(batch, None, model=_config())
    assert shard["ring_sp_spans"].tolist() == [[4, 8], [15, 19], [21, 25], [47, 51], [70, 74]]
    assert shard["cu_seq_lens_q"].tolist() == [0, 40, 80] and "token_type_ids" not in shard
    assert shard["pixel_values"] is batch["pixel_values"] and "ring_sp_image_tokens" not in shard  # one rank: all
    with pytest.raises(ValueError, match="the batch holds token_type_ids and pixel_values: pass model="):
        rsp_hf.shard_batch(batch, None)
    with pytest.raises(rsp_hf.UnsupportedFeatureError, match=r"LlavaForConditionalGeneration \(model_type 'llava'\) "
                                                             r"takes token_type_ids and pixel_values"):
        rsp_hf.shard_batch(batch, None, model=LLAVA)
    assert "LlavaForConditionalGeneration (model_type 'llava') has a vision tower" in str(vision_model_error(LLAVA))
    assert vision_model_error(_config()) is None and vision_model_error(_config().text_config) is None


def test_the_trainers_collator_passes_the_model(ring_sp_one_rank) -> None:
    """The Trainer's and TRL's collator (SequenceParallelCollator) hands shard_batch the model's
    config, so a vision-language batch shards under them as under shard_batch(model=...)."""
    from ring_sp.integrations.transformers.trainer_setup import SequenceParallelCollator

    batch = global_batch(packed=False)
    model = type("Model", (), {"config": _config()})()  # what the trainers hand over: the model (its config is read)
    shard = SequenceParallelCollator(lambda features: batch, ring_sp_one_rank, layout="zigzag", model=model)([])
    assert shard["ring_sp_spans"].tolist() == rsp_shard(batch)["ring_sp_spans"].tolist()
    with pytest.raises(ValueError, match="pass model="):
        SequenceParallelCollator(lambda features: batch, ring_sp_one_rank, layout="zigzag")([])


def rsp_shard(batch):
    import ring_sp.integrations.transformers as rsp_hf

    return rsp_hf.shard_batch(batch, None, model=_config())


def test_each_rank_encodes_the_images_of_its_tokens() -> None:
    from ring_sp.integrations.transformers.multimodal import shard_images

    pixels = torch.arange(3.0).view(3, 1)  # three images of 4 tokens: 12 image tokens in all
    images, rows = shard_images(pixels, torch.tensor([[0, 3, 4, 5, 0, 9, 12]]), 12, "test")
    assert images.flatten().tolist() == [0.0, 1.0, 2.0] and rows.tolist() == [2, 3, 4, 8, 11]
    images, rows = shard_images(pixels, torch.tensor([[0, 6, 7, 0]]), 12, "test")  # image 1 alone
    assert images.flatten().tolist() == [1.0] and rows.tolist() == [1, 2]
    images, rows = shard_images(pixels, torch.zeros(1, 5, dtype=torch.long), 12, "test")  # no image token
    assert images.flatten().tolist() == [0.0] and rows.numel() == 0  # one image, none of its rows
    with pytest.raises(ValueError, match="10 image tokens for 3 images"):
        shard_images(pixels, torch.zeros(1, 5, dtype=torch.long), 10, "test")


def test_the_mask_probe_tells_block_masks_from_causal_ones() -> None:
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function, or_masks,
                                            packed_sequence_mask_function, sliding_window_overlay)

    from ring_sp.integrations.transformers.features import sees_later_tokens

    packed = packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))
    blocks = torch.tensor([[-1, 0, 0, -1, -1, 1, -1, -1]])
    one_token = torch.tensor([[-1, 0, -1, 1, -1, -1, -1, -1]])
    for mask, later in ((causal_mask_function, False), (and_masks(causal_mask_function, sliding_window_overlay(3)), False),
                        (and_masks(causal_mask_function, packed), False),
                        (or_masks(and_masks(causal_mask_function, packed), blockwise_overlay(blocks)), True),
                        (or_masks(causal_mask_function, blockwise_overlay(one_token)), False),
                        (lambda b, h, q, kv: q >= 0, True), (lambda b, h, q, kv: 1 / 0, True)):
        assert sees_later_tokens(mask, 1, 8, "cpu") is later, mask
