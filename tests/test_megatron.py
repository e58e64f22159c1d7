"""C18: the Megatron integration on gloo CPU ranks with megatron-core.

A megatron-core ``GPTModel`` with the ring_sp core-attention spec at CP = 4 (U2 x R2,
U1 x R4) and TP = 2 x CP = 2, fed Megatron's own ``get_batch_on_this_cp_rank`` shards,
gives the loss and, after Megatron's DDP gradient reduction, the gradients of the same
model at CP = 1 on the full sequence, whose core attention is plain softmax attention
written here (megatron-core's DotProductAttention cannot run on CPU). Plus the argument
switch, the spec import paths, RoPE slicing against Megatron's own, and the example.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'megatron-core==0.16.1')")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402

import ring_sp  # noqa: E402
import ring_sp.integrations.megatron as rsm  # noqa: E402
from dist_cases import random_documents  # noqa: E402
from ring_sp import sequence_parallel_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQ, BATCH, VOCAB, HEADS, GROUPS = 64, 2, 256, 4, 2


# ---------------------------------------------------------------------------- model runs


class PlainCoreAttention(MegatronModule):
    """The CP = 1 reference: causal softmax attention with Megatron's core-attention API."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None) -> None:
        super().__init__(config=config)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _config(tp: int, cp: int, per_token_loss: bool = False, **overrides) -> TransformerConfig:
    return TransformerConfig(**overrides,
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=HEADS, num_query_groups=GROUPS,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, context_parallel_size=cp, calculate_per_token_loss=per_token_loss,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def _model(layer_spec, tp: int, cp: int, full_params: dict[str, torch.Tensor] | None,
           per_token_loss: bool = False, position_embedding_type: str = "rope", **overrides) -> DistributedDataParallel:
    """GPTModel + Megatron DDP; weights are this TP rank's slices of ``full_params``;
    ``overrides``: TransformerConfig fields."""
    torch.manual_seed(0)
    config = _config(tp, cp, per_token_loss, **overrides)
    model = GPTModel(config, layer_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type=position_embedding_type, share_embeddings_and_output_weights=False)
    if position_embedding_type == "rope":
        rsm.install_layout_rope(model)  # megatron-core's own RoPE calls CUDA (see test_layout_rope_equals_megatrons)
    if full_params is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_tp_slice(full_params[name], param))
    with rsm.ddp_buffers_on_cpu():
        return DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)


def _tp_slice(full: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """This TP rank's part of a full weight, as megatron-core's CPU initialisation splits it."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    pieces = full.chunk(tp * param.partition_stride, dim=param.partition_dim)
    return torch.cat(pieces[parallel_state.get_tensor_model_parallel_rank()::tp], dim=param.partition_dim)


def _tp_gather(shard: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """Inverse of :func:`_tp_slice` over the TP group."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    stride, dim = param.partition_stride, param.partition_dim
    return torch.cat([parts[r].chunk(stride, dim)[j] for j in range(stride) for r in range(tp)], dim=dim)


def _batch() -> dict[str, torch.Tensor]:
    """Megatron's batch keys; the loss mask leaves CP rank 0 of 4 with no valid token."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    loss_mask = torch.ones(BATCH, SEQ)
    chunk = SEQ // 8
    loss_mask[:, :chunk] = 0  # zigzag chunks 0 and 7 are CP rank 0's (of 4)
    loss_mask[:, -chunk:] = 0
    loss_mask[1, 20:29] = 0
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}


def _forward(model: DistributedDataParallel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s] token losses


def _grads(model: DistributedDataParallel) -> dict[str, torch.Tensor]:
    return {name: _tp_gather(p.main_grad, p) for name, p in model.module.named_parameters()}


def _reference(core=None, **overrides) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """CP = 1, TP = 1 on the full sequence (every rank the same batch: DDP's mean is a no-op)."""
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        model = _model(replace_core(core or PlainCoreAttention), tp=1, cp=1, full_params=None, **overrides)
        params = {name: p.detach().clone() for name, p in model.module.named_parameters()}
        batch = _batch()
        losses = _forward(model, batch)
        loss = (losses * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        model.finish_grad_sync()
        return loss.item(), params, _grads(model)
    finally:
        parallel_state.destroy_model_parallel()


def replace_core(core_attention) -> object:
    return rsm.replace_core_attention(get_gpt_layer_local_spec(normalization="RMSNorm"), core_attention)


def gpt_case(tp: int, cp: int, ulysses: int, hierarchical: bool, reference_core=None, **overrides) -> dict[str, object]:
    """Loss and reduced gradients at TP x CP against the CP = 1 reference, under both
    ring_sp's loss (mean over the CP group, DDP averages) and Megatron-LM's
    ``--calculate-per-token-loss`` convention (local sums, DDP sums, finalize_model_grads
    divides by the global token count). ``overrides``: TransformerConfig fields of both runs;
    ``reference_core``: the CP = 1 core attention (default :class:`PlainCoreAttention`)."""
    ref_loss, params, ref_grads = _reference(reference_core, **overrides)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, create_gloo_process_groups=False,
        hierarchical_context_parallel_sizes=[ulysses, cp // ulysses] if hierarchical else None,
    )
    try:
        config = rsm.RingSPConfig(ulysses_size=ulysses)
        spec = rsm.get_gpt_layer_ring_sp_spec(config, normalization="RMSNorm")
        cp_group = parallel_state.get_context_parallel_group()
        shard = get_batch_on_this_cp_rank(_batch())  # Megatron's own zigzag sharding

        model = _model(spec, tp, cp, params, **overrides)
        losses = _forward(model, shard)
        loss = sequence_parallel_loss((losses * shard["loss_mask"]).sum(), shard["loss_mask"].sum(), group=cp_group,
                                     gradients_averaged_over_sp=True)
        loss.backward()
        model.finish_grad_sync()
        grads = _grads(model)

        per_token_model = _model(spec, tp, cp, params, per_token_loss=True, **overrides)
        local_sum = (_forward(per_token_model, shard) * shard["loss_mask"]).sum()
        local_sum.backward()
        finalize_model_grads([per_token_model], num_tokens=shard["loss_mask"].sum().to(torch.int))
        per_token_grads = _grads(per_token_model)

        attention = model.module.decoder.layers[0].self_attention.core_attention
        hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        return {
            "loss": loss.item(), "ref_loss": ref_loss,
            "grad_err": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "per_token_grad_err": max((per_token_grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "ref_grad_max": max(g.abs().max().item() for g in ref_grads.values()),
            "valid_tokens": int(shard["loss_mask"].sum()),
            "grid": (attention.topology.ulysses_size, attention.topology.ring_size),
            "reused_hcp": hcp is not None and attention.topology.ulysses_group is hcp[0],
            "shared_topology": all(layer.self_attention.core_attention.topology is attention.topology
                                   for layer in model.module.decoder.layers),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,cp,ulysses,hierarchical", [
    pytest.param(1, 4, 2, True, id="cp4-u2xr2-megatron-hierarchical-groups"),
    pytest.param(1, 4, 1, False, id="cp4-u1xr4"),
    pytest.param(2, 2, 2, False, id="tp2xcp2-u2xr1"),
])
def test_gpt_loss_and_reduced_grads_equal_cp1(pools, tp: int, cp: int, ulysses: int, hierarchical: bool) -> None:
    if hierarchical:
        pytest.importorskip("einops", reason="megatron-core builds hierarchical CP groups with einops")
    results = pools.get(4).run(gpt_case, tp, cp, ulysses, hierarchical, timeout=240)
    assert cp < 4 or any(r["valid_tokens"] == 0 for r in results), "one CP rank must have no valid token"
    for r in results:
        assert r["grid"] == (ulysses, cp // ulysses)
        assert r["reused_hcp"] == hierarchical and r["shared_topology"]
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6), r
        assert r["ref_grad_max"] > 1e-3  # the comparison is not between zeros
        assert r["grad_err"] <= 1e-6 and r["per_token_grad_err"] <= 1e-6, r


# ---------------------------------------------------------------------------- RoPE


class _FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("interleaved,percent,layout,factor", [(False, 1.0, "zigzag", None), (True, 0.5, "zigzag", 4.0),
                                                               (False, 1.0, "document_zigzag", None)])
def test_layout_rope_equals_megatrons(monkeypatch, interleaved: bool, percent: float, layout: str,
                                      factor: float | None) -> None:
    """Megatron's own RotaryEmbedding.forward (its two CUDA calls mocked to stay on CPU)
    and LayoutRotaryEmbedding(zigzag) give every CP rank bitwise the same angles (computed for
    the rank's own positions only, no table of every position); so does document_zigzag on an
    unpacked batch (one document); with a sequence-length interpolation factor too."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, pin_memory=False, **kw: real_tensor(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)
    for cp in (1, 2, 4):
        for rank in range(cp):
            group = _FakeGroup(rank, cp)
            rotary = RotaryEmbedding(16, percent, rotary_interleaved=interleaved, use_cpu_initialization=True,
                                     cp_group=group, seq_len_interpolation_factor=factor)
            ours = rsm.LayoutRotaryEmbedding(rotary, layout=layout, cp_group=group, device="cpu")(SEQ)
            with rsm.ddp_buffers_on_cpu():  # get_emb moves inv_freq to torch.cuda.current_device()
                theirs = rotary(SEQ)
            assert ours.shape == (SEQ // cp, 1, 1, int(16 * percent)) and torch.equal(ours, theirs)


# ---------------------------------------------------------------------------- packed sequences (THD)


def _documents() -> tuple[torch.Tensor, tuple[int, ...]]:
    """60 real tokens in documents of random lengths, length-1 documents at both ends."""
    return torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(11)), random_documents(60, seed=5)


# Nine documents of the primes 2 .. 23 (100 tokens, a multiple of CP = 4: no padding anywhere)
PRIME_LENGTHS = (13, 2, 23, 5, 11, 3, 19, 7, 17)


def _prime_documents() -> tuple[torch.Tensor, tuple[int, ...]]:
    cu = tuple(int(x) for x in torch.tensor((0, *PRIME_LENGTHS)).cumsum(0))
    return torch.randint(0, VOCAB, (cu[-1],), generator=torch.Generator().manual_seed(13)), cu


def _per_document_reference(position_embedding_type: str = "rope", documents=_documents, **overrides,
                            ) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """CP = 1 with plain causal SDPA, every real document of ``documents()`` through the
    model on its own (never packed, padded or sharded; positions from 0): the token-mean
    loss over all documents, the weights and the gradients. ``overrides``: TransformerConfig fields."""
    tokens, cu = documents()
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        model = _model(replace_core(PlainCoreAttention), tp=1, cp=1, full_params=None,
                       position_embedding_type=position_embedding_type, **overrides)
        params = {name: p.detach().clone() for name, p in model.module.named_parameters()}
        total, count = 0.0, 0
        for a, b in zip(cu, cu[1:]):
            doc = tokens[a:b][None]
            losses = model(doc, torch.arange(b - a)[None], None, labels=doc.roll(-1, dims=1))[:, :-1]  # last: no target
            total, count = total + losses.sum(), count + losses.numel()
        loss = total / count
        loss.backward()
        model.finish_grad_sync()
        return loss.item(), params, _grads(model)
    finally:
        parallel_state.destroy_model_parallel()


def packed_case(ulysses: int) -> dict[str, object]:
    """CP = 4 on a padded THD batch against every document run alone at CP = 1 with plain
    causal SDPA (the reference never packs, pads or shards), under both loss conventions
    of :func:`gpt_case`; and the THD batch refused by a zigzag-configured attention."""
    ref_loss, params, ref_grads = _per_document_reference()
    tokens, cu = _documents()
    parallel_state.initialize_model_parallel(context_parallel_size=4, create_gloo_process_groups=False)
    try:
        cp_group = parallel_state.get_context_parallel_group()
        shard, packed = rsm.thd_batch_on_this_cp_rank(tokens[None], cu)  # padded, sharded per document
        config = rsm.RingSPConfig(ulysses_size=ulysses, layout="document_zigzag")
        spec = rsm.get_gpt_layer_ring_sp_spec(config, normalization="RMSNorm")
        model = _model(spec, 1, 4, params)
        losses = model(shard["tokens"], shard["position_ids"], None, labels=shard["labels"], packed_seq_params=packed)
        loss = sequence_parallel_loss((losses * shard["loss_mask"]).sum(), shard["loss_mask"].sum(), group=cp_group,
                                      gradients_averaged_over_sp=True)
        loss.backward()
        model.finish_grad_sync()
        grads = _grads(model)

        per_token_model = _model(spec, 1, 4, params, per_token_loss=True)  # --calculate-per-token-loss
        losses = per_token_model(shard["tokens"], shard["position_ids"], None, labels=shard["labels"],
                                 packed_seq_params=packed)
        (losses * shard["loss_mask"]).sum().backward()
        finalize_model_grads([per_token_model], num_tokens=shard["loss_mask"].sum().to(torch.int))
        per_token_grads = _grads(per_token_model)

        attention = model.module.decoder.layers[0].self_attention.core_attention
        q = torch.randn(shard["tokens"].shape[1], HEADS, 16)
        zigzag = rsm.RingSPCoreAttention(_config(1, 4), 1, AttnMaskType.causal, "self", topology=attention.topology,
                                         ring_sp_config=rsm.RingSPConfig(ulysses_size=ulysses, layout="zigzag"))
        with pytest.raises(ValueError) as wrong_layout:
            zigzag(q, q, q, None, packed_seq_params=packed)
        return {
            "loss": loss.item(), "ref_loss": ref_loss,
            "grad_err": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "per_token_grad_err": max((per_token_grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "ref_grad_max": max(g.abs().max().item() for g in ref_grads.values()),
            "grid": (attention.topology.ulysses_size, attention.topology.ring_size),
            "padded_tokens": 4 * shard["tokens"].shape[1], "wrong_layout": str(wrong_layout.value),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ulysses", [pytest.param(2, id="cp4-u2xr2"), pytest.param(1, id="cp4-u1xr4")])
def test_packed_thd_loss_and_reduced_grads_equal_per_document_cp1(pools, ulysses: int) -> None:
    results = pools.get(4).run(packed_case, ulysses, timeout=240)
    for r in results:
        assert r["grid"] == (ulysses, 4 // ulysses) and r["padded_tokens"] > 60  # the 60 real ones, padded
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6), r
        assert r["ref_grad_max"] > 1e-3 and r["grad_err"] <= 1e-6 and r["per_token_grad_err"] <= 1e-6, r
        assert "needs --ring-sp-layout document_zigzag" in r["wrong_layout"], r


def _cp1_thd_case(documents=_documents, per_document_padding: bool = True,
                  **overrides) -> tuple[float, float, float, dict[str, torch.Tensor]]:
    """CP = 1 (the layout is then the identity): the THD path in this process against each
    document alone (:func:`_per_document_reference`); ``overrides``: TransformerConfig fields
    of both. Returns the loss, the reference loss, the largest gradient difference and the
    reference gradients."""
    ref_loss, params, ref_grads = _per_document_reference("rope", documents, **overrides)
    tokens, cu = documents()
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        spec = rsm.get_gpt_layer_ring_sp_spec(rsm.RingSPConfig(layout="document_zigzag"), normalization="RMSNorm")
        model = _model(spec, 1, 1, params, **overrides)
        shard, packed = rsm.thd_batch_on_this_cp_rank(tokens[None], cu, per_document_padding=per_document_padding)
        losses = model(shard["tokens"], shard["position_ids"], None, labels=shard["labels"], packed_seq_params=packed)
        loss = (losses * shard["loss_mask"]).sum() / shard["loss_mask"].sum()
        loss.backward()
        model.finish_grad_sync()
        grads = _grads(model)
    finally:
        parallel_state.destroy_model_parallel()
    return loss.item(), ref_loss, max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads), ref_grads


def test_packed_thd_at_cp1_equals_per_document(single_rank) -> None:
    """CP = 1: the same THD path, in this process."""
    loss, ref_loss, grad_err, _ = _cp1_thd_case()
    assert math.isclose(loss, ref_loss, rel_tol=1e-6) and grad_err <= 1e-6


def test_document_zigzag_is_transformer_engines_thd_partitioning() -> None:
    """TransformerEngine's thd_get_partitioned_indices (behind Megatron's
    get_thd_batch_on_this_cp_rank; CUDA-only, so restated from its kernel): each padded
    document split into 2 x CP chunks, rank c taking chunks c and 2CP-1-c, in order."""
    cu = (0, 8, 16, 48, 56, 96)
    for cp in (1, 2, 4):
        for rank in range(cp):
            expected = []
            for a, b in zip(cu, cu[1:]):
                half = (b - a) // (2 * cp)
                expected += [*range(a + rank * half, a + (rank + 1) * half),
                             *range(b - (rank + 1) * half, b - rank * half)]
            assert ring_sp.layout_positions("document_zigzag", cp, cu[-1], cu)[rank].tolist() == expected


def test_layout_rope_with_megatrons_thd_rope_restarts_positions_per_document() -> None:
    """LayoutRotaryEmbedding(packed_seq=True) fed to megatron-core's own THD RoPE
    (apply_rotary_pos_emb with cu_seqlens, runs on CPU) gives every CP rank the rotation of
    its document_zigzag tokens at their positions inside their document."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cu = (0, 8, 16, 48, 56, 96)
    x = torch.randn(cu[-1], 2, 16)  # [t, h, d]
    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    for cp in (1, 2, 4):
        for rank in range(cp):
            group = _FakeGroup(rank, cp)
            rope = rsm.LayoutRotaryEmbedding(RotaryEmbedding(16, 1.0, use_cpu_initialization=True, cp_group=group),
                                             layout="document_zigzag", cp_group=group, device="cpu")
            table = rope(56, packed_seq=True)  # the longest document: max_seqlen_q
            local = ring_sp.shard_sequence(x, rank=rank, world_size=cp, layout="document_zigzag", dim=0, cu_seqlens=cu)
            theirs = apply_rotary_pos_emb(local, table, config, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                          cp_group=group)
            positions = ring_sp.document_positions(cu)
            expected = _apply_rotary_pos_emb_bshd(x[:, None], table[positions])[:, 0]
            mine = ring_sp.shard_sequence(expected, rank=rank, world_size=cp, layout="document_zigzag", dim=0,
                                          cu_seqlens=cu)
            assert torch.allclose(theirs, mine, atol=1e-6)


def _thd_params(cu: list[int], padded: list[int] | None = None, **fields) -> PackedSeqParams:
    tensor = lambda c: None if c is None else torch.tensor(c, dtype=torch.int32)  # noqa: E731
    return PackedSeqParams(**{"qkv_format": "thd", "cu_seqlens_q": tensor(cu), "cu_seqlens_kv": tensor(cu),
                              "cu_seqlens_q_padded": tensor(padded), "cu_seqlens_kv_padded": tensor(padded), **fields})


def test_packed_params_map_to_ring_sp_boundaries(single_rank) -> None:
    from ring_sp.integrations.megatron.packed import packed_attention_args

    args = dict(local_len=16, batch=1, sp_group=single_rank, causal=True)
    # padded boundaries win; zero-length documents drop out; one rank: any layout
    params = _thd_params([0, 3, 3, 9, 12], [0, 4, 4, 12, 16])
    assert packed_attention_args(params, layout="contiguous", **args) == ((0, 4, 12, 16), "contiguous")
    # without padding non-causal attention is fine; sbhd (one row) keeps the plain zigzag of its shards
    unpadded = packed_attention_args(_thd_params([0, 5, 16]), layout="contiguous", **{**args, "causal": False})
    assert unpadded == ((0, 5, 16), "contiguous")
    sbhd = _thd_params([0, 16], qkv_format="sbhd")
    assert packed_attention_args(sbhd, layout="document_zigzag", **args) == ((0, 16), "zigzag")


@pytest.mark.parametrize("params,override,message", [
    pytest.param(_thd_params([0, 3, 9, 12], [0, 4, 12, 16]), {"causal": False},
                 r"padding \(packed_seq_params.cu_seqlens_q != cu_seqlens_q_padded\) need causal attention",
                 id="non-causal-with-padding"),
    pytest.param(_thd_params([0, 8, 12]), {}, r"cu_seqlens_q runs from 0 to 12; it must run from 0 to the 16 tokens",
                 id="tokens-after-the-last-document"),
    pytest.param(_thd_params([0, 8, 16], cu_seqlens_kv=torch.tensor([0, 4, 16], dtype=torch.int32)), {},
                 r"cu_seqlens_q and cu_seqlens_kv differ", id="q-kv-differ"),
    pytest.param(_thd_params([0, 5, 9, 12], [0, 4, 12, 16]), {},
                 r"document 0 has 5 real tokens \(cu_seqlens_q\) but only 4", id="real-longer-than-padded"),
    pytest.param(_thd_params([0, 16], qkv_format="sbhd"), {"batch": 2}, r"qkv_format='sbhd' with batch size 2",
                 id="sbhd-batch-2"),
    pytest.param(_thd_params([0, 16], qkv_format="tbhd"), {}, r"qkv_format='tbhd' is not one of", id="format"),
    pytest.param(_thd_params([0, 16], local_cp_size=2), {}, r"local_cp_size=2 differs from the context-parallel size 1",
                 id="dynamic-cp"),
])
def test_packed_params_errors_name_the_field(single_rank, params: PackedSeqParams, override: dict,
                                             message: str) -> None:
    from ring_sp.integrations.megatron.packed import packed_attention_args

    args = {"local_len": 16, "batch": 1, "sp_group": single_rank, "layout": "contiguous", "causal": True, **override}
    with pytest.raises(ValueError, match=message):
        packed_attention_args(params, **args)


# ---------------------------------------------------------------------------- arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for flag, kind, default in (("--num-attention-heads", int, 8), ("--num-query-groups", int, None),
                                ("--context-parallel-size", int, 4), ("--tensor-model-parallel-size", int, 1),
                                ("--attention-dropout", float, 0.0), ("--position-embedding-type", str, "rope")):
        parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--group-query-attention", action="store_true")
    parser.add_argument("--reset-attention-mask", action="store_true")
    return rsm.add_ring_sp_args(parser).parse_args(argv)


def test_switch_is_off_by_default_and_builds_the_config() -> None:
    assert rsm.validate_ring_sp_args(_parse()) is None
    config = rsm.validate_ring_sp_args(_parse("--ring-sp", "--ring-sp-ulysses-size", "2", "--ring-sp-backend", "torch"))
    assert config == rsm.RingSPConfig(ulysses_size=2, layout="zigzag", placement="ulysses_inner", backend="torch")
    assert config.ring_size(4) == 2
    gathered = rsm.validate_ring_sp_args(_parse("--ring-sp", "--ring-sp-kv-exchange", "all_gather"))
    assert gathered.kv_exchange == "all_gather" and config.kv_exchange == "ring"
    assert rsm.validate_ring_sp_args(_parse("--no-ring-sp", "--ring-sp-ulysses-size", "3")) is None


@pytest.mark.parametrize("argv,message", [
    (["--ring-sp-ulysses-size", "0"], r"argument --ring-sp-ulysses-size: 0 must be >= 1"),
    (["--ring-sp-ulysses-size", "two"], r"argument --ring-sp-ulysses-size: 'two' is not an integer"),
    (["--ring-sp-layout", "diagonal"], r"argument --ring-sp-layout: invalid choice: 'diagonal'"),
    (["--ring-sp-placement", "inner"], r"argument --ring-sp-placement: invalid choice: 'inner'"),
    (["--ring-sp-backend", "cuda"], r"argument --ring-sp-backend: invalid choice: 'cuda'"),
    (["--ring-sp-kv-exchange", "gather"], r"argument --ring-sp-kv-exchange: invalid choice: 'gather'"),
])
def test_bad_values_are_refused_by_argparse_naming_the_argument(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit):
        _parse("--ring-sp", *argv)
    assert __import__("re").search(message, capsys.readouterr().err)


@pytest.mark.parametrize("argv,message", [
    (["--ring-sp-ulysses-size", "3"],
     r"--ring-sp-ulysses-size \(ulysses_size\)=3 must divide --context-parallel-size=4.*one of \[1, 2, 4\]"),
    (["--ring-sp-ulysses-size", "4", "--tensor-model-parallel-size", "4"],
     r"--ring-sp-ulysses-size \(ulysses_size\)=4 must divide the attention heads of one tensor-parallel rank "
     r"\(--num-attention-heads=8 / --tensor-model-parallel-size=4 = 2\); choose one of \[1, 2\]"),
    (["--ring-sp-ulysses-size", "4", "--group-query-attention", "--num-query-groups", "6",
      "--num-attention-heads", "12", "--context-parallel-size", "8"],
     r"--ring-sp-ulysses-size \(ulysses_size\)=4 and the key/value heads of one tensor-parallel rank \(6"),
    (["--ring-sp-ulysses-size", "2", "--ring-sp-layout", "striped"],
     r"--ring-sp-layout \(layout\)='striped' cannot be combined with a 2 x 2 ulysses x ring grid"),
    (["--ring-sp-ulysses-size", "2", "--ring-sp-placement", "ring_inner"],
     r"--ring-sp-placement \(placement\)='ring_inner' is not supported with a 2 x 2 ulysses x ring grid"),
    (["--attention-dropout", "0.1"], r"--attention-dropout=0.1 is not supported with --ring-sp.*--attention-dropout 0"),
    (["--reset-attention-mask"], r"--reset-attention-mask is not supported with --ring-sp"),
    (["--ring-sp-layout", "contiguous"],
     r"--ring-sp-layout=contiguous does not match --position-embedding-type=rope"),
])
def test_bad_combinations_name_the_arguments(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rsm.validate_ring_sp_args(_parse("--ring-sp", *argv))


def test_document_zigzag_is_accepted_with_megatrons_rope() -> None:
    """Megatron's RoPE slices THD batches per document: document_zigzag needs no layout RoPE."""
    config = rsm.validate_ring_sp_args(_parse("--ring-sp", "--ring-sp-ulysses-size", "2", "--ring-sp-layout",
                                              "document_zigzag"))
    assert config.layout == "document_zigzag" and rsm.unpacked_layout(config.layout) == "zigzag"


def test_layout_is_free_when_rope_follows_it_and_ring_inner_fits_a_pure_ring() -> None:
    args = _parse("--ring-sp", "--ring-sp-layout", "striped", "--ring-sp-placement", "ring_inner")
    assert rsm.validate_ring_sp_args(args, rope_follows_layout=True).layout == "striped"


# ---------------------------------------------------------------------------- spec import paths


def test_spec_importable_by_name_for_megatron_core() -> None:
    from megatron.core.transformer.spec_utils import import_module

    factory = import_module(("ring_sp.integrations.megatron", "get_gpt_layer_ring_sp_spec"))
    spec = factory(rsm.RingSPConfig(ulysses_size=2), qk_layernorm=True)
    attention = spec.submodules.self_attention.submodules
    assert attention.core_attention.module is rsm.RingSPCoreAttention
    assert attention.core_attention.params == {"ring_sp_config": rsm.RingSPConfig(ulysses_size=2)}
    assert attention.q_layernorm is not None and spec.submodules.mlp is not None  # the rest is Megatron's local spec


def test_megatron_lm_spec_flag_resolves_to_a_module_spec(monkeypatch) -> None:
    """Megatron-LM's ``--spec M NAME`` uses ``vars(M)[NAME]`` itself as the layer spec."""
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    args = _parse("--ring-sp", "--ring-sp-ulysses-size", "2")
    args.normalization = "RMSNorm"
    training = types.ModuleType("megatron.training")
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_args = lambda: args
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    try:
        spec = import_module(("ring_sp.integrations.megatron", "gpt_layer_ring_sp_spec"))
        assert isinstance(spec, ModuleSpec)
        core = spec.submodules.self_attention.submodules.core_attention
        assert core.module is rsm.RingSPCoreAttention and core.params["ring_sp_config"].ulysses_size == 2
        vars(rsm).pop("gpt_layer_ring_sp_spec")
        args.ring_sp = False  # --no-ring-sp: Megatron's own local spec
        spec = import_module(("ring_sp.integrations.megatron", "gpt_layer_ring_sp_spec"))
        assert spec.submodules.self_attention.submodules.core_attention.__name__ == "DotProductAttention"
    finally:
        vars(rsm).pop("gpt_layer_ring_sp_spec", None)


def test_package_import_has_no_megatron_side_effects() -> None:
    code = ("import sys, ring_sp.integrations.megatron as m; m.add_ring_sp_args; "
            "assert not [k for k in sys.modules if k.startswith('megatron')], 'megatron imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---------------------------------------------------------------------------- the example


def _example(nproc: int, *extra: str) -> list[dict]:
    # PYTHON: this interpreter (CI runs the suite from a venv it never activates)
    env = {**os.environ, "NUM_RANKS": str(nproc), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", "examples/megatron/pretrain_gpt.sh", "--cpu", "--log-json", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "128",
         "--micro-batch-size", "2", "--lr-warmup-iters", "0", "--corpus-bytes", "300000", *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines()]  # nothing but JSON on stdout


@pytest.mark.slow  # two 4-rank launches of the script (the default suite launches one example: test_deepspeed.py)
@pytest.mark.parametrize("packed", [pytest.param(True, id="packed"), pytest.param(False, id="unpacked")])
def test_example_trains_and_resumes_at_another_cp_size(tmp_path: Path, packed: bool) -> None:
    """4 CPU ranks at CP = 4 (U2 x R2) for 6 steps, saving at 3; then 1 rank at CP = 1
    resumed from step 3 reproduces steps 4-6 (the same samples: DP = 1 in both). Packed
    (one THD row per micro-batch), steps 4-6 also show CP = 4 equal to CP = 1 on documents
    (what test_example_trains_on_packed_documents checks from step 1, under -m slow)."""
    ckpt = tmp_path / "ckpt"
    layout = ("--pack-documents", "--ring-sp-layout", "document_zigzag") if packed else ()
    first = _example(4, *layout, "--train-iters", "6", "--save", str(ckpt), "--save-interval", "3")
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in first) and first[-1]["loss"] < first[0]["loss"]
    resumed = _example(1, *layout, "--train-iters", "6", "--ring-sp-ulysses-size", "1", "--load", str(ckpt),
                       "--ckpt-step", "3")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(first[3:], resumed):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (first, resumed)


@pytest.mark.slow
def test_example_trains_on_packed_documents() -> None:
    """--pack-documents (one THD row per micro-batch, documents unpadded, RoPE by position
    inside each document; --ring-sp-layout then defaults to document_zigzag): CP = 4
    (U2 x R2) on 4 ranks gives the losses of CP = 1 on one rank, with no padding token."""
    packed = ("--train-iters", "2", "--pack-documents")
    cp4 = _example(4, *packed)
    cp1 = _example(1, *packed, "--ring-sp-ulysses-size", "1")
    assert [r["step"] for r in cp4] == [r["step"] for r in cp1] == [1, 2]
    assert all(r["padding"] == 0 for r in cp4 + cp1), (cp4, cp1)
    for a, b in zip(cp4, cp1):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (cp4, cp1)


# ------------------------------------------------------------- unpadded THD documents (issue 14)


def unpadded_thd_case(ulysses: int, position_embedding_type: str = "learned_absolute",
                      primes: bool = False, layout: str = "document_zigzag") -> dict[str, object]:
    """CP = 4 on THD documents of any length (``per_document_padding=False``: at most the
    row's end padded) against every document run alone at CP = 1: :func:`_documents`, or
    :func:`_prime_documents` with ``primes``. With ``position_embedding_type="rope"`` the
    ring_sp layers rotate each token by its position inside its document; the same batch
    through megatron-core's THD RoPE (the rotary not handed to the core attention) is then
    refused."""
    documents = _prime_documents if primes else _documents
    ref_loss, params, ref_grads = _per_document_reference(position_embedding_type, documents)
    tokens, cu = documents()
    parallel_state.initialize_model_parallel(context_parallel_size=4, create_gloo_process_groups=False)
    try:
        shard, packed = rsm.thd_batch_on_this_cp_rank(tokens[None], cu, per_document_padding=False, layout=layout)
        spec = rsm.get_gpt_layer_ring_sp_spec(rsm.RingSPConfig(ulysses_size=ulysses, layout=layout),
                                              normalization="RMSNorm")
        model = _model(spec, 1, 4, params, position_embedding_type=position_embedding_type)
        losses = model(shard["tokens"], shard["position_ids"], None, labels=shard["labels"], packed_seq_params=packed)
        loss = sequence_parallel_loss((losses * shard["loss_mask"]).sum(), shard["loss_mask"].sum(),
                                      group=parallel_state.get_context_parallel_group(), gradients_averaged_over_sp=True)
        loss.backward()
        model.finish_grad_sync()
        grads = _grads(model)
        result = {"loss": loss.item(), "ref_loss": ref_loss, "tokens": 4 * shard["tokens"].shape[1],
                  "padded": packed.cu_seqlens_q_padded is not None,
                  "grad_err": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
                  "ref_grad_max": max(g.abs().max().item() for g in ref_grads.values())}
        if position_embedding_type == "rope":
            rotary = model.module.rotary_pos_emb
            result["handed"] = all(layer.self_attention.core_attention.document_rope is rotary
                                   for layer in model.module.decoder.layers)
            rotary.rotates_documents = False  # megatron-core's THD RoPE: needs documents of multiples of 2 x CP
            with pytest.raises(ValueError) as refused:
                model(shard["tokens"], shard["position_ids"], None, labels=shard["labels"], packed_seq_params=packed)
            result["refused"] = str(refused.value)
        return result
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ulysses,layout", [pytest.param(2, "document_zigzag", id="cp4-u2xr2"),
                                            pytest.param(1, "document_zigzag", id="cp4-u1xr4"),
                                            pytest.param(2, "document_balanced", id="cp4-u2xr2-balanced"),
                                            pytest.param(1, "auto", id="cp4-u1xr4-auto")])
def test_unpadded_thd_documents_equal_per_document_cp1(pools, ulysses: int, layout: str) -> None:
    """Issue 14 (and 44: Megatron's THD batches placed by document_balanced, or per batch by auto)."""
    for r in pools.get(4).run(unpadded_thd_case, ulysses, layout=layout, timeout=240):
        assert r["tokens"] == 60  # 60 real tokens, no document padded (60 is a multiple of CP = 4)
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6), r
        assert r["ref_grad_max"] > 1e-3 and r["grad_err"] <= 1e-6, r


# ------------------------------------------------- unpadded THD documents with RoPE (issue 22)


def _rope_by_formula(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Plain RoPE written out: ``x`` ``[t, h, d]`` rotated at ``positions`` ``[t]`` (halves layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(positions.float(), inv_freq)  # [t, d / 2]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def test_document_angles_are_positions_inside_each_document_where_megatrons_thd_split_fails() -> None:
    """LayoutRotaryEmbedding.document_angles rotates every token of a document_zigzag shard of
    prime-length documents at its position inside its document (RoPE written out on each
    whole document, then sharded). Negative control: megatron-core's THD RoPE
    (``_apply_rotary_pos_emb_thd``, its halves of ``len // CP``) refuses the same shard."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    tokens, cu = _prime_documents()
    x = torch.randn(cu[-1], 2, 16, generator=torch.Generator().manual_seed(3))  # [t, h, d]
    expected_full = torch.cat([_rope_by_formula(x[a:b], torch.arange(b - a)) for a, b in zip(cu, cu[1:])])
    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    for cp in (1, 2, 4):
        layout = "document_zigzag" if cp > 1 else "contiguous"  # the core attention's layout at CP = 1
        for rank in range(cp):
            group = _FakeGroup(rank, cp)
            rope = rsm.LayoutRotaryEmbedding(RotaryEmbedding(16, 1.0, use_cpu_initialization=True, cp_group=group),
                                             layout="document_zigzag", cp_group=group, device="cpu")
            local = ring_sp.shard_sequence(x, rank=rank, world_size=cp, layout=layout, dim=0, cu_seqlens=cu)
            angles = rope.document_angles(cu, layout, cp, rank)
            assert angles.shape == (cu[-1] // cp, 1, 1, 16)
            mine = _apply_rotary_pos_emb_bshd(local[:, None], angles)[:, 0]
            expected = ring_sp.shard_sequence(expected_full, rank=rank, world_size=cp, layout=layout, dim=0,
                                              cu_seqlens=cu)
            assert torch.allclose(mine, expected, atol=1e-5)
            if cp > 1:
                with pytest.raises(RuntimeError):  # split sizes (len // CP per document) do not add up
                    apply_rotary_pos_emb(local, rope(max(PRIME_LENGTHS), packed_seq=True), config,
                                         cu_seqlens=torch.tensor(cu, dtype=torch.int32), cp_group=group)


@pytest.mark.parametrize("ulysses,layout", [pytest.param(2, "document_zigzag", id="cp4-u2xr2"),
                                            pytest.param(1, "document_zigzag", id="cp4-u1xr4"),
                                            pytest.param(2, "document_balanced", id="cp4-u2xr2-balanced")])
def test_unpadded_rope_documents_equal_per_document_cp1(pools, ulysses: int, layout: str) -> None:
    for r in pools.get(4).run(unpadded_thd_case, ulysses, "rope", True, layout, timeout=240):
        assert r["tokens"] == sum(PRIME_LENGTHS) and not r["padded"] and r["handed"], r  # no padding anywhere
        assert math.isclose(r["loss"], r["ref_loss"], rel_tol=1e-6), r
        assert r["ref_grad_max"] > 1e-3 and r["grad_err"] <= 1e-6, r
        assert "document 0 has 13 tokens, not a multiple of 2 x context-parallel size = 8" in r["refused"], r


def test_ring_sp_rope_skips_megatrons_no_rope_layers_at_cp1(single_rank) -> None:
    """``no_rope_freq=[0, 1]`` (layer 2 without RoPE, as Megatron's SelfAttention skips it):
    the THD path, where the ring_sp layers rotate, equals each document alone through
    megatron-core's own RoPE with the same setting, whose gradients differ from RoPE on every
    layer's by 5e-4."""
    loss, ref_loss, grad_err, ref_grads = _cp1_thd_case(_prime_documents, False, no_rope_freq=[0, 1])
    assert math.isclose(loss, ref_loss, rel_tol=1e-6) and grad_err <= 1e-6
    every_layer = _per_document_reference("rope", _prime_documents)[2]  # RoPE on both layers
    assert max((every_layer[n] - ref_grads[n]).abs().max().item() for n in ref_grads) > 1e-4  # >> the 1e-6 above


def test_install_layout_rope_refuses_what_it_cannot_rotate(single_rank) -> None:
    """Errors naming the option: a model mixing ring_sp and other core attentions (ring_sp's
    layers rotate THD tokens themselves), apply_rope_fusion on CPU, and the rotary classes
    of position_embedding_type 'mrope' and 'yarn'."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
    try:
        ring = rsm.get_gpt_layer_ring_sp_spec(rsm.RingSPConfig(layout="document_zigzag"), normalization="RMSNorm")
        mixed = TransformerBlockSubmodules(layer_specs=[ring, replace_core(PlainCoreAttention)])
        model = GPTModel(_config(1, 1), mixed, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope", share_embeddings_and_output_weights=False)
        with pytest.raises(ValueError, match=r"1 of the model's 2 attention layers use RingSPCoreAttention"):
            rsm.install_layout_rope(model)
        model.config.apply_rope_fusion = True
        with pytest.raises(ValueError, match=r"apply_rope_fusion=True .*cannot run on CPU; set apply_rope_fusion=False"):
            rsm.install_layout_rope(model)
    finally:
        parallel_state.destroy_model_parallel()
    for rotary, kind in ((MultimodalRotaryEmbedding, "mrope"), (YarnRotaryEmbedding, "yarn")):
        with pytest.raises(TypeError, match=rf"position_embedding_type='{kind}' \({rotary.__name__}\) is not supported"):
            rsm.LayoutRotaryEmbedding(rotary.__new__(rotary), layout="document_zigzag", cp_group=None, device="cpu")
