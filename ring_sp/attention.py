"""Public attention entry points: ring, Ulysses and the 2D ring x Ulysses grid.

All three run one function over a Ulysses group of ``U`` ranks and a ring group of ``R``
ranks (either may be absent = size 1):

1. Ulysses all-to-all (U > 1): sequence shard -> head shard, reordered into the ring's
   layout; KV heads are sent un-replicated when ``U`` divides ``h_kv``.
2. Ring attention over ``R`` ranks on ``H/U`` heads (R = 1 is plain local attention);
   ``kv_exchange="all_gather"`` gathers the ring group's KV once instead of rotating it.
3. The inverse all-to-all.

Before step 1, every rank checks its own arguments and then the ranks agree on them and on
any local error (one small all_gather per call; with ``validate=False`` once per new
signature, local errors then raising on their rank alone), so mistakes surface as a clear
error on every rank instead of a hang or an abort (:mod:`ring_sp.agreement`).

The input layout is defined over the whole SP group with
``sp_rank = ring_rank * U + ulysses_rank`` (DESIGN.md section 3), so
``shard_sequence(x, rank=sp_rank, world_size=U*R, layout=...)`` feeds every mode.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist

from .agreement import CallSignature, agree, validation_requested
from .function import UlyssesSpec, sequence_parallel_attention
from .kernels import get_kernel
from .layouts import AUTO, DOCUMENT_LAYOUTS, Boundaries, as_boundaries, check_boundaries, check_layout, ulysses_to_ring_reorder
from .plan.exchange_choice import choose_kv_exchange
from .plan.head_chunk_choice import choose_head_chunks
from .plan.layout_choice import resolve_layout
from .recompute import plan as recompute_plan
from .recompute import reuse_requested
from .ring import RingSpec, ring_comm_for
from .schedule_cache import schedule_cache
from .nodes import node_size_from_env, ring_inner_size
from .shapes import HEAD_CHUNKS_AUTO, check_ulysses_heads
from .spans import Spans, as_spans, check_spans
from .topology import SequenceParallelTopology
from .validation import (check_cu_seqlens, check_group, check_head_chunk_split, check_head_chunks, check_kv_exchange,
                         check_local_length, check_options, check_qkv, check_sinks, check_sliding_window,
                         resolve_scale)


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    causal: bool,
    layout: str,
    softmax_scale: float | None,
    backend: str,
    return_lse: bool,
    cu_seqlens: Boundaries | None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    kv_exchange: str = "ring",
    head_chunks: int | str | None = None,
    spans: Spans | None = None,
    node_size: int | None = None,
) -> tuple[RingSpec, UlyssesSpec | None, int]:
    """Every local check, then the plan of the call (its ring, its Ulysses side, its number of
    head chunks). Raises before any collective."""
    check_kv_exchange(kv_exchange)
    check_head_chunks(head_chunks)
    check_qkv(q, k, v)
    check_sinks(sinks, q)
    check_options(causal=causal, layout=layout, softmax_scale=softmax_scale, backend=backend)
    check_sliding_window(sliding_window, causal)
    u, r = _size(ulysses_group), _size(ring_group)
    global_len = q.shape[1] * u * r
    if layout == AUTO:  # the batch's placement, as shard_batch chose it from the same documents
        if cu_seqlens is not None:
            check_boundaries(cu_seqlens, global_len)
        layout = resolve_layout(layout, cu_seqlens, u * r)
    check_local_length(layout, q.shape[1], u * r)
    if cu_seqlens is not None or layout in DOCUMENT_LAYOUTS:
        check_layout(layout, u * r, global_len, name="the global length (q.shape[1] x SP size)", cu_seqlens=cu_seqlens)
    if spans is not None:
        check_spans(spans, global_len, cu_seqlens, causal=causal)
    if u > 1:
        check_ulysses_heads(q.shape[2], k.shape[2], u)
    if return_lse and u > 1:
        raise ValueError("return_lse=True is only supported without Ulysses (ulysses size 1): lse is head-sharded inside")
    ring_rank = dist.get_rank(ring_group) if ring_group is not None else 0
    reorder = ulysses_to_ring_reorder(layout, u, r, global_len, ring_rank, q.device, cu_seqlens) if u > 1 else None
    kernel = get_kernel(backend, q.device, q.dtype, q.shape[3], v.shape[3])
    # A window covering the whole sequence is plain causal attention: the same schedule, bit for bit.
    window = sliding_window if sliding_window is not None and sliding_window < global_len else None
    if kv_exchange == "auto":
        kv_exchange = _planned_kv_exchange(q, k, v, u, r, layout, causal, window)
    if head_chunks == HEAD_CHUNKS_AUTO:
        chunks = choose_head_chunks(ulysses=u, ring=r, batch=q.shape[0], local_len=q.shape[1], heads=q.shape[2],
                                    kv_heads=k.shape[2], head_dim=q.shape[3], value_head_dim=v.shape[3], dtype=q.dtype,
                                    layout=layout, causal=causal, sliding_window=window, kv_exchange=kv_exchange)
    else:
        chunks = 1 if head_chunks is None else head_chunks
    check_head_chunk_split(chunks, q.shape[2], k.shape[2], u)
    # a double ring: its inner rings hold each node's ring ranks (1 or R: the flat ring, step for step)
    inner = (ring_inner_size(dist.get_process_group_ranks(ring_group), node_size)
             if kv_exchange == "double_ring" and ring_group is not None else None)
    owner = ring_group if ring_group is not None else ulysses_group
    assert owner is not None  # every entry point passes one group at least
    ring = RingSpec(ring_comm_for(ring_group) if r > 1 else None, layout, causal, kernel,
                    resolve_scale(softmax_scale, q.shape[3]), q.shape[1] * u, cu_seqlens, window=window,
                    ulysses_size=u, schedules=schedule_cache(owner), kv_exchange=kv_exchange, spans=spans or None,
                    inner_size=inner)
    return ring, (UlyssesSpec(ulysses_group, u, reorder, kernel.head_major) if u > 1 else None), chunks


def _planned_kv_exchange(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: int, r: int, layout: str, causal: bool,
                         window: int | None) -> str:
    """``kv_exchange="auto"``: the planner's choice for this call's ring (the same on every
    rank: it depends only on the agreed shapes and options)."""
    if r == 1:
        return "ring"
    return choose_kv_exchange(ulysses=u, ring=r, batch=q.shape[0], local_len=q.shape[1], heads=q.shape[2],
                              kv_heads=k.shape[2], head_dim=q.shape[3], value_head_dim=v.shape[3], dtype=q.dtype,
                              layout=layout, causal=causal, sliding_window=window)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    agreement_group: dist.ProcessGroup,
    causal: bool,
    layout: str,
    softmax_scale: float | None,
    backend: str,
    return_lse: bool,
    validate: bool | None,
    cu_seqlens: torch.Tensor | list[int] | None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    reuse_on_recompute: bool | None = None,
    kv_exchange: str = "ring",
    head_chunks: int | str | None = None,
    spans: torch.Tensor | list[tuple[int, int]] | None = None,
    node_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check, agree over ``agreement_group`` (all ranks of the grid), then run the grid. ``node_size``:
    ranks per node (a topology's, else the launcher's), which a double ring's inner rings follow."""
    options = dict(causal=causal, layout=layout, softmax_scale=softmax_scale, backend=backend,
                   sliding_window=sliding_window, kv_exchange=kv_exchange, head_chunks=head_chunks,
                   node_size=node_size if kv_exchange == "double_ring" else None)
    always = validation_requested(validate)
    boundaries = span_pairs = None
    try:
        reuse = reuse_requested(reuse_on_recompute)
        check_cu_seqlens(cu_seqlens)
        boundaries = as_boundaries(cu_seqlens)
        span_pairs = as_spans(spans)
        ring, ulysses, chunks = _prepare(q, k, v, ulysses_group=ulysses_group, ring_group=ring_group,
                                         return_lse=return_lse, cu_seqlens=boundaries, sinks=sinks, spans=span_pairs,
                                         **options)
        error = None
    except (TypeError, ValueError, RuntimeError) as exc:
        if not always:
            raise  # opted out: this rank alone raises (its peers stop at the group timeout)
        error = exc  # every rank raises it, or its own, at the agreement
    if _size(agreement_group) > 1:
        signature = CallSignature.of(q, k, v, ulysses_size=_size(ulysses_group), ring_size=_size(ring_group),
                                     cu_seqlens=boundaries, sinks=sinks, spans=span_pairs, **options)
        agree(agreement_group, signature, error, always=always, device=_device(q))
    if error is not None:
        raise error
    # Everything the result depends on besides the values of q, k, v (ring_sp.recompute);
    # the sinks (a parameter: unchanged between a forward and its re-run) by identity and version.
    sinks_key = None if sinks is None else (sinks.shape, sinks.dtype, id(sinks), sinks._version)
    key = (tuple(sorted(options.items())), chunks, boundaries, span_pairs, id(ulysses_group),
           id(ring_group), *((t.shape, t.dtype, t.stride()) for t in (q, k, v)), q.device, sinks_key)
    recompute = recompute_plan(q, k, v, key, reuse)
    return sequence_parallel_attention(q, k, v, ring, ulysses, recompute, sinks, chunks)


def _device(q: object) -> torch.device:
    return q.device if isinstance(q, torch.Tensor) else torch.device("cpu")


def raise_on_every_rank(error: Exception, q: object, k: object, v: object, *,
                        topology: SequenceParallelTopology, causal: object = True, layout: object = "zigzag",
                        softmax_scale: object = None, backend: object = "auto", cu_seqlens: Boundaries | None = None,
                        sinks: object = None, sliding_window: object = None, validate: bool | None = None,
                        kv_exchange: object = "ring", head_chunks: object = None,
                        spans: Spans | None = None) -> NoReturn:
    """Raise ``error``, which an integration found checking THIS rank's inputs of a
    :func:`hybrid_attention` call it was about to make (same arguments).

    An input that is wrong on one rank only (another rank's shard, say) would leave the
    peers waiting in the call's first collective until the group's timeout. So, with
    validation on (the default; ``validate=False`` or ``RING_SP_VALIDATE=0`` turn it off),
    this rank first joins the call's agreement (:mod:`ring_sp.agreement`) with the error:
    every rank of the SP group raises, the same ``ValueError`` naming this rank (or, when
    every rank found an error, each its own). Without validation it raises here, alone.
    """
    if validation_requested(validate) and topology.sp_size > 1:
        signature = CallSignature.of(q, k, v, causal=causal, layout=layout, softmax_scale=softmax_scale, backend=backend,
                                     ulysses_size=topology.ulysses_size, ring_size=topology.ring_size,
                                     cu_seqlens=cu_seqlens, sinks=sinks, sliding_window=sliding_window,
                                     kv_exchange=kv_exchange, head_chunks=head_chunks, spans=spans,
                                     node_size=topology.node_size if kv_exchange == "double_ring" else None)
        agree(topology.sp_group, signature, error, always=True, device=_device(q))
    raise error


def _group_or_world(group: dist.ProcessGroup | None, name: str = "group") -> dist.ProcessGroup:
    check_group(group, name)
    return group if group is not None else dist.group.WORLD


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    validate: bool | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    reuse_on_recompute: bool | None = None,
    kv_exchange: str = "ring",
    head_chunks: int | str | None = None,
    spans: torch.Tensor | list[tuple[int, int]] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact ring attention over ``group`` (None = the default group).

    q ``[b, n, h, d]``, k ``[b, n, h_kv, d]``, v ``[b, n, h_kv, d_v]`` (``d_v`` may differ from
    ``d``: MLA): this rank's shard, sharded with
    ``shard_sequence(x, rank=group rank, world_size=group size, layout=layout)``.
    Returns out ``[b, n, h, d_v]`` in q's dtype; with ``return_lse`` also lse ``[b, h, n]``
    (float32; with sinks it includes them). Only KV heads travel (GQA/MQA); dK/dV are
    accumulated in fp32.
    ``validate``: agree on the arguments (and any local error) across ranks on every call,
    so an error on one rank is raised on all (default: on; ``False`` or ``RING_SP_VALIDATE=0``
    agree once per new shape and raise local errors on their rank alone).
    ``cu_seqlens``: packed sequences - int ``[num_docs + 1]`` boundaries of the documents
    in the GLOBAL sequence, the same on every rank; a token attends only inside its own
    document (``layout="document_zigzag"`` balances causal work for any document mix).
    ``spans``: bidirectional spans inside causal documents (image tokens, a prefix-LM's
    prefix): int ``[num_spans, 2]`` (start, stop) GLOBAL positions, or a list of pairs, the
    same on every rank, sorted, disjoint, each inside one document; a query in a span also
    sees the span's later tokens (:mod:`ring_sp.spans`; transformers' block ids convert with
    :func:`ring_sp.spans.spans_from_block_ids`). Needs ``causal=True``; works with every
    layout, ``cu_seqlens`` and ``sliding_window`` (which never hides a span's later tokens).
    Exact, no mask tensor, and the same KV exchange as without spans (with a window, the halo
    also carries the span keys a rank's queries see).
    ``sinks``: attention sinks, a float tensor ``[h]`` with one learned logit per query head
    (gpt-oss): every row's softmax denominator gets ``exp(sinks[head])`` added, with no
    value. Its gradient is this rank's share; the sum over the SP ranks is the whole one.
    ``sliding_window``: causal sliding-window attention, query at global position ``i``
    sees key ``j`` iff ``i - sliding_window < j <= i`` (transformers' meaning: that many
    keys, itself included; with ``cu_seqlens`` also the same document). Ranks then exchange
    KV and dK/dV only with the ranks holding keys inside some query's window (a halo);
    pairs with nothing to compute neither compute nor communicate. Needs ``causal=True``.
    ``reuse_on_recompute``: when activation checkpointing re-runs this call in backward,
    reuse the first run's output and lse instead of running the ring again (default on;
    ``RING_SP_REUSE_ON_RECOMPUTE=0`` turns it off globally; see :mod:`ring_sp.recompute`).
    ``kv_exchange``: how the ring group exchanges KV. ``"ring"`` (default) rotates the shards
    step by step; ``"all_gather"`` gathers every rank's (un-replicated) KV shard once, in one
    collective overlapped with the own block's compute, computes the same blocks of the same
    schedule against it, and reduce-scatters the fp32 dK/dV once (fewer steps and messages;
    holds ``R`` KV shards and ``R`` fp32 dK/dV shards in backward); ``"auto"``: the planner's
    choice for the call's shapes (:func:`ring_sp.planner.choose_kv_exchange`); ``"double_ring"``:
    a ring that spans nodes runs as an inner ring in each node, each shard crossing to every
    other node once (:mod:`ring_sp.schedule.ring_order`; the node size from the launcher's
    environment here, from the topology in :func:`hybrid_attention`). Every option above works
    with each.
    ``head_chunks``: run the call's heads in that many chunks (None or 1: all at once), each of
    whole GQA groups, so the all-to-all and ring buffers and the fp32 accumulators exist for one
    chunk at a time (results and bytes sent are the unchunked ones). It must divide the KV
    heads a rank holds (``h_kv``, or ``h_kv / U`` after the Ulysses split; 1 when U > h_kv
    replicates them). ``"auto"``: the planner's choice for the call's shapes
    (:func:`ring_sp.plan.head_chunk_choice.choose_head_chunks`).
    """
    ring_group = _group_or_world(group)
    out, lse = _attention(q, k, v, ulysses_group=None, ring_group=ring_group, agreement_group=ring_group,
                          causal=causal, layout=layout, softmax_scale=softmax_scale, backend=backend,
                          return_lse=return_lse, validate=validate, cu_seqlens=cu_seqlens, sinks=sinks,
                          sliding_window=sliding_window, reuse_on_recompute=reuse_on_recompute,
                          kv_exchange=kv_exchange, head_chunks=head_chunks, spans=spans,
                          node_size=node_size_from_env() if kv_exchange == "double_ring" else None)
    return (out, lse) if return_lse else out


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    backend: str = "auto",
    validate: bool | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    reuse_on_recompute: bool | None = None,
    head_chunks: int | str | None = None,
    spans: torch.Tensor | list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses attention over ``group`` (None = the default group).

    q ``[b, n, h, d]``, k/v ``[b, n, h_kv, d]``, sharded by ``layout`` over the group
    (every layout works: the all-to-all output is put back in natural order). Needs
    ``h % U == 0`` and ``h_kv % U == 0`` or ``U % h_kv == 0`` (KV heads are then
    replicated only to the ranks that need them). Returns ``[b, n, h, d_v]``.
    ``validate``, ``cu_seqlens``, ``spans``, ``sliding_window``, ``reuse_on_recompute``,
    ``head_chunks`` and ``sinks`` (all ``h`` heads on every rank; each rank's ``sinks.grad``
    holds its ``h/U`` heads' share, zeros elsewhere): as in :func:`ring_attention`.
    """
    ulysses_group = _group_or_world(group)
    return _attention(q, k, v, ulysses_group=ulysses_group, ring_group=None, agreement_group=ulysses_group,
                      causal=causal, layout=layout, softmax_scale=softmax_scale, backend=backend,
                      return_lse=False, validate=validate, cu_seqlens=cu_seqlens, sinks=sinks,
                      sliding_window=sliding_window, reuse_on_recompute=reuse_on_recompute,
                      head_chunks=head_chunks, spans=spans)[0]


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    topology: SequenceParallelTopology,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: float | None = None,
    backend: str = "auto",
    validate: bool | None = None,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    reuse_on_recompute: bool | None = None,
    kv_exchange: str = "ring",
    head_chunks: int | str | None = None,
    spans: torch.Tensor | list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """2D ring x Ulysses attention over ``topology``'s ``U x R`` grid.

    q ``[b, n, h, d]``, k/v ``[b, n, h_kv, d]``: this rank's shard, sharded with
    ``shard_sequence(x, rank=topology.sp_rank, world_size=topology.sp_size, layout=layout)``.
    Ulysses all-to-all over U (heads must split: ``h % U == 0``), ring attention over R
    on ``h/U`` heads with un-replicated KV, then back. ``contiguous`` and ``zigzag`` work
    for every ``U x R``; ``striped`` when U == 1 or R == 1. Returns ``[b, n, h, d_v]``.
    ``validate``, ``cu_seqlens``, ``spans``, ``sliding_window``, ``sinks`` and ``reuse_on_recompute``:
    as in :func:`ring_attention` and :func:`ulysses_attention` (``document_zigzag`` works
    for every ``U x R``). ``kv_exchange``: as in :func:`ring_attention`, over the ring group
    (after the Ulysses all-to-all: the ``h_kv / U`` KV heads are gathered, never q-replicated).
    ``head_chunks``: as in :func:`ring_attention` (chunks of the ``h_kv / U`` KV heads a rank holds).
    """
    if not isinstance(topology, SequenceParallelTopology):
        raise TypeError(
            f"topology must be a SequenceParallelTopology from ring_sp.init_sequence_parallel; "
            f"got {type(topology).__name__}"
        )
    return _attention(q, k, v, ulysses_group=topology.ulysses_group, ring_group=topology.ring_group,
                      agreement_group=topology.sp_group, causal=causal, layout=layout, softmax_scale=softmax_scale,
                      backend=backend, return_lse=False, validate=validate, cu_seqlens=cu_seqlens, sinks=sinks,
                      sliding_window=sliding_window, reuse_on_recompute=reuse_on_recompute,
                      kv_exchange=kv_exchange, head_chunks=head_chunks, spans=spans, node_size=topology.node_size)[0]
