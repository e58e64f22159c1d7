"""The planner: models what a ``U x R`` grid costs before anything runs, and ``ring-sp plan``.

It sits below the runtime and imports none of it (only the pure layout, schedule, grid and
shape rules): :mod:`~ring_sp.plan.request` (cluster, model, workload), :mod:`~ring_sp.plan.layer_cost`
(bytes and memory of one attention layer), :mod:`~ring_sp.plan.layer_time` (its time per
candidate), :mod:`~ring_sp.plan.search` (every runnable split, fastest first),
:mod:`~ring_sp.plan.exchange_choice` (``kv_exchange="auto"``, the one question the runtime
asks), :mod:`~ring_sp.plan.step_memory` (a whole training step's memory and the longest
sequence that fits GPU and host memory) with its parts: :mod:`~ring_sp.plan.transformer`
(the model's shapes, presets), :mod:`~ring_sp.plan.training` (how the step runs; ALST's and
ring_sp's long-sequence recipes), :mod:`~ring_sp.plan.layer_memory` (one layer's kept and
transient bytes), :mod:`~ring_sp.plan.host_memory` (what offloading puts in host RAM) and
:mod:`~ring_sp.plan.index_limits` (kernels with 32-bit indexing);
:mod:`~ring_sp.plan.longest` (the ``--max-seq-len`` table and JSON),
:mod:`~ring_sp.plan.presets` (GPUs and links) and :mod:`~ring_sp.plan.cli` (the
``ring-sp plan`` / ``python -m ring_sp.plan`` entry point, :func:`main`).
"""

from .cli import main
from .exchange_choice import choose_kv_exchange
from .layer_cost import AttentionMemory, attention_memory, layer_bytes, ring_halo_rows
from .layer_time import BACKWARD_FLOP_RATIO, Candidate
from .presets import GPUS, LINKS, nominal_cluster
from .request import DTYPES, Cluster, ModelShape, PlanError, Workload, dtype_bytes
from .search import Plan, plan

__all__ = [
    "BACKWARD_FLOP_RATIO",
    "DTYPES",
    "GPUS",
    "LINKS",
    "AttentionMemory",
    "Candidate",
    "Cluster",
    "ModelShape",
    "Plan",
    "PlanError",
    "Workload",
    "attention_memory",
    "choose_kv_exchange",
    "dtype_bytes",
    "layer_bytes",
    "main",
    "nominal_cluster",
    "plan",
    "ring_halo_rows",
]
