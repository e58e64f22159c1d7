"""Which (query part, key part, mask) blocks a ring rank computes at each step, and which KV
rows each step exchanges: pure functions of the layout, the mask and the two ranks, kept
apart from the ring loops (:mod:`ring_sp.ring`) so they can be tested exhaustively without
processes. :mod:`.blocks` holds the block type and the plain layouts' steps,
:mod:`.documents` cuts them per packed document (``cu_seqlens``), :mod:`.windows` per
sliding window, :mod:`.spans` adds the blocks of bidirectional spans, and :mod:`.ring_pass`
puts a rank's whole pass together (the step dispatcher, the work per rank and the
:class:`ExchangePlan` the ring runs, in the order of :mod:`.ring_order`: flat or a double ring). :mod:`.calls` groups a step's blocks into kernel calls
for what a kernel takes, and :mod:`.pairs` counts the score pairs those calls compute against
the pairs the mask needs.
"""

from .blocks import BlockTask, bottom_right_window, interval_blocks, ring_step_tasks
from .calls import KernelCall, KernelCaps, step_calls
from .documents import document_steps, document_zigzag_steps, packed_step_tasks
from .link_rows import LINK_CLASSES, link_rows, pass_link_rows
from .pairs import PairCount, call_pairs, mask_pairs, rank_pair_count
from .ring_order import RingOrder
from .ring_pass import (ExchangePlan, Rows, RowSet, causal_work_per_rank, exchange_plan, message_rows, read_rows,
                        row_count, step_tasks, within)
from .spans import span_step_tasks
from .windows import band_blocks, window_step_tasks

__all__ = [
    "LINK_CLASSES",
    "BlockTask",
    "ExchangePlan",
    "KernelCall",
    "KernelCaps",
    "PairCount",
    "RingOrder",
    "RowSet",
    "Rows",
    "band_blocks",
    "bottom_right_window",
    "call_pairs",
    "causal_work_per_rank",
    "document_steps",
    "document_zigzag_steps",
    "exchange_plan",
    "interval_blocks",
    "link_rows",
    "mask_pairs",
    "message_rows",
    "packed_step_tasks",
    "pass_link_rows",
    "rank_pair_count",
    "read_rows",
    "row_count",
    "ring_step_tasks",
    "span_step_tasks",
    "step_calls",
    "step_tasks",
    "window_step_tasks",
    "within",
]
