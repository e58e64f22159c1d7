"""C15: batch sharding and the token-weighted SP loss reproduce single-device training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ring_sp
from oracle import oracle_attention
from ring_sp.layouts import layout_positions

VOCAB, DIM, HEADS, KV_HEADS = 11, 8, 4, 2


def test_labels_are_shifted_before_sharding() -> None:
    ids = torch.arange(100, 116).view(1, 16)
    shards = [ring_sp.shard_batch({"input_ids": ids}, rank=r, world_size=4, layout="zigzag") for r in range(4)]
    targets = {}
    for shard in shards:
        for pos, label in zip(shard["position_ids"][0].tolist(), shard["labels"][0].tolist()):
            targets[pos] = label
    assert [targets[t] for t in range(15)] == list(range(101, 116))  # no boundary target lost
    assert targets[15] == -100
    assert shards[1]["position_ids"][0].tolist() == layout_positions("zigzag", 4, 16)[1].tolist()


def test_shard_batch_keeps_pre_shifted_labels_and_other_keys() -> None:
    batch = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(10, 18).view(1, 8),
             "loss_mask": torch.ones(1, 8)}
    shard = ring_sp.shard_batch(batch, rank=1, world_size=2, layout="contiguous", shift=False)
    assert shard["labels"].tolist() == [[14, 15, 16, 17]] and shard["loss_mask"].shape == (1, 4)
    # issue 14: any length is padded at its end (zigzag over 2 ranks: to a multiple of 4)
    padded = ring_sp.shard_batch({"input_ids": torch.ones(1, 6, dtype=torch.long)}, rank=0, world_size=2, layout="zigzag")
    assert padded["input_ids"].shape == (1, 4) and padded["cu_seqlens"].tolist() == [0, 6, 8]


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"emb": (VOCAB, DIM), "wq": (DIM, HEADS * 4), "wk": (DIM, KV_HEADS * 4), "wv": (DIM, KV_HEADS * 4),
              "wo": (HEADS * 4, DIM), "head": (DIM, VOCAB)}
    return {n: torch.randn(s, generator=g, dtype=torch.float64).mul_(0.5).requires_grad_() for n, s in shapes.items()}


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding from explicit positions [b, n]: correct only if positions are global."""
    half = x.shape[-1] // 2
    freq = positions[..., None].double() / (10.0 ** (torch.arange(half, dtype=torch.float64) / half))
    cos, sin = freq.cos()[:, :, None], freq.sin()[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def _forward(params: dict[str, torch.Tensor], ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
    x = params["emb"][ids]
    b, n, _ = x.shape
    q = _rope((x @ params["wq"]).view(b, n, HEADS, 4), positions)
    k = _rope((x @ params["wk"]).view(b, n, KV_HEADS, 4), positions)
    v = (x @ params["wv"]).view(b, n, KV_HEADS, 4)
    return (x + attention(q, k, v).reshape(b, n, -1) @ params["wo"]) @ params["head"]


def _batch(seq_len: int, layout: str, sp_size: int) -> dict[str, torch.Tensor]:
    """Unequal valid-token counts per rank, and SP rank 0 with none at all."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, seq_len), generator=g)
    labels = ids.clone()
    rank0 = layout_positions(layout, sp_size, seq_len)[0]
    labels[:, (rank0 + 1).clamp(max=seq_len - 1)] = -100  # shifted: position t's target is labels[t + 1]
    labels[1, torch.randperm(seq_len, generator=g)[: seq_len // 3]] = -100
    return {"input_ids": ids, "labels": labels}


def sp_training_step(u: int, r: int, layout: str, averaged: bool) -> dict[str, object]:
    """One loss + backward on a 2-layer toy model, SP over U x R vs one device."""
    topo = ring_sp.init_sequence_parallel(u, r)
    batch = _batch(8 * topo.sp_size, layout, topo.sp_size)
    params = _model(0)
    shard = topo.shard_batch(batch, layout=layout)
    attention = lambda q, k, v: ring_sp.hybrid_attention(q, k, v, topology=topo, causal=True, layout=layout)  # noqa: E731
    logits = _forward(params, shard["input_ids"], shard["position_ids"], attention)
    loss = ring_sp.sequence_parallel_cross_entropy(logits, shard["labels"], group=topo.sp_group,
                                                   gradients_averaged_over_sp=averaged)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in params.values()])
    dist.all_reduce(grads, group=topo.sp_group)  # SUM over SP ...
    if averaged:
        grads /= topo.sp_size  # ... or the DP x SP average DeepSpeed and Megatron do
    valid_here = int((shard["labels"] != -100).sum())

    reference = _model(0)
    full = {**batch, "labels": ring_sp.shift_labels(batch["labels"]),
            "position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])}
    oracle = lambda q, k, v: oracle_attention(q, k, v, causal=True)[0]  # noqa: E731
    ref_logits = _forward(reference, full["input_ids"], full["position_ids"], oracle)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), full["labels"].flatten(), ignore_index=-100)
    ref_loss.backward()
    ref_grads = torch.cat([p.grad.flatten() for p in reference.values()])
    return {"loss": (loss.item(), ref_loss.item()), "grad_err": (grads - ref_grads).abs().max().item(),
            "valid_here": valid_here, "finite": bool(torch.isfinite(grads).all())}


@pytest.mark.parametrize("u,r,layout", [(1, 4, "zigzag"), (2, 2, "zigzag"), (4, 1, "striped"), (2, 2, "contiguous")])
@pytest.mark.parametrize("averaged", [True, False])
def test_sp_loss_and_gradients_equal_single_device(pools, u: int, r: int, layout: str, averaged: bool) -> None:
    results = pools.get(4).run(sp_training_step, u, r, layout, averaged)
    assert any(res["valid_here"] == 0 for res in results), "the batch must leave some rank without valid tokens"
    for res in results:
        loss, ref_loss = res["loss"]
        assert abs(loss - ref_loss) <= 1e-10 and res["finite"]
        assert res["grad_err"] <= 1e-10, res
