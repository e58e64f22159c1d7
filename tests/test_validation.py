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
    (dict(layout="zig-zag"), ValueError, r"layout='zig-zag' is not one of \('contiguous', 'zigzag', 'striped', 'document_zigzag', 'document_balanced', 'auto'\)"),
    (dict(backend="xformers"), ValueError, r"backend='xformers' is not one of"),
    (dict(backend="cudnn"), RuntimeError, r"backend='cudnn' is unavailable: backend='cudnn' needs CUDA tensors"),
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


# ---- issue 31: validation on by default, errors carried to the next agreement, shard checks --------

@pytest.mark.parametrize("env,validate,want", [(None, None, True), ("1", None, True), ("0", None, False),
                                               ("false", None, False), (" OFF ", None, False), ("0", True, True),
                                               (None, False, False)])
def test_validation_is_on_by_default(monkeypatch, env: str | None, validate: bool | None, want: bool) -> None:
    from ring_sp.agreement import ENV_FLAG, validation_requested

    if env is None:
        monkeypatch.delenv(ENV_FLAG, raising=False)
    else:
        monkeypatch.setenv(ENV_FLAG, env)
    assert validation_requested(validate) is want


def test_every_signature_has_one_width() -> None:
    """Every agreement on a group exchanges one size, so calls out of step pair up and say so."""
    from ring_sp.agreement import WIDTH, CallSignature

    q, k, v = _qkv()
    attention = CallSignature.of(q, k, v, causal=True, layout="zigzag", softmax_scale=None, backend="auto",
                                 ulysses_size=2, ring_size=2, cu_seqlens=(0, 5, 16), sinks=torch.zeros(4),
                                 sliding_window=3, kv_exchange="ring")
    loss = CallSignature.named("loss", (1, 2, 3), "a loss")
    assert len(attention.values) == len(loss.values) == WIDTH and attention.values[0] != loss.values[0]


def test_an_error_kept_for_the_next_agreement_raises_here_without_one() -> None:
    """A group of one rank has no agreement: the kept error is raised when the block ends."""
    from ring_sp.agreement import defer, raise_at_next_agreement

    assert not defer(ValueError("outside any block"))
    with pytest.raises(ValueError, match="first"):
        with raise_at_next_agreement():
            assert defer(ValueError("first")) and defer(ValueError("second"))
    with pytest.raises(KeyError):  # an exception of the block itself wins
        with raise_at_next_agreement(ValueError("kept")):
            raise KeyError("body")
    with raise_at_next_agreement(None):
        pass


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "document_zigzag"])
def test_shard_positions_error_finds_cu_seqlens_that_do_not_fit(layout: str) -> None:
    """The DeepSpeed GPT example's check of its cu_seqlens (tests/test_malformed runs it on 4 ranks)."""
    from ring_sp.data import shard_positions_error

    docs = (0, 5, 16, 19, 32)
    wrong_docs = [(0, 5, 17, 19, 32), (0, 8, 24, 32)] + ([] if layout == "document_zigzag" else [None])
    found: dict[object, list] = {cu: [] for cu in wrong_docs}
    for rank in range(4):
        shard = ring_sp.shard_batch({"input_ids": torch.zeros(2, 32, dtype=torch.long)}, rank=rank, world_size=4,
                                    layout=layout, cu_seqlens=docs)
        positions = shard["position_ids"]
        assert shard_positions_error(positions, layout=layout, rank=rank, world_size=4, cu_seqlens=docs) is None
        other_rank = shard_positions_error(positions, layout=layout, rank=(rank + 1) % 4, world_size=4, cu_seqlens=docs)
        assert "position_ids are not the global positions" in str(other_rank)
        for cu in wrong_docs:
            found[cu].append(shard_positions_error(positions, layout=layout, rank=rank, world_size=4, cu_seqlens=cu))
    for cu, errors in found.items():  # the ranks holding the tokens they move see it (the agreement tells the rest)
        assert any("position_ids are not the global positions" in str(e) for e in errors if e is not None), (cu, errors)


def test_token_checksum_sees_order_and_zeros() -> None:
    from ring_sp.data import token_checksum

    ids = torch.tensor([[0, 1, 2, 3]])
    sums = {token_checksum(t).item() for t in (ids, ids.flip(-1), torch.zeros_like(ids), torch.zeros(1, 5, dtype=torch.long))}
    assert len(sums) == 4 and token_checksum(ids).item() == token_checksum(ids.clone().int()).item()
