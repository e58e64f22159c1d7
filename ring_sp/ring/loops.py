"""Ring attention: the one forward loop and the one backward loop (DESIGN.md section 4).

Each ring rank keeps its queries. At step ``t`` rank ``r`` holds the packed ``[k; v]``
shard of rank ``r - t``, which arrives while the previous step computes
(:mod:`.kv_exchange`). The layout (and mask) only enters through
:func:`ring_sp.schedule.step_tasks`, which says what to compute at each step
(:attr:`RingSpec.schedule`), so every layout shares these two loops. Forward, each block's
output merges into fp32 rows; attention sinks fold into the merged rows once, at the end
(:func:`ring_sp.merge.fold_sinks`). Backward, ``dq`` stays local and the dK/dV partials go
home by one of the routes of :mod:`.grad_exchange`. A step's blocks reach the kernel as its
kernel calls (:mod:`.calls`): one block each, or many as one varlen call over their rows.

``kv_exchange="all_gather"`` (:attr:`RingSpec.gather_kv`) runs the SAME two loops over the
same schedule, only the KV of step ``t`` comes from one all-gather instead of a message and
the dK/dV partials are reduce-scattered home at the end (:class:`~.kv_exchange.GatheredKV`,
:class:`~.grad_exchange.GatheredGrads`). One rank whose blocks never share a query row
(:attr:`RingSpec.local`) skips the merge: each block's result goes straight to the output.
"""

from __future__ import annotations

import torch

from ..kernels import softmax_stat_dtype
from ..merge import fold_sinks, merge_block_
from .calls import Launch, call_backward, call_forward
from .grad_exchange import DirectGrads, GatheredGrads, RelayedGrads
from .kv_exchange import KVShape, PackedKV, kv_mail
from .spec import RingSpec


def _covers(launch: Launch, q: torch.Tensor, k: torch.Tensor) -> bool:
    """The call is the whole local problem (one kernel call does everything)."""
    return launch.call.q == slice(0, q.shape[1]) and launch.call.kv == slice(0, k.shape[1])


def _call_forward(spec: RingSpec, launch: Launch, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on one call: (out, lse) of its rows ``launch.call.q``."""
    return call_forward(spec.kernel, spec.scale, launch, q, k, v)


def _call_backward(spec: RingSpec, launch: Launch, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel's gradients of one call, given the global ``out`` and ``lse`` rows."""
    return call_backward(spec.kernel, spec.scale, launch, dout, q, k, v, out, lse)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when stored ``[b, s, h, d]`` or ``[b, h, s, d]`` (Ulysses' head-major
    outputs: copying those would cost a buffer), else a contiguous copy (e.g. an expanded
    gradient), read once per block."""
    return x if x.is_contiguous() or x.transpose(1, 2).is_contiguous() else x.contiguous()


def _finish(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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
    own = PackedKV.of(k, v)
    mail = kv_mail(spec, own, KVShape.of(k, v))
    for step, launches in spec.steps(q.device):
        kv = own if step == 0 else mail.received(step)  # arrived: waited at the end of the previous step
        pending = mail.post(step + 1)
        written: list[slice] = []  # rows filled at step 0: a first write is a copy, not a merge
        for launch in launches:
            rows = launch.call.q
            out_b, lse_b = _call_forward(spec, launch, q, kv.k, kv.v)
            if step == 0 and all(rows.stop <= w.start or rows.start >= w.stop for w in written):
                out[:, rows].copy_(out_b)
                lse[:, :, rows].copy_(lse_b)
                written.append(rows)
            else:
                merge_block_(out[:, rows], lse[:, :, rows], out_b, lse_b)
        if pending is not None:
            pending.wait()
    return _finish(out, lse, sinks, q.dtype)


def _local_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec,
                   sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ring_forward` on one rank: each block's result goes straight to the output."""
    (launches,) = spec.calls.launches(q.device)
    if len(launches) == 1 and _covers(launches[0], q, k):
        out, lse = _call_forward(spec, launches[0], q, k, v)
        return _finish(out, lse, sinks, q.dtype)
    # rows no call covers (none see a key) stay 0 with lse -inf
    out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=q.dtype if sinks is None else softmax_stat_dtype(q.dtype),
                      device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=softmax_stat_dtype(q.dtype), device=q.device)
    for launch in launches:
        out_b, lse_b = _call_forward(spec, launch, q, k, v)
        out[:, launch.call.q] = out_b
        lse[:, :, launch.call.q] = lse_b
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
    if spec.world_size == 1:  # one rank (its calls may share rows: their sums are all there is to do)
        return _local_backward(dout, q, k, v, out, lse, spec)
    acc_dtype = softmax_stat_dtype(q.dtype)
    # Accumulators are allocated explicitly: ``x.to(torch.float32)`` would alias an fp32 x.
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    own = PackedKV.of(k, v)
    shape = KVShape.of(k, v)
    mail = kv_mail(spec, own, shape)
    dout = _dense(dout)
    route = (GatheredGrads if spec.gather_kv else RelayedGrads if spec.relay_dkv else DirectGrads)(
        spec, shape, k.shape[1], acc_dtype, k.device)
    for step, launches in spec.steps(q.device):
        kv = own if step == 0 else mail.received(step)
        kv_pending = mail.post(step + 1)
        route.begin(step)
        for launch in launches:
            _add_call_grads(spec, launch, dq, route, dout, q, kv, out, lse)
        route.end(step)
        if kv_pending is not None:
            kv_pending.wait()
    return (dq, *route.finish(deliver_dtype))


def _add_call_grads(spec: RingSpec, launch: Launch, dq: torch.Tensor,
                    route: RelayedGrads | DirectGrads | GatheredGrads,
                    dout: torch.Tensor, q: torch.Tensor, kv: PackedKV, out: torch.Tensor, lse: torch.Tensor) -> None:
    """One call's gradients, added as soon as the kernel returns them: its dq into ``dq``,
    its dk/dv (``h_kv`` wide) into the route's accumulator. Their only references are this
    call's locals, so at most one call's gradients are alive at a time (the planner's minimum)."""
    dq_b, dk_b, dv_b = _call_backward(spec, launch, dout, q, kv.k, kv.v, out, lse)
    dq[:, launch.call.q] += dq_b
    route.add(launch.call.kv, dk_b, dv_b)


def _local_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, spec: RingSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ring_backward` on one rank: the kernel's gradients as they come for a single
    call, else summed per call (documents: one block per document, or one varlen call)."""
    (launches,) = spec.calls.launches(q.device)
    if len(launches) == 1 and _covers(launches[0], q, k):
        return _call_backward(spec, launches[0], dout, q, k, v, out, lse)
    acc_dtype = softmax_stat_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    dout = _dense(dout)
    for launch in launches:
        dq_b, dk_b, dv_b = _call_backward(spec, launch, dout, q, k, v, out, lse)
        dq[:, launch.call.q] += dq_b
        dk[:, launch.call.kv] += dk_b
        dv[:, launch.call.kv] += dv_b
    return dq, dk, dv
