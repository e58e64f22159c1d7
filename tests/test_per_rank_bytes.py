"""Issue 30, item 5: nothing per GLOBAL token on a rank, on ring_sp's attention side.

Everything a rank builds and keeps for the layouts, the Ulysses-to-ring reorder and the ring
schedule is computed here for P = 8 WITHOUT 8 processes (pure functions of the rank and the
world size), at N = 2^20 tokens, and weighed: tensors by their storage (a row that is a view
of every rank's positions weighs all of them), Python objects by ``sys.getsizeof``, each
object once. A rank's bytes must be 1/8 of P = 1's for the same N, up to a constant; the
structures that are not per token (runs, the reorder, the schedule) must not grow with N.
About 2 s.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from ring_sp.layouts import layout_index, layout_key, rank_positions, shard_runs, ulysses_to_ring_reorder
from ring_sp.runs import MEMOS
from ring_sp.schedule import exchange_plan
from ring_sp.schedule_cache import ScheduleCache

N = 1 << 20
P = 8
RANK = 3
CPU = torch.device("cpu")
CONSTANT = 64 * 1024  # what "up to constants" allows: metadata of a few documents and ranks, never O(N)


def _documents(seq_len: int) -> tuple[int, ...]:
    """Five documents of uneven lengths (not multiples of 2P), scaled with ``seq_len``."""
    cuts = [0, seq_len // 7 + 3, seq_len // 3 + 1, seq_len // 2 - 5, (3 * seq_len) // 4 + 11, seq_len]
    return tuple(cuts)


LAYOUTS = {  # layout -> the document boundaries it is used with (a function of N)
    "contiguous": lambda n: None,
    "zigzag": lambda n: None,
    "striped": lambda n: None,
    "document_zigzag": _documents,
}
GRIDS = {"striped": [(8, 1)], "contiguous": [(2, 4), (8, 1)], "zigzag": [(2, 4), (4, 2), (8, 1)],
         "document_zigzag": [(2, 4), (4, 2), (8, 1)]}


def weigh(obj: object, seen: set[int] | None = None) -> int:
    """Bytes held by ``obj`` and everything it reaches (tensors by storage, each counted once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = -storage.data_ptr() - 1  # storages by address (two views of one storage weigh it once)
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(weigh(k, seen) + weigh(v, seen) for k, v in obj.items())
    if isinstance(obj, (tuple, list, set, frozenset)):
        return size + sum(weigh(x, seen) for x in obj)
    if isinstance(obj, slice):
        return size + weigh(obj.start, seen) + weigh(obj.stop, seen)
    if dataclasses.is_dataclass(obj):
        return size + sum(weigh(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    return size


def kept() -> int:
    """Everything the layout, runs and schedule caches hold now."""
    seen: set[int] = set()
    return sum(weigh(value, seen) for memo in MEMOS for value in memo.values())


def _clear() -> None:
    for memo in MEMOS:
        memo.cache_clear()


def rank_work(layout: str, world_size: int, rank: int, seq_len: int) -> dict[str, int]:
    """What one rank builds for a step over ``world_size`` ranks (each structure weighed), and
    the caches' total afterwards."""
    _clear()
    cu = LAYOUTS[layout](seq_len)
    key = layout_key(layout, cu)
    sizes = {
        "index": weigh(layout_index(layout, world_size, seq_len, key, rank, CPU)),  # shard_sequence's
        "runs": weigh(shard_runs(layout, 1, world_size, seq_len, rank, cu)),
        "unshard": weigh(ulysses_to_ring_reorder(layout, world_size, 1, seq_len, 0, CPU, key)),  # gather_sequence's
    }
    for u, r in GRIDS[layout] if world_size > 1 else [(1, 1)]:
        ring_rank = rank // u
        sizes[f"reorder U{u}xR{r}"] = weigh(ulysses_to_ring_reorder(layout, u, r, seq_len, ring_rank, CPU, key))
        cache = ScheduleCache()
        for window in (None, seq_len // 64):
            plan = cache.get((layout, u, r, window), lambda: exchange_plan(
                layout, True, ring_rank, r, seq_len // r, cu, window, ulysses_size=u))
            assert len(plan.schedule) == r
        sizes[f"schedule U{u}xR{r}"] = weigh(cache.values())
    sizes["kept"] = kept()
    return sizes


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rank_keeps_an_eighth_of_one_ranks_bytes(layout: str) -> None:
    one, eight = rank_work(layout, 1, 0, N), rank_work(layout, P, RANK, N)
    assert one["index"] >= 8 * N  # the measure sees a position per token: one rank holds all N
    assert eight["index"] <= one["index"] / P + CONSTANT, eight
    assert eight["kept"] <= one["kept"] / P + CONSTANT, (one, eight)
    for name, size in eight.items():
        if name not in ("index", "kept"):
            assert size <= CONSTANT, (name, size)  # runs, reorders, schedules: metadata only


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_metadata_does_not_grow_with_the_sequence(layout: str) -> None:
    """Runs, the Ulysses reorder, the unshard reorder and the schedule entries of rank 3 of 8 weigh
    the same at N = 2^16 and 2^20 (16x the tokens); its position index grows 16x."""
    small, large = rank_work(layout, P, RANK, N // 16), rank_work(layout, P, RANK, N)
    assert large["index"] == 16 * small["index"]
    for name in large:
        if name not in ("index", "kept"):
            assert large[name] <= small[name] + 1024, (name, small[name], large[name])


def test_the_weighing_counts_a_view_as_its_storage() -> None:
    """A row of every rank's positions weighs all of them: what the caches kept before."""
    every = torch.arange(N).view(P, -1)
    assert weigh(every[RANK]) == 8 * N and weigh(every[RANK].clone()) == 8 * N // P


def test_rank_positions_are_the_layout_row_and_document_positions() -> None:
    """The one-rank builders agree with the all-ranks view and with shard_batch's position_ids."""
    from ring_sp.data import document_positions
    from ring_sp.layouts import layout_positions

    cu = _documents(4096)
    for layout in LAYOUTS:
        every = layout_positions(layout, P, 4096, cu)
        for rank in range(P):
            assert torch.equal(rank_positions(layout, P, 4096, rank, cu), every[rank])
            assert torch.equal(rank_positions(layout, P, 4096, rank, cu, in_document=True),
                               document_positions(cu)[every[rank]])
    with pytest.raises(ValueError, match=r"in_document=True needs cu_seqlens"):
        rank_positions("zigzag", P, 4096, 0, in_document=True)
    with pytest.raises(ValueError, match=r"rank=8 must be in \[0, 8\)"):
        rank_positions("zigzag", P, 4096, 8)


def test_megatron_rope_keeps_a_ranks_angles_only() -> None:
    """ring_sp's Megatron RoPE (unpacked and per document) computes and caches the angles of the
    rank's own positions: 1/8 of one rank's, no table of every global position."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from ring_sp.integrations.megatron.rope import LayoutRotaryEmbedding
    from test_megatron import _FakeGroup

    def rope_bytes(world_size: int, rank: int) -> int:
        group = _FakeGroup(rank, world_size)
        rope = LayoutRotaryEmbedding(RotaryEmbedding(16, 1.0, use_cpu_initialization=True, cp_group=group),
                                     layout="zigzag", cp_group=group, device="cpu")
        angles = rope(N)
        assert angles.shape[0] == N // world_size
        rope.document_angles(_documents(N), "document_zigzag", world_size, rank)
        seen: set[int] = set()
        return weigh(rope._last, seen) + weigh(rope._last_documents, seen)

    one, eight = rope_bytes(1, 0), rope_bytes(P, RANK)
    assert one >= 2 * 16 * 4 * N  # the control: one rank holds the angles of all N tokens, twice
    assert eight <= one / P + CONSTANT, (one, eight)
