"""Ring attention: the one forward loop and the one backward loop (DESIGN.md section 4).

Each ring rank keeps its queries; the packed ``[k; v]`` shard travels to the next rank
every step while the current one is being used (double buffer, posted before compute);
k and v share one flat buffer, so a value head size different from k's (MLA) travels in
the same single message.
The layout only enters through :func:`ring_sp.schedule.ring_step_tasks`, which says what
to compute at each step, so every layout shares these two loops. In the backward pass
the fp32 ``[dk; dv]`` accumulator travels with its KV shard and arrives home after ``R``
sends; ``dq`` stays local.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import PendingExchange, RingComm
from .kernels import AttentionKernel, softmax_stat_dtype
from .merge import fold_sinks, merge_block_
from .layouts import Boundaries
from .schedule import BlockTask, step_tasks


class RingSpec:
    """Everything the loops need besides tensors: the ring, the layout, the mask (causal,
    documents), the kernel."""

    def __init__(self, comm: RingComm | None, layout: str, causal: bool, kernel: AttentionKernel, scale: float,
                 local_len: int, cu_seqlens: Boundaries | None = None, ulysses_size: int = 1) -> None:
        self.comm = comm
        self.kernel = kernel
        self.scale = scale
        self.world_size = comm.world_size if comm is not None else 1
        self.rank = comm.rank if comm is not None else 0
        # The whole schedule, once per call (forward and backward share it): the KV at step
        # t comes from rank (rank - t) mod R. With documents this is the costly part.
        self.schedule = tuple(
            step_tasks(layout, causal, self.rank, (self.rank - step) % self.world_size, self.world_size, local_len,
                       cu_seqlens, ulysses_size)
            for step in range(self.world_size)
        )
        # One rank whose blocks never share a query row: nothing to merge, so no fp32
        # accumulators (the Ulysses-only case; documents give one block per document).
        self.local = self.world_size == 1 and _rows_disjoint(self.schedule[0])

    def steps(self):
        """(step, tasks) for every step of the ring."""
        return enumerate(self.schedule)

    def rotate(self, send: torch.Tensor, recv: torch.Tensor, kind: str) -> PendingExchange:
        assert self.comm is not None  # only called when world_size > 1
        return self.comm.exchange(send, recv, kind)


def _rows_disjoint(tasks: tuple[BlockTask, ...]) -> bool:
    spans = sorted((t.q.start, t.q.stop) for t in tasks)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _covers(task: BlockTask, q: torch.Tensor, k: torch.Tensor) -> bool:
    """The block is the whole local problem (one kernel call does everything)."""
    return task.q == slice(0, q.shape[1]) and task.kv == slice(0, k.shape[1])


def _block_forward(spec: RingSpec, task: BlockTask, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on one block: ``task``'s query rows of ``q`` against its keys of ``k``/``v``."""
    return spec.kernel.forward(q[:, task.q], k[:, task.kv], v[:, task.kv], causal=task.causal, scale=spec.scale)


def _block_backward(spec: RingSpec, task: BlockTask, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel's gradients of one block, given the global ``out`` and ``lse`` rows."""
    return spec.kernel.backward(dout[:, task.q], q[:, task.q], k[:, task.kv], v[:, task.kv], out[:, task.q],
                                lse[:, :, task.q], causal=task.causal, scale=spec.scale)


class _PackedKV:
    """k ``[b, s, h_kv, d]`` and v ``[b, s, h_kv, d_v]`` as contiguous views of ONE flat
    buffer, so each step sends one message, not two, whatever ``d_v`` is."""

    def __init__(self, k_shape: torch.Size, v_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        split = math.prod(k_shape)
        self.buf = torch.empty(split + math.prod(v_shape), dtype=dtype, device=device)
        self.k = self.buf[:split].view(k_shape)
        self.v = self.buf[split:].view(v_shape)

    @staticmethod
    def of(k: torch.Tensor, v: torch.Tensor) -> _PackedKV:
        packed = _PackedKV(k.shape, v.shape, k.dtype, k.device)
        packed.k.copy_(k)
        packed.v.copy_(v)
        return packed

    def empty_like(self, dtype: torch.dtype | None = None) -> _PackedKV:
        return _PackedKV(self.k.shape, self.v.shape, dtype or self.buf.dtype, self.buf.device)


def _finish(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged rows in ``dtype``, the sinks folded in first (once, before the one rounding)."""
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out.to(dtype), lse


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                 sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, n, h, d]``, k ``[b, n, h_kv, d]``, v ``[b, n, h_kv, d_v]`` (this rank's shards)
    -> out ``[b, n, h, d_v]`` in q's dtype and lse ``[b, h, n]`` (float32; float64 for float64
    inputs). ``sinks`` ``[h]``: folded into every row once all blocks are merged (lse then
    includes them; see :func:`ring_sp.merge.fold_sinks`)."""
    if spec.local:
        return _local_forward(q, k, v, spec, sinks)
    b, n, h, _ = q.shape
    acc_dtype = softmax_stat_dtype(q.dtype)
    out = torch.zeros((b, n, h, v.shape[3]), dtype=acc_dtype, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc_dtype, device=q.device)
    kv = _PackedKV.of(k, v)
    kv_next = kv.empty_like()
    for step, tasks in spec.steps():
        pending = spec.rotate(kv.buf, kv_next.buf, "ring_kv") if step + 1 < spec.world_size else None
        written: list[slice] = []  # rows filled at step 0: a first write is a copy, not a merge
        for task in tasks:
            out_b, lse_b = _block_forward(spec, task, q, kv.k, kv.v)
            if step == 0 and all(task.q.stop <= w.start or task.q.start >= w.stop for w in written):
                out[:, task.q].copy_(out_b)
                lse[:, :, task.q].copy_(lse_b)
                written.append(task.q)
            else:
                merge_block_(out[:, task.q], lse[:, :, task.q], out_b, lse_b)
        if pending is not None:
            pending.wait()
            kv, kv_next = kv_next, kv
    return _finish(out, lse, sinks, q.dtype)


def _local_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                   sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_forward` on one rank: each block's result goes straight to the output."""
    (tasks,) = spec.schedule
    if len(tasks) == 1 and _covers(tasks[0], q, k):
        out, lse = _block_forward(spec, tasks[0], q, k, v)
        return _finish(out, lse, sinks, q.dtype)
    # rows no block covers (none see a key) stay 0 with lse -inf
    out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=q.dtype if sinks is None else softmax_stat_dtype(q.dtype),
                      device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=softmax_stat_dtype(q.dtype), device=q.device)
    for task in tasks:
        out_b, lse_b = _block_forward(spec, task, q, k, v)
        out[:, task.q] = out_b
        lse[:, :, task.q] = lse_b
    return _finish(out, lse, sinks, q.dtype)


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spec: RingSpec,
    deliver_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for this rank's shards: dq ``[b, n, h, d]``, dk ``[b, n, h_kv, d]``, dv
    ``[b, n, h_kv, d_v]``, given the global ``out`` and ``lse`` from :func:`ring_forward`
    (with sinks: the folded ones, which is all the blocks' backward needs).

    dK/dV accumulate in float32 (float64) while they travel; their LAST hop home carries
    the finished sum in ``deliver_dtype`` (the input dtype: half the bytes for bf16, and
    the same single rounding the caller would do; float32 when the caller sums them
    further, as Ulysses does for replicated KV heads). dq comes back unrounded (float32,
    or the kernel's dtype on one rank): the caller casts once.
    """
    if spec.local:
        return _local_backward(dout, q, k, v, out, lse, spec)
    acc_dtype = softmax_stat_dtype(q.dtype)
    # Accumulators are allocated explicitly: ``x.to(torch.float32)`` would alias an fp32 x.
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv = _PackedKV.of(k, v)
    kv_next = kv.empty_like()
    dkv, dkv_next = kv.empty_like(acc_dtype), kv.empty_like(acc_dtype)
    dkv.buf.zero_()
    dout = dout.contiguous()
    kv_pending: PendingExchange | None = None
    dkv_pending: PendingExchange | None = None
    last = spec.world_size - 1
    for step, tasks in spec.steps():
        if step < last:
            kv_pending = spec.rotate(kv.buf, kv_next.buf, "ring_kv")
        grads = [(task, _block_backward(spec, task, dout, q, kv.k, kv.v, out, lse)) for task in tasks]
        if dkv_pending is not None:  # the accumulator of the KV we now hold arrives
            dkv_pending.wait()
            dkv, dkv_next = dkv_next, dkv
        for task, (dq_b, dk_b, dv_b) in grads:
            dq[:, task.q] += dq_b
            dkv.k[:, task.kv] += dk_b
            dkv.v[:, task.kv] += dv_b
        if step < last:  # pass the accumulator on with its KV
            dkv_pending = spec.rotate(dkv.buf, dkv_next.buf, "ring_dkv")
        if kv_pending is not None:
            kv_pending.wait()
            kv, kv_next = kv_next, kv
            kv_pending = None
    # After R - 1 hops every accumulator holds all its contributions; one more takes it home.
    home = dkv.empty_like(deliver_dtype)
    send = dkv.buf if deliver_dtype == acc_dtype else dkv.buf.to(deliver_dtype)
    spec.rotate(send, home.buf, "ring_dkv").wait()
    return dq, home.k, home.v


def _local_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, spec: RingSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ring_backward` on one rank: the kernel's gradients as they come for a single
    block, else summed per block (documents: one block per document)."""
    (tasks,) = spec.schedule
    if len(tasks) == 1 and _covers(tasks[0], q, k):
        return _block_backward(spec, tasks[0], dout, q, k, v, out, lse)
    acc_dtype = softmax_stat_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    dout = dout.contiguous()
    for task in tasks:
        dq_b, dk_b, dv_b = _block_backward(spec, task, dout, q, k, v, out, lse)
        dq[:, task.q] += dq_b
        dk[:, task.kv] += dk_b
        dv[:, task.kv] += dv_b
    return dq, dk, dv


def ring_comm_for(group: dist.ProcessGroup | None) -> RingComm | None:
    """The ring over ``group`` (None = default group), or None for a ring of one rank."""
    comm = RingComm(group)
    return comm if comm.world_size > 1 else None
