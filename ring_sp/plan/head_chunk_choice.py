"""``head_chunks="auto"``: how many chunks of heads one attention call runs in.

A chunk holds whole GQA groups (its KV heads and the query heads reading them), so the
count divides ``m``, the KV heads a rank holds after the Ulysses all-to-all
(:func:`ring_sp.shapes.kv_heads_per_rank`). Chunking moves the same bytes and does the same
FLOPs; what it changes:

* memory: the call's working buffers (the all-to-all's send and receive buffers, the head-
  layout copies, the ring's KV slots and fp32 dK/dV accumulators, the fp32 output and dq
  accumulators) exist for one chunk at a time, ``1 / chunks`` of the unchunked ones;
* time: every chunk pays the fixed cost of its own collectives (3 all-to-alls forward and 3
  backward with Ulysses, about ``2R`` synchronising ring steps), and its kernel calls see
  fewer heads.

The rule (:func:`choose_head_chunks`, pure: every rank picks the same from the agreed shapes):

1. memory: the fewest chunks whose working set is at most the layer's ``[n, hidden]``
   activation (``b * n * heads * head_dim`` elements of the input dtype, q's width): the same
   yardstick as the library's tile sizes (:func:`ring_sp.shapes.auto_tile_tokens`), so no
   chunk is the layer's peak. Unchunked, the working set is several times that (an fp32 dq
   accumulator alone is 2x in bf16), so this usually asks for the finest split, ``m``;
2. time, on the nominal cluster (:func:`ring_sp.plan.presets.nominal_cluster`, as
   ``kv_exchange="auto"``): no more chunks than keep (a) the added fixed costs,
   ``(chunks - 1) x calls x latency``, within :data:`LATENCY_SHARE` of the layer's modelled
   time (:mod:`ring_sp.plan.layer_time`; bandwidth and FLOPs are unchanged by chunking) and
   (b) every kernel call at least :data:`MIN_KERNEL_ROWS_X_HEADS` query rows x heads, two
   waves of 128-row tiles on an H100's 132 SMs, below which a flash kernel leaves SMs idle.

Short sequences therefore stay unchunked (their buffers are small, their fixed costs large);
long ones take the finest split the GQA groups allow.
"""

from __future__ import annotations

import functools

import torch

from ..layouts import DOCUMENT_LAYOUTS
from ..shapes import head_chunk_options
from .layer_cost import attention_memory
from .layer_time import candidate
from .presets import nominal_cluster
from .request import DTYPES, Cluster, ModelShape, Workload

LATENCY_SHARE = 0.01
"""The share of one layer's modelled attention time that the chunks' extra fixed costs may take
(the planner's own resolution: :func:`ring_sp.plan.choose_kv_exchange` calls 1% a tie)."""

MIN_KERNEL_ROWS_X_HEADS = 2**15
"""Query rows x heads of one chunk's kernel call below which chunking stops: 128-row tiles x
132 SMs x 2 waves = 33,792 (FlashAttention's grid is query tiles x batch x heads)."""


def chunk_options(kv_heads: int, ulysses: int) -> list[int]:
    """Every valid ``head_chunks`` (:func:`ring_sp.shapes.head_chunk_options`)."""
    return head_chunk_options(kv_heads, ulysses)


def working_bytes(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int, head_dim: int,
                  dtype: str, kv_exchange: str = "ring") -> float:
    """The unchunked call's working buffers on one rank (bytes): the ring's and the
    accumulators' (:func:`ring_sp.plan.attention_memory`), plus, with Ulysses, one all-to-all's
    send and receive buffers of q's size. A chunk holds ``1 / chunks`` of it."""
    memory = attention_memory(ulysses=ulysses, ring=ring, batch=batch, local_len=local_len, heads=heads,
                              kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, kv_exchange=kv_exchange)
    a2a = 2 * batch * local_len * heads * head_dim * DTYPES[dtype].itemsize if ulysses > 1 else 0
    return memory.working + a2a


def fixed_calls(ulysses: int, ring: int, kv_exchange: str) -> int:
    """Synchronising exchanges one chunk issues, forward and backward: 3 + 3 all-to-alls with
    Ulysses; ``R - 1`` + ``R`` ring steps and the dK/dV home, or one gather forward and one
    gather and one reduce-scatter backward."""
    calls = 6 if ulysses > 1 else 0
    if ring > 1:
        calls += 3 if kv_exchange == "all_gather" else 2 * ring
    return calls


@functools.lru_cache(maxsize=256)  # called on every attention call with head_chunks="auto"
def choose_head_chunks(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int,
                       head_dim: int, value_head_dim: int, dtype: torch.dtype, layout: str = "zigzag",
                       causal: bool = True, sliding_window: int | None = None, kv_exchange: str = "ring",
                       cluster: Cluster | None = None) -> int:
    """``head_chunks="auto"`` for one call (``local_len`` = this rank's shard, ``heads`` /
    ``kv_heads`` before the Ulysses split): the fewest chunks whose working set is at most the
    layer's ``[n, hidden]`` activation, capped where chunks would cost time (see the module
    docstring). ``cluster`` None: the nominal cluster."""
    options = chunk_options(kv_heads, ulysses)
    if options == [1]:
        return 1
    name = next(key for key, value in DTYPES.items() if value == dtype and len(key) <= 4)
    activation = batch * local_len * heads * head_dim * dtype.itemsize
    working = working_bytes(ulysses=ulysses, ring=ring, batch=batch, local_len=local_len, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim, dtype=name, kv_exchange=kv_exchange)
    wanted = next((c for c in options if working / c <= activation), options[-1])
    if cluster is None:
        cluster = nominal_cluster(ulysses * ring)
    sp = ulysses * ring
    model = ModelShape(heads, kv_heads, head_dim, heads * head_dim, 1, value_head_dim)
    work = Workload(local_len * sp, batch, name, causal, sp, sliding_window)
    shape = "zigzag" if layout in DOCUMENT_LAYOUTS else layout  # the same causal balance, no documents modelled
    layer_s = candidate(ulysses, ring, "ulysses_inner", shape, cluster, model, work, sp, kv_exchange).layer_s
    calls = fixed_calls(ulysses, ring, kv_exchange)
    rows = batch * local_len * ulysses  # query rows a ring rank holds after the all-to-all

    def affordable(c: int) -> bool:
        cheap = (c - 1) * calls * cluster.latency <= LATENCY_SHARE * layer_s
        return cheap and rows * heads // (ulysses * c) >= MIN_KERNEL_ROWS_X_HEADS

    return max(c for c in options if c <= wanted and (c == 1 or affordable(c)))


__all__ = ["LATENCY_SHARE", "MIN_KERNEL_ROWS_X_HEADS", "choose_head_chunks", "chunk_options", "fixed_calls",
           "working_bytes"]
