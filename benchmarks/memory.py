"""Peak memory a call adds on this rank.

CUDA: the caching allocator's ``max_memory_allocated`` above what was allocated before.
CPU has no allocator statistics, so :class:`LiveTensorBytes` tracks tensor storages
precisely instead: every storage an ATen op creates inside the block is counted from its
creation until it is freed (a weakref finalizer on the storage), and the peak of the
live sum is kept. It counts the outputs of every op, forward and backward, including
communication buffers and autograd's saved tensors; not scratch memory a kernel allocates
and frees inside one op, nor the process groups' own buffers. Tensors alive before the
block (the inputs) are not counted, so both devices report growth during the call.
gloo's worker threads release the buffers of a finished collective on their own schedule;
before each op the tracker yields the GIL so they do it first, which makes the count the
same from one call to the next (without it the peak moves by up to one buffer).
"""

from __future__ import annotations

import time
import weakref
from types import TracebackType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the block and still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        # id of the storage's Python object -> its bytes. One object per storage for its whole life
        # (PyTorch preserves it), and an id is only reused after the finalizer below has run; a
        # data pointer, by contrast, can be reused while a communication thread still frees the old one.
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        time.sleep(0)  # let communication threads waiting for the GIL drop buffers they are done with
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key, size = id(storage), storage.nbytes()
        # views and in-place results share an input's storage: nothing new was allocated
        if size == 0 or key in inputs or key in self._sizes:
            return
        self._sizes[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key)


class PeakMemory:
    """``with PeakMemory(device) as mem: ...`` then ``mem.peak_bytes``: the most memory the
    block held at once beyond what was allocated when it started."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0
        self._mode: LiveTensorBytes | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = LiveTensorBytes()
            self._mode.__enter__()
        return self

    @property
    def live_bytes(self) -> int:
        """Bytes allocated inside the block and still alive now (call inside the block)."""
        if self._mode is not None:
            return self._mode.live
        return torch.cuda.memory_allocated(self.device) - self._start

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._mode is not None:
            self._mode.__exit__(kind, exc, tb)
            self.peak_bytes = self._mode.peak
        else:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
