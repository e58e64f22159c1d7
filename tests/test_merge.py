"""C1: the online-softmax merge, single process."""

from __future__ import annotations

import math

import pytest
import torch

from ring_sp.merge import merge_block_, merge_partials

NEG_INF = -math.inf


def _block_attention(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of scores ``s`` [b, h, q, k] over values v [b, k, h, d]: (out [b, q, h, d], lse [b, h, q])."""
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0).unsqueeze(-1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _merge_all(blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros_like(blocks[0][0], dtype=torch.float64)
    lse = torch.full_like(blocks[0][1], NEG_INF, dtype=torch.float64)
    for out_b, lse_b in blocks:
        merge_block_(out, lse, out_b, lse_b)
    return out, lse


@pytest.mark.parametrize("num_blocks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("seed", range(4))
def test_random_key_splits_equal_full_attention(num_blocks: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, 3, 5, 40, generator=g, dtype=torch.float64) * 3
    v = torch.randn(2, 40, 3, 4, generator=g, dtype=torch.float64)
    cuts = sorted(torch.randperm(39, generator=g)[: num_blocks - 1].add(1).tolist())
    edges = [0, *cuts, 40]
    blocks = [_block_attention(s[..., a:b], v[:, a:b]) for a, b in zip(edges, edges[1:])]
    out, lse = _merge_all(blocks)
    full_out, full_lse = _block_attention(s, v)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, full_out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("num_blocks", [1, 3, 8])
def test_merging_all_partials_at_once_equals_full_attention(num_blocks: int) -> None:
    """merge_partials (decode's n-way merge) on key splits, a row no block sees and a block that sees nothing."""
    g = torch.Generator().manual_seed(num_blocks)
    s = torch.randn(2, 3, 5, 40, generator=g, dtype=torch.float64) * 3
    s[:, :, 4] = NEG_INF  # query row 4 sees no key at all
    s[..., :8] = NEG_INF  # the first block sees nothing
    v = torch.randn(2, 40, 3, 4, generator=g, dtype=torch.float64)
    edges = [0, *(8 + 32 * i // num_blocks for i in range(num_blocks)), 40]  # [0, 8) and num_blocks more
    blocks = [_block_attention(s[..., a:b], v[:, a:b]) for a, b in zip(edges, edges[1:])]
    out, lse = merge_partials(torch.stack([b[0] for b in blocks]), torch.stack([b[1] for b in blocks]))
    full_out, full_lse = _block_attention(s, v)
    assert not torch.isnan(out).any() and torch.isneginf(lse[:, :, 4]).all() and (out[:, 4] == 0).all()
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, full_out, atol=1e-12, rtol=0)
    sequential = _merge_all(blocks)
    torch.testing.assert_close(out, sequential[0], atol=1e-13, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_four_infinity_cases(dtype: torch.dtype) -> None:
    """Rows: (finite, finite), (finite, -inf), (-inf, finite), (-inf, -inf)."""
    lse_acc = torch.tensor([[[1.0, 2.0, NEG_INF, NEG_INF]]], dtype=dtype)  # [b=1, h=1, s=4]
    lse_blk = torch.tensor([[[0.5, NEG_INF, 3.0, NEG_INF]]], dtype=dtype)
    out_acc = torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=dtype).view(1, 4, 1, 1)
    out_blk = torch.tensor([5.0, 7.0, 9.0, 0.0], dtype=dtype).view(1, 4, 1, 1)
    merge_block_(out_acc, lse_acc, out_blk, lse_blk)
    assert not torch.isnan(out_acc).any() and not torch.isnan(lse_acc).any()
    w = 1 / (1 + math.exp(0.5 - 1.0))  # weight of the running row 0
    expected = torch.tensor([1.0 * w + 5.0 * (1 - w), 2.0, 9.0, 0.0], dtype=dtype).view(1, 4, 1, 1)
    torch.testing.assert_close(out_acc, expected)
    torch.testing.assert_close(lse_acc[0, 0, :3], torch.tensor([math.log(math.exp(1) + math.exp(0.5)), 2.0, 3.0], dtype=dtype))
    assert lse_acc[0, 0, 3].item() == NEG_INF  # a row that saw nothing keeps -inf and out 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gap", [89.0, 200.0, 1e4])
def test_no_overflow_beyond_fp32_exp_range(dtype: torch.dtype, gap: float) -> None:
    """lse differences past ~88 overflow exp() in fp32; the merge must not."""
    for lse_a, lse_b in ((0.0, gap), (gap, 0.0), (-gap, gap)):
        out = torch.full((1, 1, 1, 2), 3.0, dtype=dtype)
        lse = torch.tensor([[[lse_a]]], dtype=dtype)
        merge_block_(out, lse, torch.full((1, 1, 1, 2), -1.0, dtype=dtype), torch.tensor([[[lse_b]]], dtype=dtype))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        winner = 3.0 if lse_a > lse_b else -1.0
        torch.testing.assert_close(out, torch.full_like(out, winner))
        torch.testing.assert_close(lse, torch.tensor([[[max(lse_a, lse_b)]]], dtype=dtype))


def test_views_of_the_accumulators_are_updated_in_place() -> None:
    out = torch.zeros(1, 4, 1, 2, dtype=torch.float64)
    lse = torch.full((1, 1, 4), NEG_INF, dtype=torch.float64)
    merge_block_(out[:, 2:], lse[:, :, 2:], torch.ones(1, 2, 1, 2), torch.zeros(1, 1, 2))
    assert out[:, :2].eq(0).all() and out[:, 2:].eq(1).all()
    assert torch.isneginf(lse[0, 0, :2]).all() and lse[0, 0, 2:].eq(0).all()
