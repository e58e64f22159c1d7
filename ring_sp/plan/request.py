"""What a plan is asked about: the cluster, one layer's attention shape, the workload.

Frozen dataclasses and the dtype table; :class:`PlanError` is what every planner function
raises for a request it cannot plan, with the reason and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..shapes import softmax_stat_dtype

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


class PlanError(ValueError):
    """The request cannot be planned; the message says why and what to change."""


@dataclass(frozen=True)
class Cluster:
    """``world_size`` GPUs, ``gpus_per_node`` per node; ``flops``: achieved attention FLOP/s
    per GPU; ``intra_bw`` / ``inter_bw``: bytes/s per GPU per direction inside / across nodes."""

    world_size: int
    gpus_per_node: int
    flops: float
    intra_bw: float
    inter_bw: float
    memory_bytes: float = math.inf
    latency: float = 0.0  # seconds per synchronising exchange (a ring step, a collective), not hidden


@dataclass(frozen=True)
class ModelShape:
    """The attention of one transformer layer (q and KV heads, head size), the hidden size
    and the number of layers."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    layers: int
    value_head_dim: int | None = None  # d_v (None: head_dim); MLA's differs


@dataclass(frozen=True)
class Workload:
    """One sample of ``seq_len`` tokens (``batch`` of them) over ``sp_size`` ranks (None = all);
    ``sliding_window``: causal sliding-window attention over that many keys (None: full)."""

    seq_len: int
    batch: int = 1
    dtype: str = "bf16"
    causal: bool = True
    sp_size: int | None = None
    sliding_window: int | None = None


def dtype_bytes(dtype: str) -> tuple[int, int]:
    """(element bytes, bytes of the softmax-statistics / gradient-accumulator dtype)."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype={dtype!r} is not one of {sorted(set(DTYPES))}")
    torch_dtype = DTYPES[dtype]
    return torch_dtype.itemsize, softmax_stat_dtype(torch_dtype).itemsize
