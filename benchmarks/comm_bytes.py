"""Bytes each rank sends, counted at the communication calls, next to DESIGN.md section 5.

ring_sp's own calls are counted by :func:`ring_sp.count_communication`. DeepSpeed's
all-to-alls go through ``torch.distributed.all_to_all_single``, which
:func:`count_all_to_all` wraps for the block, counting what leaves the rank
(``(P-1)/P`` of each input). The formula is the planner's :func:`ring_sp.plan.layer_bytes`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ring_sp.plan import layer_bytes


@contextlib.contextmanager
def count_all_to_all() -> Iterator[dict[str, int]]:
    """``{"all_to_all": bytes}`` sent by ``all_to_all_single`` calls (equal splits) in the block."""
    counted = {"all_to_all": 0}
    original = dist.all_to_all_single

    def counting(output: torch.Tensor, input: torch.Tensor, *args, **kwargs):
        world_size = dist.get_world_size(kwargs.get("group"))
        counted["all_to_all"] += input.numel() * input.element_size() * (world_size - 1) // world_size
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        yield counted
    finally:
        dist.all_to_all_single = original


def formula_bytes(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int, head_dim: int,
                  dtype: str) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer by the design's formulas."""
    fwd, bwd = layer_bytes(ulysses=ulysses, ring=ring, batch=batch, local_len=local_len, heads=heads,
                           kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return sum(fwd.values()), sum(bwd.values())
