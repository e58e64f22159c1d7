"""KV rows a ring rank sends per step and per link class (pure): what a ring over nodes puts on
NVLink (``'intra'``: both ends on one node) and on the inter-node links (``'inter'``).

Counted from the rank's :class:`~.ring_pass.ExchangePlan` alone, so the planner and the benchmarks
see the same messages the ring loop posts: a flat ring sends ``send_rows[t]`` to ``r + t`` (inter
when that rank is on another node); a double ring sends its inner steps' rows inside the node and,
for each outer step ``o >= 1``, ``inter_send[o]`` to its peer in node ``n + o``, counted at the step
whose KV it carries (the outer step's first). The dK/dV partials go back the same way, as fp32.
"""

from __future__ import annotations

from .ring_order import RingOrder
from .ring_pass import ExchangePlan, row_count

LINK_CLASSES = ("intra", "inter")


def link_rows(plan: ExchangePlan, rank: int, node_ranks: int) -> list[dict[str, int]]:
    """Per step ``t``: ``{'intra': rows, 'inter': rows}`` of KV that ring rank ``rank`` sends for
    step ``t`` (the rows its reader reads at ``t``), on nodes of ``node_ranks`` consecutive ring ranks."""
    world_size = len(plan.schedule)
    order = plan.order if plan.order is not None else RingOrder.flat(world_size)
    per_step = [dict.fromkeys(LINK_CLASSES, 0) for _ in range(world_size)]

    def link(peer: int) -> str:
        return "intra" if peer // node_ranks == rank // node_ranks else "inter"

    for step in range(1, world_size):
        rows = plan.send_rows[step]
        if rows is not None:
            per_step[step][link(order.reader(rank, step))] += row_count(rows)
    for outer, rows in enumerate(plan.inter_send):
        if rows is not None:
            per_step[outer * order.inner_size][link(order.inter_peer(rank, outer))] += row_count(rows)
    return per_step


def pass_link_rows(plan: ExchangePlan, rank: int, node_ranks: int) -> dict[str, int]:
    """:func:`link_rows` summed over the pass."""
    steps = link_rows(plan, rank, node_ranks)
    return {kind: sum(step[kind] for step in steps) for kind in LINK_CLASSES}


__all__ = ["LINK_CLASSES", "link_rows", "pass_link_rows"]
