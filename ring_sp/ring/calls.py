"""How a ring step's blocks reach the kernel: the pass's kernel calls
(:func:`ring_sp.schedule.step_calls`, for what the kernel takes, :func:`kernel_caps`) and the
two functions the loops call per call, :func:`call_forward` and :func:`call_backward`.

A call is one block (the kernel's ``forward`` / ``backward`` on its slices) or, for a kernel
with ``supports_varlen``, many blocks of a step as the segments of one varlen call over the
blocks' hull of rows and keys (views, no copy). The segment offsets live on the device: a
:class:`CallPlan` is cached with the schedule and uploads the offsets of its whole pass once
per device, in one copy, so no step pays a host-to-device copy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.base import Segments
from ..schedule import BlockTask, KernelCall, KernelCaps, step_calls


def kernel_caps(kernel: object) -> KernelCaps:
    """What ``kernel`` takes (a kernel without these attributes takes squares, one block a call)."""
    return KernelCaps(bands=bool(getattr(kernel, "supports_window", False)),
                      varlen=bool(getattr(kernel, "supports_varlen", False)),
                      explicit_masks=bool(getattr(kernel, "explicit_masks", False)))


class Launch(NamedTuple):
    """One kernel call of a step and, for a varlen call, its device offsets."""

    call: KernelCall
    segments: Segments | None


class CallPlan:
    """The kernel calls of every step of a ring pass (``schedule``: its blocks per step)."""

    def __init__(self, schedule: tuple[tuple[BlockTask, ...], ...], caps: KernelCaps) -> None:
        self.calls = tuple(step_calls(tasks, caps) for tasks in schedule)
        self._launches: dict[torch.device, tuple[tuple[Launch, ...], ...]] = {}  # per device, built on first use

    def launches(self, device: torch.device) -> tuple[tuple[Launch, ...], ...]:
        """Per step, its calls with their offsets on ``device``."""
        if device not in self._launches:
            self._launches[device] = self._upload(device)
        return self._launches[device]

    def _upload(self, device: torch.device) -> tuple[tuple[Launch, ...], ...]:
        offsets = [call.offsets() for step in self.calls for call in step if call.segments]
        flat = torch.tensor([x for cu_q, cu_k in offsets for x in cu_q + cu_k], dtype=torch.int32).to(device)
        at = 0
        launches = []
        for step in self.calls:
            planned = []
            for call in step:
                segments = None
                if call.segments:
                    n = len(call.segments) + 1
                    max_q, max_k = call.max_lengths()
                    segments = Segments(flat[at:at + n], flat[at + n:at + 2 * n], max(2, max_q), max_k, call.window,
                                        call.fills_rows)
                    at += 2 * n
                planned.append(Launch(call, segments))
            launches.append(tuple(planned))
        return tuple(launches)

    def rows_disjoint(self, step: int) -> bool:
        """No two calls of ``step`` write the same rows (each call's result can be stored, not merged)."""
        spans = sorted((call.q.start, call.q.stop) for call in self.calls[step])
        return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _mask(task: BlockTask) -> dict[str, int | None]:
    """The block's mask keywords (``diagonal`` only where the schedule gave one: bands-capable kernels)."""
    return {"window": task.window, "diagonal": task.diagonal} if task.diagonal else {"window": task.window}


def call_forward(kernel: object, scale: float, launch: Launch, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on one call: (out ``[b, rows, h, d_v]``, lse ``[b, h, rows]``) of the call's rows ``launch.call.q``."""
    call = launch.call
    if launch.segments is None:
        (task,) = call.blocks
        return kernel.forward(q[:, task.q], k[:, task.kv], v[:, task.kv], causal=task.causal,  # type: ignore[attr-defined]
                              scale=scale, **_mask(task))
    return kernel.forward_segments(q[:, call.q], k[:, call.kv], v[:, call.kv], launch.segments,  # type: ignore[attr-defined]
                                   scale=scale)


def call_backward(kernel: object, scale: float, launch: Launch, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernel's gradients of one call (dq of its rows, dk/dv of its keys), given the global
    ``out`` and ``lse``."""
    call = launch.call
    if launch.segments is None:
        (task,) = call.blocks
        return kernel.backward(dout[:, task.q], q[:, task.q], k[:, task.kv], v[:, task.kv],  # type: ignore[attr-defined]
                               out[:, task.q], lse[:, :, task.q], causal=task.causal, scale=scale, **_mask(task))
    rows, keys = call.q, call.kv
    return kernel.backward_segments(dout[:, rows], q[:, rows], k[:, keys], v[:, keys],  # type: ignore[attr-defined]
                                    out[:, rows], lse[:, :, rows], launch.segments, scale=scale)
