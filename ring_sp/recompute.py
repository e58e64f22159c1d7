"""Recompute-aware attention: an activation-checkpointing re-run does not run the ring again.

Under activation checkpointing a framework runs each layer's forward twice: once without
keeping activations, and again during backward to rebuild them. A ring forward repeated
costs the whole KV rotation and all its kernel calls again. Instead, the first run keeps
its attention output and log-sum-exp (``out`` ``[b, n, H/U, d]`` in the input dtype, ``lse``
``[b, H/U, n]`` fp32: what the backward needs besides q, k, v) in an :class:`Entry`; the
re-run finds it by its inputs and returns it, so the backward is the unchanged
:func:`ring_sp.ring.ring_backward` on the same tensors.

When is a call the FIRST run of a checkpointed forward (the only calls that keep anything)?

* reentrant checkpointing (``torch.utils.checkpoint(use_reentrant=True)``, Megatron's
  ``tensor_parallel.checkpoint`` behind ``--recompute-granularity full/selective``,
  ``deepspeed.checkpointing.checkpoint``): all three run the first forward under
  ``no_grad`` inside ``forward`` of an autograd Function named ``CheckpointFunction``. We
  look up the stack for that frame (only when grad is off) and hang the entry on ITS
  ``ctx``: the entry lives exactly as long as the checkpoint's own node.
* non-reentrant checkpointing (``use_reentrant=False``, DeepSpeed's
  ``non_reentrant_checkpoint``): the first forward runs with grad on under the
  checkpoint's saved-tensor hooks (a pack hook whose qualified name says ``checkpoint``;
  the re-run's hooks say ``recomputation``/``replay``). The entry hangs on our own node.

Anything else (a plain training step, ``no_grad`` evaluation) keeps nothing. A call with
grad on that is not a first run looks for an entry with the same signature (shapes,
dtypes, device, attention options, groups) and the same fingerprint of q, k, v (float64
sums, per row and position-weighted); a match is taken out of the registry (used once),
anything else computes afresh: never a stale result. An entry is emptied when it is
used, and in any case released after its owner's backward (a node post-hook) or when its
owner is freed (eval or an abandoned graph): the registry only holds weak references.

Head chunks (:mod:`ring_sp.function`: a ring node per chunk with Ulysses,
:class:`~ring_sp.function.RingHeadChunks` without) keep the same bytes in one entry: with
Ulysses each chunk's head-sharded ``out`` and ``lse``, without it the whole ``out`` and ``lse``.

Cost: per layer, ``out`` + ``lse`` between the first forward and the backward (with
Ulysses the head-sharded ``out``: the same bytes as the output shard), e.g. 8 heads x 64
fp32 at 1024 tokens per rank: 2.03 MiB. Worth it whenever the ring (R > 1) is on: the
re-run saves ``R`` block-kernel forwards and ``R - 1`` KV exchanges per layer. With
Ulysses the re-run still all-to-alls q, k/v and out (cheaper than keeping head-sharded
q and k/v as well); with Ulysses alone (R = 1) it saves one kernel forward.

Switch: ``reuse_on_recompute=False`` on the attention calls and the module, or
``RING_SP_REUSE_ON_RECOMPUTE=0`` for the process (default on).
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from .shapes import FINGERPRINT_BYTES

ENV_VAR = "RING_SP_REUSE_ON_RECOMPUTE"
_STACK_DEPTH = 64  # frames searched for a reentrant checkpoint's forward


def reuse_requested(reuse: bool | None) -> bool:
    """The keyword if given, else ``RING_SP_REUSE_ON_RECOMPUTE`` (default on)."""
    if reuse is not None:
        if not isinstance(reuse, bool):
            raise TypeError(f"reuse_on_recompute must be a bool or None; got {type(reuse).__name__}")
        return reuse
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_VAR}={value!r} is not a boolean; set it to 1 or 0")


def fingerprint(*tensors: torch.Tensor) -> torch.Tensor:
    """Two float64 numbers per tensor: the sum of its values and the sum of its row sums
    weighted by row position (so permuted or shifted rows differ). Reads each tensor once
    (O(N d), nothing next to attention's O(N^2 d)); stays on the tensors' device."""
    parts = []
    for t in tensors:
        rows = t.detach().reshape(-1, t.shape[-1]).sum(dim=1, dtype=torch.float64)
        weights = torch.arange(1, rows.numel() + 1, dtype=torch.float64, device=rows.device)
        parts.append(torch.stack((rows.sum(), rows.dot(weights))))
    return torch.cat(parts)


class Entry:
    """One first run's ``out`` and ``lse`` (with head chunks, each chunk's: ``out_0, lse_0,
    out_1, ...``), until a re-run takes them or the owner goes."""

    def __init__(self, key: Hashable, print_: torch.Tensor, *tensors: torch.Tensor) -> None:
        self.key, self.fingerprint = key, print_
        self.tensors: tuple[torch.Tensor, ...] | None = tuple(t.detach() for t in tensors)

    def take(self) -> tuple[torch.Tensor, ...] | None:
        tensors, self.tensors = self.tensors, None
        _registry.discard(self)
        return tensors

    def release(self) -> None:
        self.take()


class _Registry:
    """Live entries by signature, weakly: an entry's owner (an autograd node) keeps it."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, list[weakref.ref[Entry]]] = {}

    def add(self, entry: Entry) -> None:
        refs = [r for r in self._by_key.get(entry.key, []) if r() is not None]
        refs.append(weakref.ref(entry, lambda _ref, key=entry.key: self._prune(key)))
        self._by_key[entry.key] = refs

    def candidates(self, key: Hashable) -> list[Entry]:
        return [e for e in (r() for r in self._by_key.get(key, [])) if e is not None and e.tensors is not None]

    def discard(self, entry: Entry) -> None:
        refs = [r for r in self._by_key.get(entry.key, []) if r() is not None and r() is not entry]
        self._set(entry.key, refs)

    def _prune(self, key: Hashable) -> None:
        self._set(key, [r for r in self._by_key.get(key, []) if r() is not None])

    def _set(self, key: Hashable, refs: list[weakref.ref[Entry]]) -> None:
        if refs:
            self._by_key[key] = refs
        else:
            self._by_key.pop(key, None)

    def live(self) -> int:
        return sum(len(self.candidates(key)) for key in list(self._by_key))


_registry = _Registry()


def live_entries() -> int:
    """Entries still holding an ``out``/``lse`` (0 once every backward has run)."""
    return _registry.live()


def _reentrant_checkpoint_ctx() -> object | None:
    """The ``ctx`` of the innermost ``CheckpointFunction.forward`` on the stack, if any."""
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == "forward":
            ctx = frame.f_locals.get("ctx")
            if ctx is not None and type(ctx).__name__.startswith("CheckpointFunction"):
                return ctx
        frame = frame.f_back
    return None


def _under_checkpoint_hooks() -> bool:
    """The saved-tensor hooks on top are a checkpoint's first-forward hooks."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return False
    name = getattr(hooks[0], "__qualname__", "").lower()
    return "checkpoint" in name and "recomput" not in name and "replay" not in name


@dataclass
class RecomputePlan:
    """What one call does: reuse ``reused`` (out, lse), or compute and, when ``keep``, keep
    them for the re-run on ``owner`` (None = the call's own autograd node). With head chunks
    run by ``parts`` ring nodes (:mod:`ring_sp.function`), one entry holds each part's
    (out, lse) in turn: ``out_0, lse_0, out_1, ...``."""

    key: Hashable
    fingerprint: torch.Tensor | None
    reused: tuple[torch.Tensor, ...] | None = None
    keep: bool = False
    owner: object | None = None
    parts: int = 1
    _pending: list[torch.Tensor] = field(default_factory=list)

    def reuse(self, part: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Part ``part``'s reused (out, lse), handed out once (None: compute them)."""
        if self.reused is None:
            return None
        out, lse = self.reused[2 * part:2 * part + 2]
        rest = list(self.reused)
        rest[2 * part:2 * part + 2] = None, None  # the plan holds no reference once handed out
        self.reused = None if part == self.parts - 1 else tuple(rest)
        return out, lse

    def kept(self, node: object, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Keep a first run's ``out``/``lse`` (the parts', in order; the entry is made with the
        last, on its owner); released after the owner's backward."""
        if not self.keep or self.fingerprint is None:
            return
        self._pending += [out, lse]
        if len(self._pending) < 2 * self.parts:
            return
        owner = self.owner if self.owner is not None else node
        entry = Entry(self.key, self.fingerprint, *self._pending)
        self._pending = []
        entries = getattr(owner, "_ring_sp_recompute", None)
        if entries is None:
            entries = []
            owner._ring_sp_recompute = entries
            # Released after the owner's backward even if no re-run took it (e.g. a
            # re-run whose inputs changed): nothing outlives the step.
            owner.register_hook(functools.partial(_release_all, entries))
        entries.append(entry)
        _registry.add(entry)


def _release_all(entries: list[Entry], *_grads: object) -> None:
    """Node post-hook: returns None (the gradients are left as they are)."""
    for entry in entries:
        entry.release()
    entries.clear()


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: Hashable, enabled: bool) -> RecomputePlan | None:
    """Decide, before the Function runs (grad mode and hooks are visible here), whether this
    call keeps its result for a re-run, reuses a kept one, or neither (None)."""
    if not enabled:
        return None
    if not torch.is_grad_enabled():
        owner = _reentrant_checkpoint_ctx()
        if owner is None:
            return None  # evaluation: nothing comes back for it
        return RecomputePlan(key, fingerprint(q, k, v), keep=True, owner=owner)
    if _under_checkpoint_hooks():
        return RecomputePlan(key, fingerprint(q, k, v), keep=True)
    candidates = _registry.candidates(key)
    if not candidates:
        return None
    print_ = fingerprint(q, k, v)
    for entry in candidates:
        if torch.equal(entry.fingerprint, print_):
            reused = entry.take()
            if reused is not None:
                return RecomputePlan(key, print_, reused=reused)
    return None
