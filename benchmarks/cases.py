"""The per-rank cases (each runs on every rank of a ``P``-rank block, see :mod:`.launch`).

Each takes a :class:`~.modes.Problem` and a list of :class:`~.modes.Mode`, runs every
mode on identical inputs and returns this rank's measurements, keyed by mode name. A
mode that refuses the problem (DeepSpeed with fewer KV heads than ranks, say) raises on
its first call, before any collective, on every rank; it is reported as
``{"error": message}``. Timed modes take turns call by call, so a change in the
machine's load during the run hits every mode alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

import ring_sp
from ring_sp.kernels import get_kernel

from .comm_bytes import count_all_to_all
from .launch import device, sp_group
from .local_attention import LocalAttention
from .memory import PeakMemory
from .modes import Bound, Mode, Problem, bind
from .overlap import delayed_exchanges
from .timing import time_call
from .work import count_scores

Shards = tuple[torch.Tensor, ...]  # this rank's q, k, v (requiring grad) and upstream gradient
Result = dict[str, Any]


class Ready:
    """A mode bound on this rank, its shards, and the two things timed: a forward, and a
    forward+backward."""

    def __init__(self, bound: Bound, shards: Shards) -> None:
        self.bound, self.shards = bound, shards
        q, k, v, dout = shards
        self.steps: dict[str, Callable[[], object]] = {
            "fwd": lambda: bound.attend(q, k, v),
            "fwd_bwd": lambda: bound.attend(q, k, v).backward(dout),
        }

    def clear_grads(self) -> None:
        for t in self.shards[:3]:
            t.grad = None


def _prepare(problem: Problem, modes: list[Mode], backend: str) -> dict[str, Ready | Result]:
    """Every mode bound and called once (agreement collective, caches), or its refusal."""
    dev, prepared = device(), {}
    full = problem.inputs(dev)
    for mode in modes:
        try:
            bound = bind(mode, problem, sp_group(), dev, backend)
            shards = tuple(bound.shard(t).requires_grad_(i < 3) for i, t in enumerate(full))
            ready = Ready(bound, shards)
            ready.steps["fwd_bwd"]()
            ready.clear_grads()
            prepared[mode.name] = ready
        except (AssertionError, ValueError, TypeError, ImportError) as exc:  # raised before any collective
            prepared[mode.name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    return prepared


def _each(prepared: dict[str, Ready | Result], measure: Callable[[Ready], Result]) -> dict[str, Result]:
    return {name: measure(r) if isinstance(r, Ready) else r for name, r in prepared.items()}


def _time(ready: Ready, kind: str) -> float:
    """One call, started on every rank together."""
    return time_call(ready.steps[kind], group=sp_group(), device=device(), reset=ready.clear_grads)


def timing_case(problem: Problem, modes: list[Mode], warmup: int, repeats: int, backend: str = "auto",
                delay_s: float = 0.0) -> dict[str, Result]:
    """Seconds per forward and per forward+backward on this rank, each repeat; ``delay_s``
    keeps every ring exchange in flight that long (:mod:`.overlap`)."""
    prepared = _prepare(problem, modes, backend)
    ready = {name: r for name, r in prepared.items() if isinstance(r, Ready)}
    times: dict[str, Result] = {name: {"fwd": [], "fwd_bwd": []} for name in ready}
    with delayed_exchanges(delay_s) if delay_s > 0 else contextlib.nullcontext():
        for i in range(warmup + repeats):
            for name, r in ready.items():
                for kind in r.steps:
                    elapsed = _time(r, kind)
                    if i >= warmup:
                        times[name][kind].append(elapsed)
    return {name: times.get(name, r) for name, r in prepared.items()}


def overlap_case(problem: Problem, mode: Mode, delay_s: float, warmup: int, repeats: int,
                 backend: str = "auto") -> Result:
    """One mode's forward and forward+backward, alternating plain calls (keys ``fwd``,
    ``fwd_bwd``: compute alone) with calls whose ring exchanges are delayed by ``delay_s``
    (``fwd_delayed``, ``fwd_bwd_delayed``), so that both see the same machine."""

    def measure(ready: Ready) -> Result:
        times: dict[str, list[float]] = {}
        for i in range(warmup + repeats):
            for kind in ready.steps:
                for suffix, delay in (("", contextlib.nullcontext()), ("_delayed", delayed_exchanges(delay_s))):
                    with delay:
                        elapsed = _time(ready, kind)
                    if i >= warmup:
                        times.setdefault(kind + suffix, []).append(elapsed)
        return times

    return _each(_prepare(problem, [mode], backend), measure)[mode.name]


def profile_case(problem: Problem, modes: list[Mode], backend: str = "auto") -> dict[str, Result]:
    """One forward+backward: bytes sent (forward, backward), attention scores computed and
    peak memory added on this rank."""
    kernel_class = type(get_kernel(backend, device(), problem.torch_dtype, problem.head_dim))

    def measure(ready: Ready) -> Result:
        q, k, v, dout = ready.shards
        with PeakMemory(device()) as memory, count_scores(kernel_class) as scores:
            with ring_sp.count_communication() as ours_fwd, count_all_to_all() as a2a_fwd:
                out = ready.bound.attend(q, k, v)
            with ring_sp.count_communication() as ours_bwd, count_all_to_all() as a2a_bwd:
                out.backward(dout)
            del out
        theirs = not ours_fwd.bytes_sent  # DeepSpeed's all-to-alls are not ring_sp's calls
        return {
            "bytes_fwd": a2a_fwd if theirs else ours_fwd.bytes_sent,
            "bytes_bwd": a2a_bwd if theirs else ours_bwd.bytes_sent,
            "scores": scores[0],
            "peak_bytes": memory.peak_bytes,
        }

    return _each(_prepare(problem, modes, backend), measure)


def _checkpointed(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``attend`` under non-reentrant activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    return lambda q, k, v: checkpoint(attend, q, k, v, use_reentrant=False)


def activation_case(problem: Problem, modes: list[Mode], backend: str = "auto") -> dict[str, Result]:
    """Memory one attention layer keeps on this rank between its forward and its backward
    (``kept``: alive after the forward, its returned output excluded: the next op owns that)
    and the peak of forward+backward, plain and under activation checkpointing. The layer is
    ``attend(q, k, v) * 1``, so the attention's own output is not the value returned, as in a
    transformer layer whose projection follows."""

    def layer(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda q, k, v: attend(q, k, v) * 1.0

    def measure(ready: Ready) -> Result:
        q, k, v, dout = ready.shards
        result: Result = {}
        for name, call in (("plain", layer(ready.bound.attend)), ("checkpointed", _checkpointed(layer(ready.bound.attend)))):
            with PeakMemory(device()) as memory:
                out = call(q, k, v)
                kept = memory.live_bytes - out.untyped_storage().nbytes()
                out.backward(dout)
                del out
            ready.clear_grads()
            result[name] = {"kept_bytes": kept, "peak_bytes": memory.peak_bytes}
        return result

    return _each(_prepare(problem, modes, backend), measure)


def exactness_case(problem: Problem, modes: list[Mode], backend: str = "auto") -> dict[str, Result]:
    """Max |error| of this rank's out, dq, dk, dv against one rank running the whole
    sequence with the ``reference`` (plain PyTorch) kernel."""
    dev = device()
    q, k, v, dout = (t.requires_grad_(i < 3) for i, t in enumerate(problem.inputs(dev)))
    oracle = LocalAttention(get_kernel("reference", dev, problem.torch_dtype, problem.head_dim),
                            causal=problem.causal, scale=problem.scale)
    out = oracle(q, k, v)
    out.backward(dout)
    expected = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    def measure(ready: Ready) -> Result:
        sq, sk, sv, sdout = ready.shards
        result = ready.bound.attend(sq, sk, sv)
        result.backward(sdout)
        got = {"out": result.detach(), "dq": sq.grad, "dk": sk.grad, "dv": sv.grad}
        return {name: (got[name] - ready.bound.shard(expected[name])).abs().max().item() for name in got}

    return _each(_prepare(problem, modes, backend), measure)
