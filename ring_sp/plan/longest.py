"""``ring-sp plan --max-seq-len``: the longest sequence per library and ``U x R``, as a table or JSON.

Each row is one library on one grid (:class:`Row`): the longest sequence whose step fits the
GPU's memory and the node's host memory (:func:`ring_sp.plan.step_memory.longest_sequence`),
its peak and breakdown, the host bytes per node, the limit that binds, the attention's head
chunks and the int32-index check (:mod:`ring_sp.plan.index_limits`). With ``--alst`` ALST
runs its published recipe on the one grid it has (Ulysses over every GPU) and ring_sp its own
pieces (:func:`ring_sp.plan.training.long_sequence`) on every grid.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..shapes import check_ulysses_heads, divisors
from .host_memory import ranks_per_node
from .index_limits import Int32Risk, int32_risk
from .request import PlanError
from .step_memory import GPU_BOUND, Longest, longest_sequence
from .training import Training
from .transformer import Transformer


@dataclass(frozen=True)
class Request:
    """What ``--max-seq-len`` is asked: the model, ``world_size`` GPUs (``gpus_per_node`` per node)
    of ``memory_bytes``, ``host_bytes`` of RAM per node, the SP degree, an optional pinned
    Ulysses size, and the recipes: ``(library, training, alst_grid_only)`` per row group."""

    model: Transformer
    world_size: int
    gpus_per_node: int
    sp: int
    memory_bytes: float
    host_bytes: float
    recipes: tuple[tuple[str, Training, bool], ...]
    ulysses: int | None = None


@dataclass(frozen=True)
class Row:
    """One library on one grid: ``status`` "ok", "cannot run" (``reason`` says why) or "nothing fits"."""

    library: str
    ulysses: int
    ring: int
    status: str
    reason: str = ""
    found: Longest | None = None
    int32: Int32Risk | None = None

    @property
    def label(self) -> str:
        return f"{self.library} {self.ulysses} x {self.ring}"


def rows(req: Request) -> list[Row]:
    """Every row of the table, in order: each recipe over its grids."""
    grids = [(u, req.sp // u) for u in ([req.ulysses] if req.ulysses else divisors(req.sp))]
    per_node = ranks_per_node(req.world_size, req.gpus_per_node)
    out = []
    for library, training, ulysses_only in req.recipes:
        for u, r in ([(req.sp, 1)] if ulysses_only else grids):
            try:
                if u > 1:
                    check_ulysses_heads(req.model.heads, req.model.kv_heads, u)
                found = longest_sequence(req.model, training, req.memory_bytes, ulysses=u, ring=r,
                                         host_bytes=req.host_bytes, ranks_per_node=per_node)
            except (ValueError, PlanError) as exc:
                out.append(Row(library, u, r, "cannot run", str(exc)))
                continue
            if found.step is None:
                out.append(Row(library, u, r, "nothing fits", found=found))
                continue
            risk = int32_risk(req.model, training, n=found.step.tokens_per_rank, ulysses=u)
            out.append(Row(library, u, r, "ok", found=found, int32=risk))
    return out


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def header(req: Request, training: Training) -> str:
    """The line above the table: the model, the GPUs and host memory, the first recipe."""
    t = training
    ckpt = ("checkpointing" + (" offloaded" if t.offload_checkpoints else "")) if t.checkpointing else "no checkpointing"
    return (f"ring-sp plan --max-seq-len: {req.model.name} ({req.model.params / 1e9:.2f}B parameters), SP degree "
            f"{req.sp} of {req.world_size} GPUs x {req.memory_bytes / 2**30:.0f} GiB, host "
            f"{req.host_bytes / 2**30:.0f} GiB per node of {req.gpus_per_node} GPUs, {t.dtype}, ZeRO-{t.zero_stage}"
            f"{' (optimizer offloaded)' if t.offload_optimizer else ''}, {ckpt}, "
            f"{'tiled MLP and loss' if t.tiled_mlp else 'untiled'}, {t.library}")


def render(req: Request, table: list[Row]) -> str:
    """The text table: today's columns first (library U x R, longest sequence, ...), new ones last."""
    lines = [header(req, req.recipes[0][1]), "",
             "| library U x R | longest sequence | tokens per GPU | peak GiB | breakdown (GiB) | host GiB per node "
             "| bound by | head chunks | int32 index |", "|---|---|---|---|---|---|---|---|---|"]
    for row in table:
        if row.status == "cannot run":
            lines.append(f"| {row.label} | cannot run: {row.reason} | | | | | | | |")
        elif row.status == "nothing fits":
            lines.append(f"| {row.label} | nothing fits | | | | | {row.found.bound_by} | | |")
        else:
            step = row.found.step
            parts = ", ".join(f"{part} {_gib(value)}" for part, value in step.breakdown().items() if value)
            lines.append(f"| {row.label} | {row.found.tokens:,} | {step.tokens_per_rank:,} | {_gib(step.total)} "
                         f"| {parts} | {_gib(row.found.host_per_node)} | {row.found.bound_by} | {step.head_chunks} "
                         f"| {row.int32.note()} |")
    host_bound = [row.label for row in table if row.found is not None and row.found.bound_by != GPU_BOUND]
    if host_bound:
        lines.append(f"note: host memory binds for {', '.join(host_bound)}: the GPUs could hold longer sequences "
                     f"than {req.host_bytes / 2**30:.0f} GiB of RAM per node can back (--host-memory-gib)")
    return "\n".join(lines)


def as_json(req: Request, table: list[Row]) -> str:
    """The same rows as JSON (``bound_by`` and ``int32`` per row)."""
    def row_dict(row: Row) -> dict:
        data = {"library": row.library, "ulysses": row.ulysses, "ring": row.ring, "status": row.status,
                "reason": row.reason}
        if row.found is not None:
            data.update(bound_by=row.found.bound_by, longest_sequence=row.found.tokens,
                        host_bytes_per_node=row.found.host_per_node)
        step = row.found.step if row.found is not None else None
        if step is not None:
            data.update(tokens_per_gpu=step.tokens_per_rank, peak_bytes=step.total, breakdown=step.breakdown(),
                        phases=step.phases, host_per_rank=asdict(step.host), head_chunks=step.head_chunks,
                        int32={"elements": row.int32.elements, "kernels": list(row.int32.kernels)})
        return data

    return json.dumps({"model": asdict(req.model), "world_size": req.world_size, "gpus_per_node": req.gpus_per_node,
                       "sp_size": req.sp, "gpu_memory_bytes": req.memory_bytes,
                       "host_memory_bytes_per_node": req.host_bytes,
                       "recipes": [{"library": name, "training": asdict(t)} for name, t, _ in req.recipes],
                       "rows": [row_dict(row) for row in table]}, indent=1)


__all__ = ["Request", "Row", "as_json", "render", "rows"]
