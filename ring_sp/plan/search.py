"""The search behind ``ring-sp plan``: every runnable ``U x R`` split, modelled, fastest first.

:func:`plan` validates the request, tries every Ulysses size that divides the SP degree
with every placement and layout that can run it (and both KV exchanges with "auto"),
models each with :func:`ring_sp.plan.layer_time.candidate`, and recommends one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..grid import PLACEMENTS
from ..layouts import check_layout, ulysses_to_ring_order
from ..shapes import check_ulysses_heads, divisors
from ..validation import KV_EXCHANGES
from .layer_time import Candidate, Placement, candidate
from .request import Cluster, ModelShape, PlanError, Workload, dtype_bytes

@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    model: ModelShape
    workload: Workload
    sp_size: int
    candidates: tuple[Candidate, ...]  # fastest first
    recommended: Candidate
    warnings: tuple[str, ...] = field(default=())


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


RINGS = ("plain", "double", "auto")


def _ring_exchanges(exchanges: tuple[str, ...], ring: str, where: Placement) -> tuple[str, ...]:
    """The exchanges to model for a grid: the double ring in place of (``ring="double"``) or beside
    (``"auto"``) the flat ring's where that ring spans nodes evenly; elsewhere a double ring is the flat one."""
    if ring == "plain" or "ring" not in exchanges or where.ring_inner is None:
        return exchanges
    double = tuple("double_ring" if x == "ring" else x for x in exchanges)
    return double if ring == "double" else exchanges + ("double_ring",)


def plan(cluster: Cluster, model: ModelShape, work: Workload, *, ulysses: int | None = None,
         placement: str | None = None, layout: str = "auto", kv_exchange: str = "ring", ring: str = "plain") -> Plan:
    """Every runnable ``U x R`` (``ulysses`` / ``placement`` pin them), modelled, fastest first;
    ``kv_exchange``: the ring group's exchange, "ring" (default here), "all_gather", or "auto"
    (both, as candidates of their own; the ``ring-sp plan`` CLI's default). ``ring``: where a ring
    spans nodes, run it flat ("plain", default here), as a double ring ("double":
    ``kv_exchange="double_ring"``) or both as candidates of their own ("auto", the CLI's default).

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
    if kv_exchange not in KV_EXCHANGES[:3]:  # (the double ring is chosen by --ring)
        raise PlanError(f"kv-exchange={kv_exchange!r} is not one of {KV_EXCHANGES[:3]}")
    exchanges = ("ring", "all_gather") if kv_exchange == "auto" else (kv_exchange,)
    if ring not in RINGS:
        raise PlanError(f"ring={ring!r} is not one of {RINGS}")
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
        if placement == "ulysses_inner" and Placement.of(ulysses, sp // ulysses, placement,
                                                          cluster).ulysses_link == "inter":
            raise PlanError(f"ulysses={ulysses} with placement ulysses_inner does not fit in a node of "
                            f"{cluster.gpus_per_node} GPUs: its all-to-all would cross nodes; use a ulysses size "
                            f"dividing {cluster.gpus_per_node}, or placement ring_inner")

    candidates, skipped = [], []
    for u in ([ulysses] if ulysses is not None else divisors(sp)):
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
        options = [candidate(u, r, p, lay, cluster, model, work, sp, x) for lay in chosen for p in ([placement] if placement
                   else PLACEMENTS if u > 1 and r > 1 else ["ulysses_inner"])
                   for x in (_ring_exchanges(exchanges, ring, Placement.of(u, r, p, cluster)) if r > 1 else ("ring",))]
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
