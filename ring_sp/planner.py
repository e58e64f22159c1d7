"""The performance model behind ``ring-sp plan`` (DESIGN.md sections 5 and 8).

Given a cluster, a model and a sequence, :func:`plan` lists every ``U x R`` split of the
sequence-parallel degree that ring_sp can run, with placement and layout, and models
for each one, per rank and per attention layer:

* bytes sent, per kind of call, exactly as :func:`ring_sp.count_communication` records
  them (:func:`layer_bytes`; the benchmark and ``tests/test_plan.py`` check this against
  real runs);
* time: the Ulysses all-to-alls (not overlapped) plus the ring, whose steps run in
  lockstep, each lasting ``max(compute, transfer)`` when the next exchange is in flight
  during the current compute (the overlap of DESIGN.md section 4);
* activation memory kept for backward over all layers, and the ring's working buffers;
* the ring group's KV exchange (``kv_exchange``): the ring, or one all-gather of the KV
  shards overlapped with the own block and one reduce-scatter of the fp32 dK/dV
  (:func:`_gather_ring_seconds`); :func:`choose_kv_exchange` is ``kv_exchange="auto"``.

Bandwidth model plus one fixed cost per synchronising exchange (``Cluster.latency``: the
message's latency and the lockstep wait of a ring step; 0 = bandwidth only). In a pure
bandwidth model a pipelined ring is never slower than gathering (same bytes, every step
overlapped); the all-gather wins where the ring's ``R - 1`` (forward) and ``R`` (backward)
synchronising steps cost more than their transfers: few KV heads (GQA 8:1, MLA), short
chunks, sliding windows whose halo is every rank (striped), ``R = 2``. The CLI's defaults are
nominal datasheet figures (:mod:`ring_sp.plan`); pass measured ones (nccl-tests bus
bandwidth, a flash-attention benchmark) for real predictions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from .attention import check_ulysses_heads
from .kernels import softmax_stat_dtype
from .layouts import check_layout, ulysses_to_ring_order
from .recompute import FINGERPRINT_BYTES
from .schedule import exchange_plan, ring_step_tasks
from .topology import PLACEMENTS, rank_grid
from .ulysses import kv_heads_per_rank
from .validation import KV_EXCHANGES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}

# FlashAttention-2 backward does 5 matmuls of the forward's size to the forward's 2 (Dao 2023).
BACKWARD_FLOP_RATIO = 2.5
# Korthikanti et al. 2022 (arXiv:2205.05198) eq. 1: a transformer layer keeps s*b*h*(34 + 5*a*s/h)
# bytes of 16-bit activations for backward; flash attention never stores the 5*a*s/h score terms.
LAYER_ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34


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


@dataclass(frozen=True)
class Candidate:
    """One ``U x R`` configuration and what the model says about it (per rank, per layer
    unless named otherwise; seconds and bytes)."""

    ulysses: int
    ring: int
    placement: str
    layout: str
    bytes_fwd: dict[str, int]
    bytes_bwd: dict[str, int]
    ulysses_link: str  # "intra", "inter" or "-" (no Ulysses)
    ring_link: str
    ring_chunk: int  # tokens each ring rank holds after the all-to-all: N / R
    min_chunk_fwd: int  # the ring chunk at which a forward / backward step hides its transfer
    min_chunk_bwd: int
    hides_fwd: bool
    hides_bwd: bool
    a2a_fwd_s: float
    a2a_bwd_s: float
    ring_fwd_s: float
    ring_bwd_s: float
    activation_bytes: float  # all layers' tensors kept for backward
    working_bytes: float  # ring buffers and fp32 accumulators of the attention being computed
    notes: tuple[str, ...] = ()
    kv_exchange: str = "ring"  # "ring" or "all_gather" (ring_sp.attention's kv_exchange)

    @property
    def label(self) -> str:
        return f"U={self.ulysses} x R={self.ring}{' all_gather' if self.kv_exchange == 'all_gather' else ''}"

    @property
    def layer_s(self) -> float:
        """Modelled forward + backward attention time of one layer."""
        return self.a2a_fwd_s + self.ring_fwd_s + self.a2a_bwd_s + self.ring_bwd_s

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_fwd.values()) + sum(self.bytes_bwd.values())

    @property
    def memory_bytes(self) -> float:
        return self.activation_bytes + self.working_bytes


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    model: ModelShape
    workload: Workload
    sp_size: int
    candidates: tuple[Candidate, ...]  # fastest first
    recommended: Candidate
    warnings: tuple[str, ...] = field(default=())


def dtype_bytes(dtype: str) -> tuple[int, int]:
    """(element bytes, bytes of the softmax-statistics / gradient-accumulator dtype)."""
    if dtype not in DTYPES:
        raise PlanError(f"dtype={dtype!r} is not one of {sorted(set(DTYPES))}")
    torch_dtype = DTYPES[dtype]
    return torch_dtype.itemsize, softmax_stat_dtype(torch_dtype).itemsize


def ring_halo_rows(layout: str, ring: int, chunk: int, window: int | None, ring_rank: int,
                   causal: bool = True) -> tuple[int, int]:
    """(KV rows ring rank ``ring_rank`` sends, dK/dV partial rows it sends home) in one layer
    with a sliding ``window`` (``chunk`` = N / R tokens per ring rank), summed over the steps:
    the rows its partners read (:func:`ring_sp.schedule.exchange_plan`)."""
    plan_ = exchange_plan(layout, causal, ring_rank, ring, chunk, None, window)
    rows = lambda spans: sum(b - a for a, b in (r for r in spans[1:] if r is not None))  # noqa: E731
    return rows(plan_.send_rows), rows(plan_.recv_rows)


def layer_bytes(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int, head_dim: int,
                dtype: str, value_head_dim: int | None = None, layout: str = "zigzag", causal: bool = True,
                sliding_window: int | None = None, ring_rank: int | None = None,
                kv_exchange: str = "ring") -> tuple[dict[str, int], dict[str, int]]:
    """Bytes ONE rank sends in one attention layer, forward and backward, keyed by the kinds
    :func:`ring_sp.count_communication` records (DESIGN.md section 5 as implemented).

    ``local_len`` = N / (U * R) tokens per rank. Ulysses: each all-to-all keeps ``1/U`` of its
    input; KV heads travel packed, replicated when ``U > kv_heads`` (their gradients then
    return in fp32). Ring: ``R - 1`` exchanges of the packed ``[k; v]`` shard of ``N / R``
    tokens forward and backward, plus ``R`` exchanges of its ``[dk; dv]`` accumulator: fp32
    while it collects, the input dtype on the last hop home (fp32 again when replicated).
    ``value_head_dim`` (None = ``head_dim``): v, out and dout carry it, q/k/dq ``head_dim``;
    a packed KV message holds ``head_dim + value_head_dim`` per KV head and token.

    With a ``sliding_window`` shorter than N (``layout`` and ``causal`` then matter) the ring
    part is the halo: the packed rows a rank's partners read go only to them, and each fp32
    dK/dV partial of those rows straight home (:func:`ring_halo_rows`), for ring rank ``ring_rank``
    or, when None, each kind's maximum over the ring ranks (a bound for every rank; with
    contiguous, rank 0 sends the only KV shard and rank 1 the only partial). Kinds with
    nothing sent are left out.

    ``kv_exchange="all_gather"``: every rank's packed KV shard reaches the ``R - 1`` others,
    forward and again in backward (``allgather_kv``), and the fp32 ``[dk; dv]`` partials of
    every shard are reduce-scattered home (``reduce_scatter_dkv``: ``R - 1`` shards), with or
    without a window.
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
    windowed = sliding_window is not None and sliding_window < local_len * ulysses * ring
    if ring > 1 and kv_exchange == "all_gather":
        kv_shard = batch * local_len * ulysses * m * (head_dim + d_v)
        fwd["allgather_kv"] = bwd["allgather_kv"] = (ring - 1) * kv_shard * elem
        bwd["reduce_scatter_dkv"] = (ring - 1) * kv_shard * acc
    elif ring > 1 and windowed:
        kv_row = batch * m * (head_dim + d_v)  # elements of one packed [k; v] token
        counts = {r: ring_halo_rows(layout, ring, local_len * ulysses, sliding_window, r, causal) for r in range(ring)}
        kv_rows, dkv_rows = counts[ring_rank] if ring_rank is not None else (
            max(c[0] for c in counts.values()), max(c[1] for c in counts.values()))
        if kv_rows:
            fwd["ring_kv"] = bwd["ring_kv"] = kv_rows * kv_row * elem
        if dkv_rows:
            bwd["ring_dkv"] = dkv_rows * kv_row * acc
    elif ring > 1:
        kv_shard = batch * local_len * ulysses * m * (head_dim + d_v)
        fwd["ring_kv"] = bwd["ring_kv"] = (ring - 1) * kv_shard * elem
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
    the ring's own packed KV shard and its inbox (one slot at ``R = 2``, else two), the fp32
    [dK; dV] double buffer, ONE block's gradients (each block's are added before the next
    block runs; the largest, zigzag's first step, is one q shard + one KV shard in fp32),
    and with Ulysses the head-sharded dout and the dk/dv of the all-to-all.
    """

    kept: int
    kept_checkpointed: int
    working: int


def attention_memory(*, ulysses: int, ring: int, batch: int, local_len: int, heads: int, kv_heads: int,
                     head_dim: int, dtype: str, kv_exchange: str = "ring") -> AttentionMemory:
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
        working += q_elems * acc + kv_shard * acc  # one block's gradients (each is added before the next runs)
    else:
        working += kv_shard * acc  # dk, dv
    if ulysses > 1:
        working += q_elems * elem  # dout in head layout
    return AttentionMemory(kept=kept, kept_checkpointed=out_and_lse + FINGERPRINT_BYTES, working=working)


@dataclass(frozen=True)
class _Placement:
    """Where a grid's groups fall on the nodes: which link each dimension's slowest pair uses
    ('intra', 'inter' or '-' when absent), and every (intra-node, inter-node) peer count a
    Ulysses rank has."""

    ulysses_link: str
    ring_link: str
    peer_mixes: frozenset[tuple[int, int]]

    @staticmethod
    def of(ulysses: int, ring: int, placement: str, cluster: Cluster) -> _Placement:
        grid = rank_grid(cluster.world_size, ulysses, ring, placement)

        def nodes(group: list[int]) -> list[int]:
            return [p // cluster.gpus_per_node for p in group]

        def link(groups: list[list[int]]) -> str:  # a ring's neighbours are among its group's pairs
            return "-" if len(groups[0]) == 1 else "inter" if any(len(set(nodes(g))) > 1 for g in groups) else "intra"

        mixes = frozenset((at.count(mine) - 1, len(at) - at.count(mine))
                          for at in map(nodes, grid.ulysses_groups) for mine in at)
        return _Placement(link(grid.ulysses_groups), link(grid.ring_groups), mixes)

    def a2a_seconds(self, nbytes: int, cluster: Cluster) -> float:
        """An all-to-all in which every rank sends ``nbytes`` in equal parts to its peers;
        intra- and inter-node peers use separate links, the slowest rank sets the time."""
        local, remote = next(iter(self.peer_mixes))
        per_peer = nbytes / (local + remote)  # every rank has U - 1 peers
        return max(max(local * per_peer / cluster.intra_bw, remote * per_peer / cluster.inter_bw)
                   for local, remote in self.peer_mixes)


def _step_pairs(layout: str, causal: bool, ring: int, chunk: int) -> list[int]:
    """(query, key) pairs the slowest ring rank computes at each step. The ring runs in
    lockstep (a step's KV comes from the predecessor's previous step), so a step lasts as
    long as its slowest rank; for every built-in layout ranks 0 and R-1 are the extremes."""
    return [
        max(sum(t.visible_pairs() for t in ring_step_tasks(layout, causal, r, (r - step) % ring, chunk))
            for r in {0, ring - 1})
        for step in range(ring)
    ]


def _window_ring_seconds(layout: str, ring: int, chunk: int, window: int, flops_per_pair: float, flops: float,
                         kv_s: float, dkv_s: float) -> tuple[float, float, bool, bool]:
    """(forward, backward) ring seconds with a sliding window, and whether every transfer
    hides behind compute (forward, backward): each step lasts as long as its slowest rank's
    compute or the transfer in flight meanwhile (the next step's KV, forward; plus this
    step's dK/dV partials, backward); steps where no rank computes cost nothing, and the last
    partials home are exposed."""
    plans = [exchange_plan(layout, True, r, ring, chunk, None, window) for r in range(ring)]
    compute = [max(sum(t.visible_pairs() for t in p.schedule[step]) for p in plans) * flops_per_pair / flops
               for step in range(ring)]
    # the fraction of a shard the largest message of each step carries (0: no message)
    moves = [0.0] + [max((b - a) / chunk for p in plans if p.recv_rows[step] is not None
                         for a, b in [p.recv_rows[step]]) if any(p.receives[step] for p in plans) else 0.0
                     for step in range(1, ring)] + [0.0]
    fwd = sum(max(compute[t], kv_s * moves[t + 1]) for t in range(ring))
    bwd_transfer = [kv_s * moves[t + 1] + dkv_s * moves[t] for t in range(ring)]
    bwd = sum(max(BACKWARD_FLOP_RATIO * compute[t], bwd_transfer[t]) for t in range(ring))
    hides_fwd = all(compute[t] >= kv_s * moves[t + 1] for t in range(ring))
    hides_bwd = all(BACKWARD_FLOP_RATIO * compute[t] >= bwd_transfer[t] for t in range(ring))
    last = max((t for t in range(ring) if moves[t]), default=None)
    return fwd, bwd + (dkv_s * moves[last] if last is not None else 0.0), hides_fwd, hides_bwd


def _gather_ring_seconds(layout: str, causal: bool, ring: int, chunk: int, window: int | None,
                         flops_per_pair: float, flops: float, kv_s: float, dkv_s: float,
                         latency: float) -> tuple[float, float, bool, bool]:
    """(forward, backward) seconds of ``kv_exchange="all_gather"`` and whether the gathers
    hide: each rank computes its own (diagonal) block while the ``R - 1`` shards arrive, then
    the blocks of the same schedule against the others; in backward the re-gather hides the
    same way and the fp32 reduce-scatter of ``R - 1`` shards comes after. The slowest rank
    sets the time (the collectives synchronise the ranks)."""
    gather, scatter = (ring - 1) * kv_s + latency, (ring - 1) * dkv_s + latency
    fwd = bwd = 0.0
    hides_fwd = hides_bwd = True
    for rank in range(ring):
        pairs = [sum(t.visible_pairs() for t in tasks)
                 for tasks in exchange_plan(layout, causal, rank, ring, chunk, None, window).schedule]
        own, rest = pairs[0] * flops_per_pair / flops, sum(pairs[1:]) * flops_per_pair / flops
        fwd = max(fwd, max(own, gather) + rest)
        bwd = max(bwd, max(BACKWARD_FLOP_RATIO * own, gather) + BACKWARD_FLOP_RATIO * rest + scatter)
        hides_fwd, hides_bwd = hides_fwd and own >= gather, hides_bwd and BACKWARD_FLOP_RATIO * own >= gather
    return fwd, bwd, hides_fwd, hides_bwd


def _candidate(ulysses: int, ring: int, placement: str, layout: str, cluster: Cluster, model: ModelShape,
               work: Workload, sp_size: int, kv_exchange: str = "ring") -> Candidate:
    elem, acc = dtype_bytes(work.dtype)
    b, d = work.batch, model.head_dim
    d_v = d if model.value_head_dim is None else model.value_head_dim
    local_len, chunk = work.seq_len // sp_size, work.seq_len // ring
    heads_here, m = model.heads // ulysses, kv_heads_per_rank(model.kv_heads, ulysses)
    window = work.sliding_window if work.sliding_window is not None and work.sliding_window < work.seq_len else None
    fwd_bytes, bwd_bytes = layer_bytes(ulysses=ulysses, ring=ring, batch=b, local_len=local_len, heads=model.heads,
                                       kv_heads=model.kv_heads, head_dim=d, dtype=work.dtype, layout=layout,
                                       causal=work.causal, sliding_window=window, value_head_dim=d_v,
                                       kv_exchange=kv_exchange)
    where = _Placement.of(ulysses, ring, placement, cluster)
    ring_bw = cluster.inter_bw if where.ring_link == "inter" else cluster.intra_bw
    a2a_fwd, a2a_bwd = (sum(where.a2a_seconds(v, cluster) for k, v in sent.items() if k.startswith("ulysses"))
                        for sent in (fwd_bytes, bwd_bytes))

    kv_shard = b * chunk * m * (d + d_v)  # elements of one packed [k; v] ring message
    kv_s, dkv_s = kv_shard * elem / ring_bw, kv_shard * acc / ring_bw
    flops_per_pair = 4 * d * heads_here * b  # q.k and p.v over every local head (DESIGN section 8)
    compute = [pairs * flops_per_pair / cluster.flops for pairs in _step_pairs(layout, work.causal, ring, chunk)]
    fwd_steps = [max(c, kv_s) for c in compute[:-1]] + [compute[-1]]
    bwd_steps = [max(BACKWARD_FLOP_RATIO * c, kv_s + dkv_s) for c in compute[:-1]] + [BACKWARD_FLOP_RATIO * compute[-1]]
    ring_fwd = sum(fwd_steps)
    ring_bwd = sum(bwd_steps) + (dkv_s if ring > 1 else 0.0)  # the last [dk; dv] goes home after the compute
    # Transfer time grows as c and compute as c^2: a step hides its transfer from this chunk on
    # (DESIGN section 8: c >= (F/B) (H_kv/H) (bytes/2) per full step, twice that per causal half step).
    hardest = min(compute[:-1], default=0.0)  # the overlapped step with the least compute
    hides_fwd, hides_bwd = ring == 1 or hardest >= kv_s, ring == 1 or BACKWARD_FLOP_RATIO * hardest >= kv_s + dkv_s
    if window is not None:  # (the min-chunk figures stay those of the full ring)
        ring_fwd, ring_bwd, hides_fwd, hides_bwd = _window_ring_seconds(layout, ring, chunk, window, flops_per_pair,
                                                                        cluster.flops, kv_s, dkv_s)
    if ring > 1 and kv_exchange == "all_gather":
        ring_fwd, ring_bwd, hides_fwd, hides_bwd = _gather_ring_seconds(
            layout, work.causal, ring, chunk, window, flops_per_pair, cluster.flops, kv_s, dkv_s, cluster.latency)
    elif ring > 1 and cluster.latency:  # every step that moves KV synchronises (and one more sends dK/dV home)
        moving = (ring - 1 if window is None else
                  sum(any(exchange_plan(layout, True, r, ring, chunk, None, window).receives[t] for r in range(ring))
                      for t in range(1, ring)))
        ring_fwd += moving * cluster.latency
        ring_bwd += (moving + 1) * cluster.latency
    # (rounded first: float noise must not turn an exact 4945.0 into 4946)
    min_fwd = math.ceil(round(kv_s * chunk / hardest, 6)) if ring > 1 else 0
    min_bwd = math.ceil(round((kv_s + dkv_s) * chunk / (BACKWARD_FLOP_RATIO * hardest), 6)) if ring > 1 else 0

    n_tokens = b * local_len
    layer_act = LAYER_ACTIVATION_BYTES_PER_TOKEN_HIDDEN * n_tokens * model.hidden * elem / 2
    memory = attention_memory(ulysses=ulysses, ring=ring, batch=b, local_len=local_len, heads=model.heads,
                              kv_heads=model.kv_heads, head_dim=d, dtype=work.dtype, kv_exchange=kv_exchange)
    # Korthikanti's 34 already counts the attention output (the projection's input): beyond it
    # ring_sp keeps lse, and with Ulysses the head-sharded q, k/v and out.
    saved = memory.kept - (n_tokens * model.heads * d * elem if ulysses == 1 else 0)
    working = memory.working

    notes = []
    if where.ulysses_link == "inter":
        notes.append("Ulysses all-to-all crosses nodes")
    if model.kv_heads % ulysses != 0:
        notes.append(f"KV heads replicated {ulysses // model.kv_heads}x")
    if layout == "contiguous" and work.causal and ring > 1 and window is None:
        notes.append("causal work unbalanced (~2x)")
    if ring > 1 and kv_exchange == "all_gather":
        notes.append(f"KV all-gathered: {ring} KV shards held in backward")
    elif window is not None and ring > 1:
        notes.append(f"sliding window {window}: {fwd_bytes.get('ring_kv', 0) / (kv_shard * elem):.2f} KV shards "
                     f"sent instead of {ring - 1}")
    return Candidate(
        ulysses, ring, placement, layout, fwd_bytes, bwd_bytes, where.ulysses_link, where.ring_link, chunk, min_fwd,
        min_bwd,
        hides_fwd=hides_fwd, hides_bwd=hides_bwd,
        a2a_fwd_s=a2a_fwd, a2a_bwd_s=a2a_bwd, ring_fwd_s=ring_fwd, ring_bwd_s=ring_bwd,
        activation_bytes=model.layers * (layer_act + saved), working_bytes=working, notes=tuple(notes),
        kv_exchange=kv_exchange,
    )


def _positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name.replace('_', '-')}={value!r} must be a positive integer")


def _layout_for(layout: str, causal: bool, ulysses: int, ring: int, seq_len: int) -> str:
    """The layout a candidate uses (``auto``: zigzag for causal attention where the length
    allows, else striped or contiguous); raises ValueError with the reason if none works."""
    sp = ulysses * ring
    if layout == "auto":
        options = ("zigzag", "striped", "contiguous") if causal else ("contiguous",)
        reasons = []
        for option in options:
            try:
                return _layout_for(option, causal, ulysses, ring, seq_len)
            except ValueError as exc:
                reasons.append(str(exc))
        raise ValueError(reasons[0])
    check_layout(layout, sp, seq_len, name="seq-len")
    ulysses_to_ring_order(layout, ulysses, ring, 2 * sp, 0)  # raises for striped on a U > 1, R > 1 grid
    return layout


def plan(cluster: Cluster, model: ModelShape, work: Workload, *, ulysses: int | None = None,
         placement: str | None = None, layout: str = "auto", kv_exchange: str = "ring") -> Plan:
    """Every runnable ``U x R`` (``ulysses`` / ``placement`` pin them), modelled, fastest first;
    ``kv_exchange``: the ring group's exchange, "ring" (default here), "all_gather", or "auto"
    (both, as candidates of their own; the ``ring-sp plan`` CLI's default).

    Raises :class:`PlanError` naming the problem when nothing can run.
    """
    sp = work.sp_size if work.sp_size is not None else cluster.world_size
    _positive(world_size=cluster.world_size, gpus_per_node=cluster.gpus_per_node, sp_size=sp, heads=model.heads,
              kv_heads=model.kv_heads, head_dim=model.head_dim, hidden=model.hidden, layers=model.layers,
              seq_len=work.seq_len, batch=work.batch)
    dtype_bytes(work.dtype)
    if work.sliding_window is not None:
        _positive(sliding_window=work.sliding_window)
        if not work.causal:
            raise PlanError(f"sliding-window={work.sliding_window} needs causal attention; drop --non-causal")
    if cluster.world_size % sp != 0:
        raise PlanError(f"sp-size={sp} does not divide world-size={cluster.world_size}: the world is split into "
                        f"data-parallel replicas of sp-size ranks; choose a divisor of {cluster.world_size}")
    if cluster.world_size > cluster.gpus_per_node and cluster.world_size % cluster.gpus_per_node != 0:
        raise PlanError(f"world-size={cluster.world_size} is not a whole number of nodes of "
                        f"gpus-per-node={cluster.gpus_per_node}")
    if model.heads % model.kv_heads != 0:
        raise PlanError(f"heads={model.heads} must be a multiple of kv-heads={model.kv_heads} (GQA/MQA groups)")
    if layout == "auto" and work.seq_len % sp != 0:
        raise PlanError(f"seq-len={work.seq_len} must be a multiple of the SP degree {sp} (of {2 * sp} for the zigzag "
                        f"layout); pad the sequence to a multiple of {2 * sp}")
    if layout != "auto":
        try:
            check_layout(layout, sp, work.seq_len, name="seq-len")
        except ValueError as exc:
            raise PlanError(str(exc)) from None
    if kv_exchange not in KV_EXCHANGES:
        raise PlanError(f"kv-exchange={kv_exchange!r} is not one of {KV_EXCHANGES}")
    exchanges = ("ring", "all_gather") if kv_exchange == "auto" else (kv_exchange,)
    if placement is not None and placement not in PLACEMENTS:
        raise PlanError(f"placement={placement!r} is not one of {PLACEMENTS}")
    if ulysses is not None:
        _positive(ulysses=ulysses)
        if sp % ulysses != 0:
            raise PlanError(f"ulysses={ulysses} must divide the SP degree {sp} (ring size = {sp} / ulysses)")
        try:
            check_ulysses_heads(model.heads, model.kv_heads, ulysses)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        if placement == "ulysses_inner" and _Placement.of(ulysses, sp // ulysses, placement,
                                                          cluster).ulysses_link == "inter":
            raise PlanError(f"ulysses={ulysses} with placement ulysses_inner does not fit in a node of "
                            f"{cluster.gpus_per_node} GPUs: its all-to-all would cross nodes; use a ulysses size "
                            f"dividing {cluster.gpus_per_node}, or placement ring_inner")

    candidates, skipped = [], []
    for u in ([ulysses] if ulysses is not None else [u for u in range(1, sp + 1) if sp % u == 0]):
        r = sp // u
        try:
            if u > 1:
                check_ulysses_heads(model.heads, model.kv_heads, u)
            chosen = [_layout_for(layout, work.causal, u, r, work.seq_len)]
        except ValueError as exc:
            skipped.append(f"U={u} x R={r}: {exc}")
            continue
        if layout == "auto" and work.sliding_window is not None and r > 1 and chosen != ["contiguous"]:
            chosen.append("contiguous")  # a window balances causal work by itself: contiguous may win on bytes
        options = [_candidate(u, r, p, lay, cluster, model, work, sp, x) for lay in chosen for p in ([placement] if placement
                   else PLACEMENTS if u > 1 and r > 1 else ["ulysses_inner"]) for x in (exchanges if r > 1 else ("ring",))]
        # placements that put every group on the same links (one node, say) are one candidate: the default
        same = [(c.layout, c.kv_exchange, c.ulysses_link, c.ring_link, c.layer_s) for c in options]
        candidates += [c for i, c in enumerate(options) if same[i] not in same[:i]]
    if not candidates:
        raise PlanError("no U x R split can run this request:\n  " + "\n  ".join(skipped))

    candidates.sort(key=lambda c: c.layer_s)
    # Within 1% of the fastest, the model cannot tell: prefer the ring's exchange (less memory),
    # then fewer bytes, then the default placement.
    close = [c for c in candidates if c.layer_s <= 1.01 * candidates[0].layer_s]
    best = min(close, key=lambda c: (c.kv_exchange != "ring", c.total_bytes, c.placement != "ulysses_inner"))
    warnings = _warnings(candidates, best, cluster, pinned=ulysses is not None)
    if layout == "auto" and work.causal and work.seq_len % (2 * sp) != 0:
        warnings.append(f"seq-len={work.seq_len} is not a multiple of 2 x SP = {2 * sp}, so zigzag is impossible: "
                        f"grids fall back to contiguous (unbalanced causal work); pad to a multiple of {2 * sp}")
    return Plan(cluster, model, work, sp, tuple(candidates), best, tuple(warnings))


def _warnings(candidates: list[Candidate], best: Candidate, cluster: Cluster, pinned: bool) -> list[str]:
    warnings = []
    if not pinned and all(c.ulysses == 1 for c in candidates) and not (best.hides_fwd and best.hides_bwd):
        warnings.append(
            f"only the pure ring can run (no Ulysses size > 1 splits the heads), and its steps do not hide their "
            f"communication: each ring rank holds {best.ring_chunk} tokens, hiding needs >= {best.min_chunk_fwd} "
            f"(forward) / {best.min_chunk_bwd} (backward). Still exact, just communication-bound; longer sequences "
            f"or a smaller SP degree help")
    elif any(c.ring > 1 for c in candidates) and not any(c.hides_fwd and c.hides_bwd for c in candidates):
        warnings.append("no candidate with a ring hides its communication at this sequence length")
    if best.memory_bytes > cluster.memory_bytes:
        warnings.append(
            f"the recommended split keeps {best.memory_bytes / 2**30:.1f} GiB of activations per GPU, more than its "
            f"{cluster.memory_bytes / 2**30:.0f} GiB (weights and optimizer state not counted): raise the SP degree "
            f"or recompute activations")
    return warnings


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
        from .plan import nominal_cluster  # (plan imports this module)

        cluster = nominal_cluster(ulysses * ring)
    name = next(key for key, value in DTYPES.items() if value == dtype and len(key) <= 4)
    model = ModelShape(heads, kv_heads, head_dim, heads * head_dim, 1, value_head_dim)
    work = Workload(local_len * ulysses * ring, batch, name, causal, ulysses * ring, sliding_window)
    shape = "zigzag" if layout == "document_zigzag" else layout  # the same causal balance, no documents modelled
    seconds = {x: _candidate(ulysses, ring, "ulysses_inner", shape, cluster, model, work, ulysses * ring, x).layer_s
               for x in ("ring", "all_gather")}
    # as plan(): within 1% the model cannot tell, and the ring holds less
    return "all_gather" if seconds["all_gather"] < 0.99 * seconds["ring"] else "ring"
