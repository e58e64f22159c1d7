"""Time of one attention layer for one ``U x R`` candidate (DESIGN.md sections 5 and 8).

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

from dataclasses import dataclass

from ..grid import rank_grid
from ..nodes import grid_links, ring_inner_size
from ..schedule import exchange_plan, ring_step_tasks, row_count
from ..shapes import kv_heads_per_rank
from .double_ring_time import double_ring_seconds, min_chunk, pass_shape
from .layer_cost import attention_memory, layer_bytes
from .request import Cluster, ModelShape, Workload, dtype_bytes

# FlashAttention-2 backward does 5 matmuls of the forward's size to the forward's 2 (Dao 2023).
BACKWARD_FLOP_RATIO = 2.5
# Korthikanti et al. 2022 (arXiv:2205.05198) eq. 1: a transformer layer keeps s*b*h*(34 + 5*a*s/h)
# bytes of 16-bit activations for backward; flash attention never stores the 5*a*s/h score terms.
LAYER_ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34


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
        exchange = {"all_gather": " all_gather", "double_ring": " double ring"}.get(self.kv_exchange, "")
        return f"U={self.ulysses} x R={self.ring}{exchange}"

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
class Placement:
    """Where a grid's groups fall on the nodes: which link each dimension's slowest pair uses
    ('intra', 'inter' or '-' when absent), and every (intra-node, inter-node) peer count a
    Ulysses rank has."""

    ulysses_link: str
    ring_link: str
    peer_mixes: frozenset[tuple[int, int]]
    ring_inner: int | None = None  # ring ranks per node when the ring spans nodes evenly (a double ring's inner size)

    @staticmethod
    def of(ulysses: int, ring: int, placement: str, cluster: Cluster) -> Placement:
        grid = rank_grid(cluster.world_size, ulysses, ring, placement)

        def nodes(group: list[int]) -> list[int]:
            return [p // cluster.gpus_per_node for p in group]

        mixes = frozenset((at.count(mine) - 1, len(at) - at.count(mine))
                          for at in map(nodes, grid.ulysses_groups) for mine in at)
        links = grid_links(grid, cluster.gpus_per_node)  # a ring's neighbours are among its group's pairs
        try:  # a double ring's inner rings: the ring ranks of one node (None: the ring cannot run as one)
            inner: int | None = ring_inner_size(grid.ring_groups[0], cluster.gpus_per_node)
        except ValueError:
            inner = None
        return Placement(links["ulysses"], links["ring"], mixes, inner if inner is not None and 1 < inner < ring else None)

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
    moves = [0.0] + [max(row_count(p.recv_rows[step]) / chunk for p in plans)
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


def candidate(ulysses: int, ring: int, placement: str, layout: str, cluster: Cluster, model: ModelShape,
               work: Workload, sp_size: int, kv_exchange: str = "ring") -> Candidate:
    elem, acc = dtype_bytes(work.dtype)
    b, d = work.batch, model.head_dim
    d_v = d if model.value_head_dim is None else model.value_head_dim
    local_len, chunk = work.seq_len // sp_size, work.seq_len // ring
    heads_here, m = model.heads // ulysses, kv_heads_per_rank(model.kv_heads, ulysses)
    window = work.sliding_window if work.sliding_window is not None and work.sliding_window < work.seq_len else None
    where = Placement.of(ulysses, ring, placement, cluster)
    fwd_bytes, bwd_bytes = layer_bytes(ulysses=ulysses, ring=ring, batch=b, local_len=local_len, heads=model.heads,
                                       kv_heads=model.kv_heads, head_dim=d, dtype=work.dtype, layout=layout,
                                       causal=work.causal, sliding_window=window, value_head_dim=d_v,
                                       kv_exchange=kv_exchange, inner_size=where.ring_inner)
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
    elif ring > 1 and cluster.latency and kv_exchange != "double_ring":  # every step that moves KV synchronises (and one more sends dK/dV home)
        moving = (ring - 1 if window is None else
                  sum(any(exchange_plan(layout, True, r, ring, chunk, None, window).receives[t] for r in range(ring))
                      for t in range(1, ring)))
        ring_fwd += moving * cluster.latency
        ring_bwd += (moving + 1) * cluster.latency
    # (rounded first: float noise must not turn an exact 4945.0 into 4946)
    min_fwd = min_chunk(chunk, kv_s, hardest) if ring > 1 else 0
    min_bwd = min_chunk(chunk, kv_s + dkv_s, BACKWARD_FLOP_RATIO * hardest) if ring > 1 else 0
    if ring > 1 and kv_exchange == "double_ring":  # the inner rings on NVLink, one held message per pass across
        assert where.ring_inner is not None  # (search offers the double ring only where the ring spans nodes)
        double = double_ring_seconds(pass_shape(layout, work.causal, ring, where.ring_inner, chunk, window), chunk,
                                     flops_per_pair / cluster.flops, kv_shard * elem / cluster.intra_bw,
                                     kv_shard * acc / cluster.intra_bw, kv_shard * elem / cluster.inter_bw,
                                     kv_shard * acc / cluster.inter_bw, cluster.latency, BACKWARD_FLOP_RATIO)
        ring_fwd, ring_bwd, hides_fwd, hides_bwd = double.fwd_s, double.bwd_s, double.hides_fwd, double.hides_bwd
        min_fwd, min_bwd = double.min_chunk_fwd, double.min_chunk_bwd

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
    elif ring > 1 and kv_exchange == "double_ring" and where.ring_inner is not None:
        notes.append(f"double ring {ring // where.ring_inner} x {where.ring_inner}: each shard crosses to every other "
                     f"node once")
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
