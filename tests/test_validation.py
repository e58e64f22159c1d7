"""Bad arguments raise TypeError/ValueError naming the argument, its value and the fix,
before any collective (these run in one process: a collective would need peers)."""

from __future__ import annotations

import pytest
import torch

import ring_sp
from dist_cases import topology

GOOD = dict(q=(2, 8, 4, 16), k=(2, 8, 2, 16))


def _qkv(q_shape=GOOD["q"], k_shape=GOOD["k"], dtype=torch.float32):
    return torch.randn(q_shape, dtype=dtype), torch.randn(k_shape, dtype=dtype), torch.randn(k_shape, dtype=dtype)


CASES = [
    (dict(q="not a tensor"), TypeError, r"q must be a torch.Tensor \[batch, seq_local, heads, head_dim\]; got str"),
    (dict(q=torch.randn(8, 4, 16)), ValueError, r"q must be 4-D .*got shape \(8, 4, 16\).*Megatron"),
    (dict(q=torch.randn(2, 8, 4, 16, dtype=torch.float64)), TypeError, r"q, k, v must share one dtype; got q torch.float64, k torch.float32"),
    (dict(q=torch.ones(2, 8, 4, 16, dtype=torch.int64)), TypeError, r"q.dtype=torch.int64 is not supported"),
    (dict(q=torch.randn(2, 8, 4, 16, device="meta")), ValueError, r"q, k, v must be on one device; got q meta, k cpu"),
    (dict(v=torch.randn(2, 8, 1, 16)), ValueError, r"k and v must agree on \[batch, seq_local, kv_heads\].*got k \(2, 8, 2, 16\), v \(2, 8, 1, 16\)"),
    (dict(q=torch.randn(3, 8, 4, 16)), ValueError, r"same batch size; got q.shape\[0\]=3, k.shape\[0\]=2"),
    (dict(q=torch.randn(2, 6, 4, 16)), ValueError, r"same local sequence length.*q.shape\[1\]=6, k.shape\[1\]=8"),
    (dict(q=torch.randn(2, 8, 4, 32)), ValueError, r"same head_dim; got q.shape\[3\]=32, k.shape\[3\]=16"),
    (dict(q=torch.randn(2, 8, 3, 16)), ValueError, r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
    (dict(q=torch.randn(2, 0, 4, 16)), ValueError, r"q has an empty dimension: shape \(2, 0, 4, 16\)"),
    (dict(causal=1), TypeError, r"causal must be a bool; got int 1"),
    (dict(layout="zig-zag"), ValueError, r"layout='zig-zag' is not one of \('contiguous', 'zigzag', 'striped', 'document_zigzag'\)"),
    (dict(backend="cudnn"), ValueError, r"backend='cudnn' is not one of"),
    (dict(softmax_scale=-1.0), ValueError, r"softmax_scale=-1.0 must be finite and > 0"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale=nan must be finite and > 0"),
    (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a float or None; got str"),
    (dict(backend="flash_attn"), RuntimeError, r"backend='flash_attn' is unavailable: .*CUDA"),
]


@pytest.mark.parametrize("override,error,match", CASES, ids=[c[2][:40] for c in CASES])
def test_ring_attention_rejects(single_rank, override, error, match) -> None:
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v, **override}
    tensors = {name: args.pop(name) for name in ("q", "k", "v")}
    with pytest.raises(error, match=match):
        ring_sp.ring_attention(tensors["q"], tensors["k"], tensors["v"], **args)


def test_zigzag_on_one_rank_is_the_identity_and_needs_no_even_length(single_rank) -> None:
    """(On more ranks an odd local length is refused: test_robustness' bad-argument cases.)"""
    q, k, v = _qkv((1, 5, 2, 8), (1, 5, 2, 8))
    zigzag = ring_sp.ring_attention(q, k, v, layout="zigzag", causal=True)
    assert torch.equal(zigzag, ring_sp.ring_attention(q, k, v, layout="contiguous", causal=True))


def test_module_and_topology_arguments_are_checked(single_rank) -> None:
    with pytest.raises(TypeError, match=r"topology must be a SequenceParallelTopology"):
        ring_sp.SequenceParallelAttention("world")
    with pytest.raises(TypeError, match=r"topology must be a SequenceParallelTopology from ring_sp.init_sequence_parallel"):
        ring_sp.hybrid_attention(*_qkv(), topology=None)
    topo = ring_sp.init_sequence_parallel(1, 1)
    with pytest.raises(ValueError, match=r"layout='ring' is not one of"):
        ring_sp.SequenceParallelAttention(topo, layout="ring")
    with pytest.raises(ValueError, match=r"not divisible by ulysses_size x ring_size = 2 x 1 = 2"):
        ring_sp.init_sequence_parallel(2, 1)


def test_group_must_be_a_process_group(single_rank) -> None:
    with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup or None; got list"):
        ring_sp.ring_attention(*_qkv(), group=[0, 1])


def ulysses_errors() -> list[str]:
    """Errors that need a real Ulysses group (raised before its first all-to-all)."""
    messages = []
    topo = topology(2, 2)
    for q_heads, kv_heads, layout in ((3, 3, "zigzag"), (6, 3, "zigzag"), (4, 2, "striped")):
        q, k, v = _qkv((1, 4, q_heads, 8), (1, 4, kv_heads, 8))
        try:
            ring_sp.hybrid_attention(q, k, v, topology=topo, causal=True, layout=layout)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_ulysses_head_and_layout_errors(pools) -> None:
    for messages in pools.get(4).run(ulysses_errors):
        assert len(messages) == 3
        assert "q heads (3) must be divisible by ulysses_size (2)" in messages[0]
        assert "k/v heads (3) and ulysses_size (2) must divide one another" in messages[1]
        assert "layout='striped' cannot be combined with ulysses_size=2 and ring_size=2" in messages[2]
