"""The one seam between ``gpu_check`` and the GPU: the device, a memory counter, a timer.

Every section measures through a :class:`Seam` and calls nothing CUDA-only itself, so the
dry mode (``--dry``) runs the sections' own code on the CPU at tiny sizes:

* device and dtype: CUDA with bf16, or the CPU with float32;
* memory: CUDA's ``memory_allocated`` / ``max_memory_allocated`` / ``max_memory_reserved``,
  or on the CPU :class:`benchmarks.memory.LiveTensorBytes` (every tensor storage an op
  creates inside the block, from creation to release), which also stands in for the card's
  capacity: past ``limit_bytes`` it raises :class:`SimulatedOutOfMemory`, so the search for
  the longest sequence that fits runs its whole path on the CPU;
* timer: CUDA events around the call, or ``time.perf_counter``;
* profiler: torch.profiler's CUDA kernels by their own device time, or on the CPU its ops
  by their own CPU time (:meth:`Seam.profile`);
* the attention every rate is set against: cuDNN's SDPA, or on the CPU its flash SDPA
  (:meth:`Seam.sdpa_reference`).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

from ..memory import LiveTensorBytes

PROFILE_NAME_CHARS = 100  # kernel names are C++ template instantiations: cut


class SimulatedOutOfMemory(RuntimeError):
    """The CPU stand-in's out-of-memory: live tensor bytes went past the block's limit."""


class _LimitedLiveBytes(LiveTensorBytes):
    """:class:`LiveTensorBytes` that raises :class:`SimulatedOutOfMemory` past ``limit`` bytes."""

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        super()._track(storage, inputs)
        if self.limit is not None and self.live > self.limit:
            raise SimulatedOutOfMemory(f"CPU stand-in: {self.live:,} live tensor bytes exceed {self.limit:,}")


@dataclass
class MemoryReading:
    """One block's memory: ``start`` allocated when it began (CPU: 0, only growth is seen),
    ``peak`` the most allocated during it, ``reserved`` the allocator's most reserved (CUDA)."""

    start: int = 0
    peak: int = 0
    reserved: int | None = None

    @property
    def added(self) -> int:
        return self.peak - self.start


class Seam:
    """Device, memory counter and timer (module docstring). ``Seam.open(dry)`` picks them."""

    def __init__(self, device: torch.device, dry_capacity_bytes: int = 2**30) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.dtype = torch.bfloat16 if self.is_cuda else torch.float32
        self.dry_capacity = dry_capacity_bytes
        self._budget: int | None = None

    @classmethod
    def open(cls, dry: bool, dry_capacity_bytes: int = 2**30) -> Seam:
        if dry:
            return cls(torch.device("cpu"), dry_capacity_bytes)
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks.gpu_check needs a CUDA GPU (torch.cuda.is_available() is False); "
                             "--dry runs every section on the CPU at tiny sizes")
        return cls(torch.device("cuda", torch.cuda.current_device()))

    # -- the device ---------------------------------------------------------------------
    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Return freed memory (after an out-of-memory or between measurements)."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()

    def capacity(self) -> int:
        """Bytes the process may hold: the card's total memory (or the dry stand-in's), or the
        budget of :meth:`budget` while one is set."""
        total = torch.cuda.get_device_properties(self.device).total_memory if self.is_cuda else self.dry_capacity
        return total if self._budget is None else min(total, self._budget)

    def device_memory(self) -> int | None:
        """The card's total memory whatever the budget (what ring_sp's offload prefetch rule reads), None on the CPU."""
        return torch.cuda.get_device_properties(self.device).total_memory if self.is_cuda else None

    @contextmanager
    def budget(self, limit_bytes: int | None) -> Iterator[None]:
        """Hold the process to ``limit_bytes`` (None: no limit) inside the block: CUDA's
        ``set_per_process_memory_fraction`` (the allocator raises out-of-memory past it), or the
        stand-in's capacity."""
        if limit_bytes is None:
            yield
            return
        self.release()  # cached blocks would be reused past the limit: hand them back first
        if self.is_cuda:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total), self.device)
        self._budget = limit_bytes
        try:
            yield
        finally:
            self._budget = None
            if self.is_cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def allocated(self) -> int:
        """Bytes allocated now (CPU: 0; the stand-in sees only growth inside a block)."""
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def is_out_of_memory(self, exc: BaseException) -> bool:
        return isinstance(exc, (torch.cuda.OutOfMemoryError, SimulatedOutOfMemory))

    def out_of_memory_record(self, exc: Exception) -> str:
        """The one line a record keeps of ``exc`` if it is an out-of-memory (the step did not fit);
        any other exception is raised again."""
        if not self.is_out_of_memory(exc):
            raise exc
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"

    # -- the memory counter ---------------------------------------------------------------
    @contextmanager
    def memory(self, limit_bytes: int | None = None) -> Iterator[MemoryReading]:
        """``with seam.memory() as m: ...`` then ``m.added``, ``m.peak``, ``m.reserved``.
        ``limit_bytes`` (CPU only): growth past it raises :class:`SimulatedOutOfMemory`."""
        reading = MemoryReading()
        if self.is_cuda:
            self.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
            reading.start = torch.cuda.memory_allocated(self.device)
            try:
                yield reading
            finally:
                self.synchronize()
                reading.peak = torch.cuda.max_memory_allocated(self.device)
                reading.reserved = torch.cuda.max_memory_reserved(self.device)
            return
        mode = _LimitedLiveBytes(limit_bytes)
        with mode:
            try:
                yield reading
            finally:
                reading.peak = mode.peak

    # -- the timer --------------------------------------------------------------------------
    def time(self, fn: Callable[[], object]) -> float:
        """Seconds of one call of ``fn``: CUDA events around it, or the host clock."""
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin

    def median_time(self, fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
        """(median, every repeat) of ``repeats`` timed calls after ``warmup`` untimed ones."""
        for _ in range(warmup):
            fn()
        self.synchronize()
        times = [self.time(fn) for _ in range(max(1, repeats))]
        return statistics.median(times), times

    # -- the profiler ------------------------------------------------------------------------
    def profile(self, fn: Callable[[], object], top: int = 8) -> dict:
        """One call of ``fn`` under torch.profiler: ``{"what", "total_ms", "top": [{"name",
        "self_ms", "calls", "share"}, ...]}``, the ``top`` CUDA kernels (memory copies and sets
        included) by their own device time, or on the CPU the ops by their own CPU time;
        ``total_ms`` sums every one of them."""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.is_cuda else [])
        self.synchronize()
        with profile(activities=activities) as prof:
            fn()
            self.synchronize()
        kind = torch.autograd.DeviceType.CUDA if self.is_cuda else torch.autograd.DeviceType.CPU
        mine = [e for e in prof.key_averages() if e.device_type == kind]
        own = (lambda e: e.self_device_time_total) if self.is_cuda else (lambda e: e.self_cpu_time_total)
        total = sum(own(e) for e in mine)
        mine.sort(key=own, reverse=True)
        return {"what": "CUDA kernels by self device time" if self.is_cuda else "CPU ops by self CPU time (dry)",
                "total_ms": total / 1e3,
                "top": [{"name": e.key[:PROFILE_NAME_CHARS], "self_ms": own(e) / 1e3, "calls": e.count,
                         "share": own(e) / total if total else 0.0} for e in mine[:top]]}

    # -- the reference attention ----------------------------------------------------------------
    def sdpa_reference(self) -> tuple[SDPBackend, str]:
        """(SDPA backend, its name) every attention rate is set against: cuDNN's on CUDA, the
        CPU flash SDPA in the dry run (a stand-in: the CPU has no cuDNN)."""
        if self.is_cuda:
            return SDPBackend.CUDNN_ATTENTION, "cuDNN SDPA"
        return SDPBackend.FLASH_ATTENTION, "CPU flash SDPA (dry stand-in for cuDNN SDPA)"


class Deadline:
    """A section's time cap: ``left()`` seconds remain; ``allows(cost)`` if a step predicted
    to take ``cost`` seconds still fits."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, cost: float) -> bool:
        return cost <= self.left()
