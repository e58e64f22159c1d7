"""``kv_exchange="auto"``: the one planner question the runtime asks, per attention call.

A pure function of the call's agreed shapes and options (every rank picks the same), cached;
it models the ring and the all-gather with :mod:`ring_sp.plan.layer_time` on the nominal
cluster of :mod:`ring_sp.plan.presets` unless given one.
"""

from __future__ import annotations

import functools

import torch

from ..layouts import DOCUMENT_LAYOUTS
from .layer_time import candidate
from .presets import nominal_cluster
from .request import DTYPES, Cluster, ModelShape, Workload

@functools.lru_cache(maxsize=256)  # called on every attention call with kv_exchange="auto"
def choose_kv_exchange(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int,
                       head_dim: int, value_head_dim: int, dtype: torch.dtype, layout: str, causal: bool,
                       sliding_window: int | None, cluster: Cluster | None = None) -> str:
    """``kv_exchange="auto"``: "all_gather" where this module models it > 1% faster than the ring for
    one call (``local_len`` = the SP shard, ``heads`` / ``kv_heads`` before the Ulysses split),
    else "ring". ``cluster`` None: the CLI's nominal figures (an H100 NVLink node, the default
    ``--latency-us``); a pure function of the call's agreed shapes, so every rank picks the same."""
    if ring == 1:
        return "ring"
    if cluster is None:
        cluster = nominal_cluster(ulysses * ring)
    name = next(key for key, value in DTYPES.items() if value == dtype and len(key) <= 4)
    model = ModelShape(heads, kv_heads, head_dim, heads * head_dim, 1, value_head_dim)
    work = Workload(local_len * ulysses * ring, batch, name, causal, ulysses * ring, sliding_window)
    shape = "zigzag" if layout in DOCUMENT_LAYOUTS else layout  # the same causal balance, no documents modelled
    seconds = {x: candidate(ulysses, ring, "ulysses_inner", shape, cluster, model, work, ulysses * ring, x).layer_s
               for x in ("ring", "all_gather")}
    # as plan(): within 1% the model cannot tell, and the ring holds less
    return "all_gather" if seconds["all_gather"] < 0.99 * seconds["ring"] else "ring"
