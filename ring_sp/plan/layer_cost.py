"""Bytes and memory of one attention layer on one rank (DESIGN.md section 5), pure.

:func:`layer_bytes` counts what a rank sends, keyed exactly as
:func:`ring_sp.count_communication` records it (the benchmark and ``tests/test_plan.py``
check it against real runs); :func:`attention_memory` what a rank holds between the forward
and the backward and on top during the backward (checked against the benchmark's
``activations`` section).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule import exchange_plan, pass_link_rows, row_count
from ..shapes import FINGERPRINT_BYTES, kv_heads_per_rank
from .request import dtype_bytes

def ring_halo_rows(layout: str, ring: int, chunk: int, window: int | None, ring_rank: int,
                   causal: bool = True) -> tuple[int, int]:
    """(KV rows ring rank ``ring_rank`` sends, dK/dV partial rows it sends home) in one layer,
    with or without a sliding ``window`` (``chunk`` = N / R tokens per ring rank), summed over
    the steps: the rows its partners read, and the rows it read of theirs
    (:func:`ring_sp.schedule.exchange_plan`)."""
    plan_ = exchange_plan(layout, causal, ring_rank, ring, chunk, None, window)
    return sum(map(row_count, plan_.send_rows[1:])), sum(map(row_count, plan_.recv_rows[1:]))


def double_ring_rows(layout: str, ring: int, inner_size: int, chunk: int, window: int | None, ring_rank: int,
                     causal: bool = True) -> dict[str, int]:
    """Rows ring rank ``ring_rank`` of a double ring sends in one pass, by kind: KV inside the node
    and across (:func:`ring_sp.schedule.pass_link_rows`), and the partials back (the rows it read at
    its inner steps; the held rows it summed, home)."""
    plan_ = exchange_plan(layout, causal, ring_rank, ring, chunk, None, window, inner_size=inner_size)
    links = pass_link_rows(plan_, ring_rank, inner_size)
    return {"ring_kv": links["intra"], "ring_kv_inter": links["inter"],
            "ring_dkv": sum(row_count(plan_.recv_rows[t]) for t in range(1, ring) if t % inner_size),
            "ring_dkv_inter": sum(row_count(plan_.recv_rows[t]) for t in range(inner_size, ring, inner_size))}


def layer_bytes(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int, head_dim: int,
                dtype: str, value_head_dim: int | None = None, layout: str = "zigzag", causal: bool = True,
                sliding_window: int | None = None, ring_rank: int | None = None,
                kv_exchange: str = "ring", inner_size: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes ONE rank sends in one attention layer, forward and backward, keyed by the kinds
    :func:`ring_sp.count_communication` records (DESIGN.md section 5 as implemented).

    ``local_len`` = N / (U * R) tokens per rank. Ulysses: each all-to-all keeps ``1/U`` of its
    input; KV heads travel packed, replicated when ``U > kv_heads`` (their gradients then
    return in fp32). ``value_head_dim`` (None = ``head_dim``): v, out and dout carry it,
    q/k/dq ``head_dim``; a packed KV message holds ``head_dim + value_head_dim`` per KV head and token.

    Ring (``layout`` and ``causal`` matter, and a ``sliding_window`` shorter than N): at each of
    the ``R - 1`` steps, forward and again backward, the packed ``[k; v]`` rows a partner reads
    go to it (the whole shard of ``N / R`` tokens when it reads 90% of it or more). In backward,
    with a window, the fp32 dK/dV partial of the rows a rank read goes straight home
    (:func:`ring_halo_rows`); without one its ``[dk; dv]`` accumulator makes ``R`` hops, fp32
    while it collects, the input dtype on the last hop home (fp32 again when replicated).
    Rows are those of ring rank ``ring_rank`` or, when None, each kind's maximum over the ring
    ranks (a bound for every rank: with causal zigzag, rank 0 receives whole shards and sends
    half ones). Kinds with nothing sent are left out.

    ``kv_exchange="all_gather"``: every rank's packed KV shard reaches the ``R - 1`` others,
    forward and again in backward (``allgather_kv``), and the fp32 ``[dk; dv]`` partials of
    every shard are reduce-scattered home (``reduce_scatter_dkv``: ``R - 1`` shards), with or
    without a window.

    ``kv_exchange="double_ring"`` with ``inner_size`` ring ranks per node (a ring spanning nodes):
    forward and again in backward, the KV an inner step reads goes inside the node (``ring_kv``)
    and each shard a node reads crosses to it once (``ring_kv_inter``); the fp32 partials go back
    the same ways (``ring_dkv``, ``ring_dkv_inter``: :func:`double_ring_rows`).
    """
    elem, acc = dtype_bytes(dtype)
    d_v = head_dim if value_head_dim is None else value_head_dim
    m = kv_heads_per_rank(kv_heads, ulysses)
    replicated = kv_heads % ulysses != 0

    def a2a(elements: int, size: int) -> int:  # elements divide by U: heads were split U ways
        return elements * (ulysses - 1) // ulysses * size

    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}
    if ulysses > 1:
        q_elems, out_elems = batch * local_len * heads * head_dim, batch * local_len * heads * d_v
        kv_elems = batch * local_len * ulysses * m * (head_dim + d_v)  # packed [k; v], per destination
        fwd["ulysses_a2a_q"] = bwd["ulysses_a2a_dq"] = a2a(q_elems, elem)
        fwd["ulysses_a2a_out"] = bwd["ulysses_a2a_dout"] = a2a(out_elems, elem)
        fwd["ulysses_a2a_kv"] = a2a(kv_elems, elem)
        bwd["ulysses_a2a_dkv"] = a2a(kv_elems, acc if replicated else elem)
    window = sliding_window if sliding_window is not None and sliding_window < local_len * ulysses * ring else None
    if ring > 1 and kv_exchange == "all_gather":
        kv_shard = batch * local_len * ulysses * m * (head_dim + d_v)
        fwd["allgather_kv"] = bwd["allgather_kv"] = (ring - 1) * kv_shard * elem
        bwd["reduce_scatter_dkv"] = (ring - 1) * kv_shard * acc
    elif ring > 1 and kv_exchange == "double_ring" and inner_size is not None and 1 < inner_size < ring:
        kv_row = batch * m * (head_dim + d_v)
        counts = [double_ring_rows(layout, ring, inner_size, local_len * ulysses, window, r, causal) for r in range(ring)]
        rows = counts[ring_rank] if ring_rank is not None else {k: max(c[k] for c in counts) for k in counts[0]}
        for kind, size, into in (("ring_kv", elem, (fwd, bwd)), ("ring_kv_inter", elem, (fwd, bwd)),
                                 ("ring_dkv", acc, (bwd,)), ("ring_dkv_inter", acc, (bwd,))):
            for sent in into:
                if rows[kind]:
                    sent[kind] = rows[kind] * kv_row * size
    elif ring > 1:
        kv_row = batch * m * (head_dim + d_v)  # elements of one packed [k; v] token
        counts = {r: ring_halo_rows(layout, ring, local_len * ulysses, window, r, causal) for r in range(ring)}
        kv_rows, dkv_rows = counts[ring_rank] if ring_rank is not None else (
            max(c[0] for c in counts.values()), max(c[1] for c in counts.values()))
        if kv_rows:
            fwd["ring_kv"] = bwd["ring_kv"] = kv_rows * kv_row * elem
        if window is not None and dkv_rows:  # partials straight home
            bwd["ring_dkv"] = dkv_rows * kv_row * acc
        elif window is None:  # the relayed accumulator: R - 1 fp32 hops, the last home in the input dtype
            kv_shard = kv_row * local_len * ulysses
            bwd["ring_dkv"] = (ring - 1) * kv_shard * acc + kv_shard * (acc if replicated else elem)
    return fwd, bwd


@dataclass(frozen=True)
class AttentionMemory:
    """Bytes one rank holds for one attention layer (model checked against the benchmark's
    ``activations`` section, which measures every tensor storage the layer creates).

    ``kept``: between its forward and its backward, its output included (ring: out + lse;
    with Ulysses the head-sharded q, packed k/v, out and lse). ``kept_checkpointed``: the
    same under activation checkpointing, where ring_sp keeps only out + lse for the re-run
    (``reuse_on_recompute``; nothing with it off). ``working``: what the backward holds on
    top (its minimum: the benchmark measures at most 1.05x it): the fp32 dq accumulator,
    the ring's own packed KV shard and its inbox (one slot at ``R = 2``, else two), causal
    zigzag's staged first chunk (the half a later rank reads), the fp32 [dK; dV] double
    buffer, ONE block's gradients (each block's are added before the next block runs; the
    largest, zigzag's first step, is one q shard + one KV shard in fp32), and with Ulysses
    the head-sharded dout and the dk/dv of the all-to-all. Figures are the most loaded ring
    rank's (rank 0, which reads every shard whole).
    """

    kept: int
    kept_checkpointed: int
    working: int


def attention_memory(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int,
                     head_dim: int, dtype: str, kv_exchange: str = "ring", layout: str = "zigzag",
                     causal: bool = True) -> AttentionMemory:
    """:class:`AttentionMemory` of one layer on one rank (``local_len`` = N / (U * R)).
    ``kv_exchange="all_gather"``: the backward holds the ``R`` gathered KV shards and ``R``
    fp32 ``[dK; dV]`` partials (plus the reduce-scattered one) instead of double buffers."""
    elem, acc = dtype_bytes(dtype)
    m = kv_heads_per_rank(kv_heads, ulysses)
    q_elems = batch * local_len * heads * head_dim  # the q / out shard, in either layout
    kv_shard = 2 * batch * local_len * ulysses * m * head_dim  # packed [k; v] after the all-to-all
    lse = batch * local_len * heads * acc
    out_and_lse = q_elems * elem + lse
    kept = out_and_lse + ((q_elems + kv_shard) * elem if ulysses > 1 else 0)
    working = q_elems * acc  # dq accumulator
    if ring > 1:
        if kv_exchange == "all_gather":  # gathered KV, every shard's partials, the one home
            working += ring * kv_shard * elem + (ring + 1) * kv_shard * acc
        else:
            # this rank's own packed [k; v] (sent to r + t at every step) and the inbox: one slot
            # at R = 2, else two (the next step's KV arrives while this step's is computed with)
            working += (1 + min(2, ring - 1)) * kv_shard * elem + 2 * kv_shard * acc  # + [dK; dV] double buffer
            if causal and layout == "zigzag":  # a later rank reads the first chunk only: staged for its message
                working += kv_shard // 2 * elem
        working += q_elems * acc + kv_shard * acc  # one block's gradients (each is added before the next runs)
    else:
        working += kv_shard * acc  # dk, dv
    if ulysses > 1:
        working += q_elems * elem  # dout in head layout
    return AttentionMemory(kept=kept, kept_checkpointed=out_and_lse + FINGERPRINT_BYTES, working=working)
