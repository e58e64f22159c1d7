"""C2: layout algebra, single process (hypothesis over N, P, U x R, layouts)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ring_sp.layouts import layout_positions, ulysses_to_ring_order
from ring_sp.sequence_shards import shard_sequence, unshard_sequence

PLAIN = ("contiguous", "zigzag", "striped")  # the layouts that need no documents


def _expected_positions(layout: str, p: int, n: int, rank: int) -> list[int]:
    """DESIGN.md section 3, written out token by token (independent of layouts.py)."""
    local = n // p
    if layout == "contiguous":
        return list(range(rank * local, (rank + 1) * local))
    if layout == "zigzag":
        c = n // (2 * p)
        return list(range(rank * c, (rank + 1) * c)) + list(range((2 * p - 1 - rank) * c, (2 * p - rank) * c))
    return [t for t in range(n) if t % p == rank]


world_and_length = st.integers(1, 8).flatmap(lambda p: st.tuples(st.just(p), st.integers(1, 512 // (2 * p)).map(lambda m: 2 * p * m)))


@settings(max_examples=150, deadline=None)
@given(world_and_length, st.sampled_from(PLAIN))
def test_positions_match_the_definition_and_form_a_permutation(pn: tuple[int, int], layout: str) -> None:
    p, n = pn
    positions = layout_positions(layout, p, n)
    assert positions.shape == (p, n // p)
    for rank in range(p):
        assert positions[rank].tolist() == _expected_positions(layout, p, n, rank)
    assert sorted(positions.flatten().tolist()) == list(range(n))


@settings(max_examples=100, deadline=None)
@given(world_and_length, st.sampled_from(PLAIN), st.integers(0, 3))
def test_shard_then_unshard_is_the_identity(pn: tuple[int, int], layout: str, dim_choice: int) -> None:
    p, n = pn
    shape = [2, 3, 2]
    dim = dim_choice % 3
    shape.insert(dim, n)
    x = torch.arange(torch.Size(shape).numel()).view(shape)
    shards = torch.stack([shard_sequence(x, rank=r, world_size=p, layout=layout, dim=dim) for r in range(p)])
    for r in range(p):
        assert torch.equal(shards[r].select(dim, 0), x.select(dim, _expected_positions(layout, p, n, r)[0]))
    assert torch.equal(unshard_sequence(shards, layout=layout, dim=dim), x)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 8), st.sampled_from(["zigzag", "contiguous"]))
def test_post_ulysses_reorder_is_exactly_the_ring_layout(u: int, r: int, m: int, layout: str) -> None:
    """After the all-to-all a ring rank holds its U members' shards; reordered, that is
    exactly its shard of the same layout over R ranks."""
    n = 2 * u * r * m
    sp_positions = layout_positions(layout, u * r, n)
    for ring_rank in range(r):
        gathered = torch.cat([sp_positions[ring_rank * u + ur] for ur in range(u)])
        order = ulysses_to_ring_order(layout, u, r, n, ring_rank)
        reordered = gathered if order is None else gathered[order]
        assert reordered.tolist() == _expected_positions(layout, r, n, ring_rank)
    if layout == "contiguous":
        assert all(ulysses_to_ring_order(layout, u, r, n, rr) is None for rr in range(r))


@pytest.mark.parametrize("u,r", [(2, 1), (4, 1), (1, 3)])
def test_striped_reorders_when_one_dimension_is_trivial(u: int, r: int) -> None:
    n = 8 * u * r
    sp_positions = layout_positions("striped", u * r, n)
    for ring_rank in range(r):
        gathered = torch.cat([sp_positions[ring_rank * u + ur] for ur in range(u)])
        order = ulysses_to_ring_order("striped", u, r, n, ring_rank)
        assert (gathered if order is None else gathered[order]).tolist() == _expected_positions("striped", r, n, ring_rank)


def test_striped_on_a_true_grid_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"layout='striped'.*ulysses_size=2.*ring_size=2.*Use layout='zigzag'"):
        ulysses_to_ring_order("striped", 2, 2, 16, 0)


@pytest.mark.parametrize("layout,p,n,multiple", [("zigzag", 4, 12, 8), ("contiguous", 3, 10, 3), ("striped", 4, 6, 4), ("zigzag", 2, 0, 4)])
def test_indivisible_lengths_are_refused_with_the_fix(layout: str, p: int, n: int, multiple: int) -> None:
    with pytest.raises(ValueError, match=rf"x.shape\[1\]={n} must be a positive multiple of {multiple} for layout='{layout}'.*pad"):
        shard_sequence(torch.zeros(1, n), rank=0, world_size=p, layout=layout)


def test_unknown_layout_and_bad_rank_are_refused() -> None:
    with pytest.raises(ValueError, match=r"layout='ring' is not one of"):
        shard_sequence(torch.zeros(1, 8), rank=0, world_size=2, layout="ring")
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        shard_sequence(torch.zeros(1, 8), rank=2, world_size=2, layout="zigzag")


def test_zigzag_matches_megatron_get_batch_on_this_cp_rank() -> None:
    """Megatron: view the seq dim as [2*cp, c], take chunks (r, 2cp-1-r), flatten."""
    cp, n = 4, 32
    x = torch.arange(n).view(1, n)
    for r in range(cp):
        chunks = x.view(1, 2 * cp, n // (2 * cp))
        megatron = chunks.index_select(1, torch.tensor([r, 2 * cp - r - 1])).view(1, -1)
        assert torch.equal(shard_sequence(x, rank=r, world_size=cp, layout="zigzag"), megatron)


def _document_zigzag_expected(p: int, cu: list[int], rank: int) -> list[int]:
    """Zigzag written out per document (independent of layouts.py)."""
    out = []
    for a, b in zip(cu, cu[1:]):
        c = (b - a) // (2 * p)
        out += list(range(a + rank * c, a + (rank + 1) * c)) + list(range(a + (2 * p - 1 - rank) * c, a + (2 * p - rank) * c))
    return out


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(1, 4), min_size=1, max_size=6), st.integers(1, 3))
def test_document_zigzag_is_zigzag_inside_every_document(p: int, doc_units: list[int], u: int) -> None:
    cu = [0]
    for units in doc_units:
        cu.append(cu[-1] + units * 2 * p * u)
    n = cu[-1]
    positions = layout_positions("document_zigzag", p * u, n, cu)
    for rank in range(p * u):
        assert positions[rank].tolist() == _document_zigzag_expected(p * u, cu, rank)
        assert positions[rank].diff().gt(0).all()  # local order increases: documents are runs
    # after the Ulysses all-to-all, each ring rank holds a document_zigzag shard over R = p
    for ring_rank in range(p):
        gathered = torch.cat([positions[ring_rank * u + ur] for ur in range(u)])
        order = ulysses_to_ring_order("document_zigzag", u, p, n, ring_rank, tuple(cu))
        assert (gathered if order is None else gathered[order]).tolist() == _document_zigzag_expected(p, cu, ring_rank)
    x = torch.arange(n).view(1, n)
    shards = torch.stack([shard_sequence(x, rank=r, world_size=p, layout="document_zigzag", cu_seqlens=cu) for r in range(p)])
    assert torch.equal(unshard_sequence(shards, layout="document_zigzag", cu_seqlens=cu), x)


def test_document_boundaries_are_validated_with_the_fix() -> None:
    x = torch.zeros(1, 16)
    with pytest.raises(ValueError, match=r"needs cu_seqlens"):
        shard_sequence(x, rank=0, world_size=2, layout="document_zigzag")
    # documents of any length (issue 14): lengths 4, 6, 6 over 2 ranks, no per-document padding
    z = torch.arange(16).view(1, 16)
    uneven = torch.stack([shard_sequence(z, rank=r, world_size=2, layout="document_zigzag", cu_seqlens=[0, 4, 10, 16])
                          for r in range(2)])
    assert torch.equal(unshard_sequence(uneven, layout="document_zigzag", cu_seqlens=[0, 4, 10, 16]), z)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at the global sequence length 16"):
        shard_sequence(x, rank=0, world_size=2, layout="striped", cu_seqlens=[0, 4, 12])
    with pytest.raises(ValueError, match=r"must not decrease.*cu_seqlens\[1\]=8 > cu_seqlens\[2\]=4"):
        shard_sequence(x, rank=0, world_size=2, layout="zigzag", cu_seqlens=torch.tensor([0, 8, 4, 16]))
    # an empty document (a repeated boundary, as padded batches produce) is fine
    y = torch.arange(16).view(1, 16)
    shards = torch.stack([shard_sequence(y, rank=r, world_size=2, layout="document_zigzag", cu_seqlens=[0, 4, 4, 16])
                          for r in range(2)])
    assert torch.equal(unshard_sequence(shards, layout="document_zigzag", cu_seqlens=[0, 4, 4, 16]), y)


@pytest.mark.parametrize("layout,u,r,documents", [("zigzag", 2, 2, None), ("zigzag", 4, 2, None),
                                                   ("document_zigzag", 2, 2, (0, 5, 40, 64))])
def test_reorder_moves_runs_as_the_token_index_would(layout: str, u: int, r: int, documents) -> None:
    """The cached reorder keeps a few run entries for the plain layouts (not one per token)
    and applies exactly the token permutation of ulysses_to_ring_order, both ways."""
    from ring_sp.layouts import ulysses_to_ring_order, ulysses_to_ring_reorder

    seq_len = 64
    for ring_rank in range(r):
        index = ulysses_to_ring_order(layout, u, r, seq_len, ring_rank, documents)
        reorder = ulysses_to_ring_reorder(layout, u, r, seq_len, ring_rank, torch.device("cpu"), documents)
        x = torch.randn(2, index.numel(), 3, 4)
        assert torch.equal(reorder.apply(x), x.index_select(1, index))
        assert torch.equal(reorder.undo(reorder.apply(x)), x)
        if documents is None:
            assert reorder.chunk == seq_len // (2 * u * r) and reorder.index.numel() == 2 * u  # runs, not tokens


def _dealt_document_zigzag(p: int, cu: tuple[int, ...], rank: int) -> list[int]:
    """The module docstring's rule token by token (independent of layouts.py): each document of
    ``L = 2P*c + e`` tokens gets chunks of ``c``, its ``e`` extra tokens dealt by ONE running
    counter over the whole sequence, first chunks of ranks 0..P-1 then their second chunks."""
    out, dealt = [], 0
    for a, b in zip(cu, cu[1:]):
        sizes = [(b - a) // (2 * p)] * (2 * p)
        for _ in range((b - a) % (2 * p)):
            k = dealt % (2 * p)
            sizes[k if k < p else 3 * p - 1 - k] += 1
            dealt += 1
        starts = [a + sum(sizes[:j]) for j in range(2 * p + 1)]
        for slot in (rank, 2 * p - 1 - rank):
            out += range(starts[slot], starts[slot + 1])
    return out


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.lists(st.integers(0, 40), min_size=1, max_size=7))
def test_rank_runs_are_the_rule_written_out_for_documents_of_any_length(u: int, r: int, lengths: list[int]) -> None:
    """Each rank's shard, built from its own runs (O(documents), no other rank's positions), is
    the dealt split; a ring rank's runs are its U members' tokens in order."""
    from ring_sp.layouts import rank_positions, ring_positions, shard_runs

    p = u * r
    lengths = lengths + [(-sum(lengths)) % p or (p if sum(lengths) == 0 else 0)]
    cu = tuple(sum(lengths[:i]) for i in range(len(lengths) + 1))
    shards = [_dealt_document_zigzag(p, cu, rank) for rank in range(p)]
    for rank in range(p):
        assert rank_positions("document_zigzag", p, cu[-1], rank, cu).tolist() == shards[rank]
        runs = shard_runs("document_zigzag", 1, p, cu[-1], rank, cu)
        assert runs.start.numel() <= 2 * (len(cu) - 1)  # two runs per document (one rank: one), nothing per token
    for ring_rank in range(r):
        members = sorted(t for x in range(u) for t in shards[ring_rank * u + x])
        assert shard_runs("document_zigzag", u, r, cu[-1], ring_rank, cu).positions().tolist() == members
        assert ring_positions("document_zigzag", u, r, cu[-1], cu)[ring_rank].tolist() == members


@pytest.mark.parametrize("layout,u,r,documents", [
    ("striped", 4, 1, None), ("striped", 2, 1, None),  # a transpose
    ("zigzag", 4, 2, None), ("zigzag", 8, 1, None),  # chunks
    ("document_zigzag", 2, 2, (0, 3, 17, 18, 61, 64)), ("document_zigzag", 4, 1, (0, 5, 5, 40, 64)),  # runs of any length
])
def test_every_reorder_form_is_the_token_permutation_and_keeps_runs_only(layout: str, u: int, r: int, documents) -> None:
    """apply/undo equal the token index of ulysses_to_ring_order along dims 1 and 2 (head-major),
    and the cached Reorder keeps O(U x documents) entries, not one per token."""
    from ring_sp.layouts import ulysses_to_ring_reorder

    seq_len = 64
    runs_bound = 2 * u * (len(documents) - 1 if documents else 1)
    for ring_rank in range(r):
        index = ulysses_to_ring_order(layout, u, r, seq_len, ring_rank, documents)
        reorder = ulysses_to_ring_reorder(layout, u, r, seq_len, ring_rank, torch.device("cpu"), documents)
        kept = sum(t.numel() for t in (reorder.index, reorder.inverse, reorder.sizes) if t is not None)
        assert kept <= 3 * runs_bound < index.numel() * 2, (kept, index.numel())
        for dim in (1, 2):
            shape = [2, 3, 4]
            shape.insert(dim, index.numel())
            x = torch.randn(shape)
            y = reorder.apply(x, dim)
            assert torch.equal(y, x.index_select(dim, index)) and y.is_contiguous()
            assert torch.equal(reorder.undo(y, dim), x)


@pytest.mark.parametrize("layout", PLAIN + ("document_zigzag",))
def test_unshard_to_the_real_length_is_a_contiguous_prefix(layout: str) -> None:
    cu = (0, 7, 30, 32) if layout == "document_zigzag" else None
    x = torch.randn(2, 32, 3)
    shards = torch.stack([shard_sequence(x, rank=k, world_size=4, layout=layout, cu_seqlens=cu) for k in range(4)])
    got = unshard_sequence(shards, layout=layout, cu_seqlens=cu, seq_len=29)
    assert torch.equal(got, x[:, :29]) and got.is_contiguous()
