"""``layout="auto"``: the placement of each batch, chosen by a model (issue 44).

Without documents the answer is ``zigzag`` (balanced, two runs per rank, nothing to weigh).
With documents (``cu_seqlens``) it is ``document_balanced`` or ``document_zigzag``, whichever
this module models as faster for one attention layer on the nominal GPU of
:mod:`ring_sp.plan.presets` (an H100 over NVLink, bf16): the slower of the most loaded rank's
tile-rounded score pairs and the KV rows a rank receives, each costed on the nominal GPU and
link with a GQA group of four (a ring step hides the smaller one behind the larger).

A pure function of the documents and the SP size, cached: ``shard_batch`` and the attention
compute it alike on every rank (they agree on ``cu_seqlens``), so the data and the ring use
the same placement without passing it around.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..layouts import AUTO, as_boundaries
from ..placement import document_placement, effective_tile, spread_shares, zigzag_read_rows
from ..runs import Boundaries
from .presets import DEFAULT_EFFICIENCY, GPUS, LINKS

# what one KV row costs in score pairs on the nominal GPU and link: a row of 2 x h_kv x d bf16
# values against the 4 x d x h FLOPs of a pair, h_kv / h = 1/4 (Llama-3's GQA)
_KV_HEAD_SHARE = 0.25
_BF16 = 2


@dataclass(frozen=True)
class LayoutCost:
    """One layout's modelled layer on the most loaded rank, in score-pair units."""

    layout: str
    work: int  # tile-rounded score pairs of the most loaded rank
    read_rows: int  # KV rows a rank receives over the pass (the mean over ranks)
    cost: float  # max(work, read_rows x the cost of a row in pairs)


def row_cost_in_pairs(gpu: str = "h100", link: str | None = None) -> float:
    """Score pairs ``gpu`` computes (at the planner's attention efficiency) while ``link`` (its
    node's by default) moves one KV row: ``(h_kv / h) (bytes / 2) F / B``, DESIGN section 8."""
    chip = GPUS[gpu]
    flops = chip.tflops * 1e12 * DEFAULT_EFFICIENCY
    return _KV_HEAD_SHARE * (_BF16 / 2) * flops / LINKS[link or chip.intra_link]


def layout_costs(cu_seqlens: Boundaries, world_size: int) -> tuple[LayoutCost, LayoutCost]:
    """The modelled costs of ``document_balanced`` and ``document_zigzag`` (module docstring)."""
    placed = document_placement(cu_seqlens, world_size)
    tile = effective_tile(cu_seqlens[-1] // world_size)
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]) if b > a]
    zigzag_work = [0] * world_size
    for length in lengths:  # every document spread over all ranks
        for rank, (_, work) in enumerate(spread_shares(length, world_size, tile)):
            zigzag_work[rank] += work
    row = row_cost_in_pairs()

    def cost(layout: str, work: int, read: int) -> LayoutCost:
        per_rank = read // world_size
        return LayoutCost(layout, work, per_rank, max(float(work), per_rank * row))

    return (cost("document_balanced", max(placed.work), placed.read_rows),
            cost("document_zigzag", max(zigzag_work), sum(zigzag_read_rows(n, world_size) for n in lengths)))


@functools.lru_cache(maxsize=64)
def _choose(cu_seqlens: Boundaries | None, world_size: int) -> str:
    if cu_seqlens is None:
        return "zigzag"
    if world_size == 1:
        return "document_balanced"  # one rank: the whole sequence either way
    balanced, zigzag = layout_costs(cu_seqlens, world_size)
    return balanced.layout if balanced.cost <= zigzag.cost else zigzag.layout


def choose_layout(cu_seqlens: torch.Tensor | Sequence[int] | None, world_size: int) -> str:
    """``layout="auto"`` for a batch with documents ``cu_seqlens`` (None: none) over ``world_size``
    SP ranks: ``zigzag`` without documents, else ``document_balanced`` unless the model says
    ``document_zigzag`` is faster. Pure and cached; the global length must be a multiple of
    ``world_size`` (``shard_batch`` pads it)."""
    return _choose(as_boundaries(cu_seqlens), world_size)


def resolve_layout(layout: str, cu_seqlens: torch.Tensor | Sequence[int] | None, world_size: int) -> str:
    """``layout`` itself, or for ``"auto"`` :func:`choose_layout`'s choice."""
    return choose_layout(cu_seqlens, world_size) if layout == AUTO else layout
