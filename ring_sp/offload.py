"""Activation checkpoints in host memory: offloaded in the forward, brought back in the backward.

With activation checkpointing a model keeps, per layer, only the layer's input hidden state
``[b, n, H]``; at long context those are still ``layers x tokens x H`` (32 GiB for a
Llama-3-8B shard of 131K tokens). :class:`OffloadedCheckpoint` is a checkpoint function
(``fn, *args -> fn(*args)``, what Hugging Face layers call as ``_gradient_checkpointing_func``)
that checkpoints the layer and moves what the checkpoint keeps to the host through a
:class:`Mover`:

* forward: each tensor the checkpoint saves goes to the host as it is saved
  (``torch.autograd.graph.saved_tensors_hooks`` around ``torch.utils.checkpoint``);
* backward: the first unpack of layer ``i``'s tensors starts their copy back (if not yet
  started) and waits for it; with prefetch it also starts the copy of layer ``i - 1``'s (the
  next the backward needs), so that copy overlaps layer ``i``'s recompute and backward, at
  the cost of two layers' checkpoints on the device instead of one. ``prefetch=None`` (auto)
  decides per layer with :func:`ring_sp.shapes.prefetch_checkpoint`: prefetch while a
  checkpoint is at most 1/64 of the device's memory; beyond, the copy is a tiny share of a
  layer's backward and the second buffer a large share of memory (the planner,
  :mod:`ring_sp.plan.step_memory`, counts the same).

The seam is the :class:`Mover` (``to_host`` / ``to_device`` start a copy, ``wait`` returns
the result): :class:`CudaMover` uses pinned host memory, a side stream and events;
:class:`HostMover` serves CPU tensors, which already live in host memory (no copy); tests
record what moves when with a mover of their own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from .shapes import PIECE_GRANULE, pinned_piece_sizes, prefetch_checkpoint


class Mover(Protocol):
    """Moves one saved tensor to the host and back. Each call starts a copy; ``wait`` finishes one."""

    def to_host(self, tensor: torch.Tensor) -> Any:
        """Start copying ``tensor`` to host memory; return a handle (the caller drops ``tensor``)."""

    def to_device(self, handle: Any) -> Any:
        """Start copying a host handle back to its device; return a pending handle."""

    def wait(self, pending: Any) -> torch.Tensor:
        """The device tensor of a pending handle, ready for use on the current stream."""


class HostMover:
    """CPU tensors: already in host memory, so nothing moves (the handles are the tensors)."""

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def to_device(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def wait(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


def copy_into_pieces(raw: torch.Tensor, *, pin_memory: bool) -> list[torch.Tensor]:
    """Host uint8 blocks of :func:`pinned_piece_sizes` holding ``raw`` (1-D uint8), copies started non-blocking."""
    pieces, offset = [], 0
    for size in pinned_piece_sizes(raw.numel()):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
        length = min(size, raw.numel() - offset)
        host[:length].copy_(raw[offset:offset + length], non_blocking=True)
        pieces.append(host)
        offset += length
    return pieces


def copy_from_pieces(pieces: list[torch.Tensor], raw: torch.Tensor) -> None:
    """Start copying host ``pieces`` (from :func:`copy_into_pieces`) back into ``raw`` (1-D uint8)."""
    offset = 0
    for host in pieces:
        length = min(host.numel(), raw.numel() - offset)
        raw[offset:offset + length].copy_(host[:length], non_blocking=True)
        offset += length


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a 1-D uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


class CudaMover:
    """CUDA tensors to pinned host memory and back on one side stream, ordered by events.

    ``to_host``: the side stream waits for the current stream (the tensor is complete),
    copies into pinned memory and records the tensor on the side stream (its memory is not
    reused before the copy ends). The host copy is a few power-of-two pinned blocks
    (:func:`pinned_piece_sizes`), so it takes its own size of RAM, not the next power of two.
    ``to_device``: the copy back runs on the same side stream (so after the copy out).
    ``wait``: the current stream waits for that copy's event.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def to_host(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], torch.Size, torch.dtype, torch.device]:
        tensor = tensor.contiguous()  # on the current stream, before the side stream waits for it
        stream = self._stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            pieces = copy_into_pieces(_bytes_of(tensor), pin_memory=True)
        tensor.record_stream(stream)
        return pieces, tensor.shape, tensor.dtype, tensor.device

    def to_device(self, handle: tuple[list[torch.Tensor], torch.Size, torch.dtype, torch.device]
                  ) -> tuple[torch.Tensor, torch.cuda.Event]:
        pieces, shape, dtype, device = handle
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            copy_from_pieces(pieces, _bytes_of(tensor))
            done = torch.cuda.Event()
            done.record(stream)
        return tensor, done

    def wait(self, pending: tuple[torch.Tensor, torch.cuda.Event]) -> torch.Tensor:
        tensor, done = pending
        current = torch.cuda.current_stream(tensor.device)
        current.wait_event(done)
        tensor.record_stream(current)  # allocated on the side stream, used on this one
        return tensor


class DeviceMover:
    """The default: :class:`CudaMover` for CUDA tensors, :class:`HostMover` for the rest."""

    def __init__(self) -> None:
        self._host, self._cuda = HostMover(), None

    def _for(self, is_cuda: bool) -> Mover:
        if not is_cuda:
            return self._host
        if self._cuda is None:
            self._cuda = CudaMover()
        return self._cuda

    def to_host(self, tensor: torch.Tensor) -> tuple[bool, Any]:
        return tensor.is_cuda, self._for(tensor.is_cuda).to_host(tensor)

    def to_device(self, handle: tuple[bool, Any]) -> tuple[bool, Any]:
        return handle[0], self._for(handle[0]).to_device(handle[1])

    def wait(self, pending: tuple[bool, Any]) -> torch.Tensor:
        return self._for(pending[0]).wait(pending[1])


def _device_memory(device: torch.device | None) -> int | None:
    """Total memory of a CUDA device; None for any other (CPU tensors do not move)."""
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


class _Layer:
    """What one checkpointed layer call saved: host handles, then pending device copies.
    ``nbytes`` and ``device`` of what it saved are recorded at pack time, so deciding the
    prefetch in the backward needs no sync."""

    def __init__(self, mover: Mover, index: int, previous: _Layer | None, prefetch: bool | None) -> None:
        self.mover, self.index, self.prefetch = mover, index, prefetch
        self.previous = None if previous is None else weakref.ref(previous)  # the layer before, in the forward
        self.host: list[Any] = []
        self.pending: list[Any] | None = None
        self.unpacked = False  # whether this layer's backward has started
        self.nbytes: int = 0
        self.device: torch.device | None = None

    def pack(self, tensor: torch.Tensor) -> tuple[_Layer, int]:
        self.nbytes += tensor.numel() * tensor.element_size()
        self.device = tensor.device
        self.host.append(self.mover.to_host(tensor))
        return self, len(self.host) - 1

    def fetch(self) -> None:
        """Start every copy back (once)."""
        if self.pending is None:
            self.pending = [None if h is None else self.mover.to_device(h) for h in self.host]

    def _prefetches(self, previous: _Layer) -> bool:
        """Whether ``previous``'s copy back starts now, during this layer's backward."""
        if self.prefetch is not None:
            return self.prefetch
        return prefetch_checkpoint(previous.nbytes, _device_memory(previous.device))

    def unpack(self, handle: tuple[_Layer, int]) -> torch.Tensor:
        _, i = handle
        if not self.unpacked:  # this layer's backward starts (its copy may have been prefetched)
            self.unpacked = True
            self.fetch()
            previous = None if self.previous is None else self.previous()
            if previous is not None and self._prefetches(previous):
                previous.fetch()  # one layer ahead: the backward needs it next
        tensor = self.mover.wait(self.pending[i])
        self.host[i] = self.pending[i] = None  # each saved tensor is unpacked once
        return tensor


class OffloadedCheckpoint:
    """A checkpoint function whose kept tensors live in host memory (see the module docstring).

    ``mover``: where tensors go (default :class:`DeviceMover`). Call as
    ``checkpoint(fn, *args)``; it runs ``torch.utils.checkpoint.checkpoint(fn, *args,
    use_reentrant=True)``, whose saved inputs pass through the mover (the non-reentrant
    variant keeps its inputs out of reach of saved-tensor hooks). ``layers_called`` counts
    calls (the forward order that decides the prefetch).

    ``prefetch``: True copies layer ``i - 1``'s checkpoint back when layer ``i``'s backward
    starts (two on the device, the copy hidden behind the backward); False copies each when
    its own backward starts (one on the device); None (auto, the default) decides per layer
    by :func:`ring_sp.shapes.prefetch_checkpoint` from the bytes the previous layer saved and
    its device's total memory (always prefetch off a GPU).
    """

    def __init__(self, mover: Mover | None = None, *, prefetch: bool | None = None) -> None:
        if prefetch is not None and not isinstance(prefetch, bool):
            raise TypeError(f"prefetch={prefetch!r} must be True, False or None (auto: prefetch while a "
                            f"checkpoint is small next to the device's memory); pass one of those")
        self.mover: Mover = DeviceMover() if mover is None else mover
        self.prefetch = prefetch
        self.layers_called = 0
        self._last: Callable[[], _Layer | None] = lambda: None

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        layer = _Layer(self.mover, self.layers_called, self._last(), self.prefetch)
        self.layers_called += 1
        self._last = weakref.ref(layer)
        with torch.autograd.graph.saved_tensors_hooks(layer.pack, lambda handle: handle[0].unpack(handle)):
            return checkpoint(fn, *args, use_reentrant=True, **kwargs)


__all__ = ["CudaMover", "DeviceMover", "HostMover", "Mover", "OffloadedCheckpoint"]
