"""Memory of one whole training step per rank, and the longest sequence that fits (issues 20, 30).

:func:`step_memory` adds up, per rank, for a decoder-only LM (:class:`Transformer`) trained
as :class:`Training` says on ``N`` tokens over a ``U x R`` grid (``n = N / (U R)`` tokens per
rank):

* resident state: parameters, gradients and Adam's two fp32 moments (plus fp32 master
  weights when training in bf16/fp16), each sharded over the ZeRO ranks from its stage
  on (params at 3, gradients at 2, optimizer states at 1), or moved to the host;
  ZeRO-3's gathered layers and the gradient reduce bucket;
* activations kept for backward: every layer's tensors (:func:`layer_kept`, counted from
  the modules' saved tensors, :mod:`ring_sp.plan.layer_memory`), or with activation
  checkpointing only each layer's input (on the device, or in host memory with one or two
  layers' worth on the device: two while the runtime prefetches,
  :meth:`Training.device_checkpoint_layers`), and ring_sp's recompute entries where kept
  (each layer's attention out + lse until its backward, :func:`~.layer_memory.recompute_entry`);
* the largest transient, over the step's phases (:class:`StepMemory.phase`): the loss, one
  layer's backward and the optimizer update (:mod:`ring_sp.plan.layer_memory`);
* on the host (:mod:`ring_sp.plan.host_memory`): offloaded checkpoints, optimizer, parameters.

:func:`longest_sequence` searches the longest ``N`` whose step fits the GPU's memory AND the
node's host memory, and names the binding one. The counts are checked on CPU against the
measured peak of one step (``tests/test_step_memory.py``, the benchmark's ``length``
section). Not modelled: the CUDA context and NCCL buffers (``reserved_bytes``) and allocator
fragmentation (``fragmentation``, a fraction of the transient memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .host_memory import HostMemory, host_memory
from .layer_memory import (alst_attention_memory, head_chunk_count, layer_backward_phase, layer_kept, loss_phase,
                           norm_kept, recompute_entry)
from .request import PlanError, dtype_bytes
from .training import Training, alst, long_sequence
from .transformer import PRESETS, Transformer, model_from

FP32 = 4
ADAM_STATE_BYTES = 2 * FP32  # exp_avg and exp_avg_sq
GPU_BOUND, HOST_BOUND = "GPU memory", "host memory"


@dataclass(frozen=True)
class StepMemory:
    """Bytes per rank: resident state, activations kept for backward, and the largest
    transient with the phase it occurs in. ``total`` is the device's peak; ``host`` what the
    rank puts in host memory; ``head_chunks`` the attention's chunks of heads."""

    seq_len: int
    tokens_per_rank: int
    params: float
    grads: float
    optimizer: float
    zero_buffers: float
    checkpoints: float
    kept: float  # all layers' activations (none with checkpointing)
    transient: float
    phase: str
    reserved: float
    phases: dict[str, float] = field(default_factory=dict)
    host: HostMemory = HostMemory(0.0, 0.0, 0.0)
    head_chunks: int = 1

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.zero_buffers + self.checkpoints + self.kept
                + self.transient + self.reserved)

    def breakdown(self) -> dict[str, float]:
        return {"parameters": self.params, "gradients": self.grads, "optimizer states": self.optimizer,
                "ZeRO buffers": self.zero_buffers, "checkpointed activations": self.checkpoints,
                "kept activations": self.kept, f"transient ({self.phase})": self.transient,
                "reserved": self.reserved}


def _resident(model: Transformer, training: Training, sp: int) -> tuple[float, float, float, float]:
    """(params, grads, optimizer states, ZeRO buffers) bytes on the device."""
    e, _ = dtype_bytes(training.dtype)
    shards = training.zero_ranks or sp
    stage = training.zero_stage
    p = model.params
    master = training.master_weights if training.master_weights is not None else e != FP32
    params = 0.0 if training.offload_params else p * e / (shards if stage >= 3 else 1)
    if training.offload_optimizer:  # gradients are handed to the host bucket by bucket
        grads, states = 0.0, 0.0
    else:
        grads = p * (FP32 if master else e) / (shards if stage >= 2 else 1)
        states = p * (ADAM_STATE_BYTES + (FP32 if master else 0)) / (shards if stage >= 1 else 1)
    buffers = 0.0
    if stage >= 1 and shards > 1:
        buffers += min(training.reduce_bucket, p) * e  # the gradient reduce bucket
    if stage >= 3:  # the layer being computed and the prefetched next one, gathered whole
        buffers += 2 * model.layer_params * e
    return params, grads, states, buffers


def step_memory(model: Transformer, training: Training, *, seq_len: int, ulysses: int = 1, ring: int = 1,
                memory_bytes: float | None = None) -> StepMemory:
    """The peak bytes per rank of one training step of ``seq_len`` tokens (batch 1) on a
    ``ulysses x ring`` grid; :class:`StepMemory` breaks it down. ``memory_bytes``: the GPU's
    memory, for ring_sp's automatic checkpoint prefetch (None: unknown, prefetch)."""
    training.check()
    sp = ulysses * ring
    if seq_len < sp:
        raise PlanError(f"seq-len={seq_len} is shorter than the SP degree {sp}")
    e, _ = dtype_bytes(training.dtype)
    n = seq_len // sp
    params, grads, states, buffers = _resident(model, training, sp)
    one_layer = layer_kept(model, training, n=n, ulysses=ulysses, ring=ring)
    if training.checkpointing:
        checkpoint = n * e * model.hidden  # one layer's input
        # offloaded: one or two on the device (a second only where a previous layer can be prefetched)
        on_device = (min(model.layers, training.device_checkpoint_layers(checkpoint, memory_bytes))
                     if training.offload_checkpoints else model.layers)
        checkpoints, kept, recompute = on_device * checkpoint, 0.0, one_layer
    else:
        checkpoints, kept, recompute = 0.0, model.layers * one_layer, 0.0
    # ring_sp's recompute entries: every layer's during the loss, the L - 1 not yet used at the first layer backward
    entry = recompute_entry(model, training, n=n, ulysses=ulysses, ring=ring)
    checkpoints += (model.layers - 1) * entry
    layer = layer_backward_phase(model, training, n=n, ulysses=ulysses, ring=ring, recompute=recompute)
    optimizer = 0.0 if training.offload_optimizer else 2 * model.largest_param * FP32  # Adam's sqrt / divide temporaries
    phases = {"loss": loss_phase(model, training, n) + entry, "layer backward": layer, "optimizer update": optimizer}
    phase = max(phases, key=phases.get)
    transient = phases[phase] * (1 + training.fragmentation)
    return StepMemory(seq_len, n, params, grads, states, buffers, checkpoints, kept, transient, phase,
                      training.reserved_bytes, phases, host_memory(model, training, n=n, sp=sp),
                      head_chunk_count(model, training, ulysses, n=n, ring=ring))


def _longest(fits, unit: int) -> int:
    """The largest multiple ``k * unit`` with ``fits(k)`` (monotone), 0 if even ``unit`` does not.
    (The auto prefetch drops one checkpoint, at most 1/64 of the GPU, where it turns off; the
    search still returns a length that fits, with the next one not fitting.)"""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40 // unit:
            raise PlanError("the step's memory does not grow with the sequence: check the configuration")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


@dataclass(frozen=True)
class Longest:
    """The longest sequence of one grid: ``tokens`` (0: nothing fits), its step (None then),
    the limit that binds ("GPU memory" or "host memory"), and the host bytes per node."""

    tokens: int
    step: StepMemory | None
    bound_by: str
    host_per_node: float


def longest_sequence(model: Transformer, training: Training, memory_bytes: float, *, ulysses: int = 1,
                     ring: int = 1, host_bytes: float = math.inf, ranks_per_node: int = 1,
                     multiple: int | None = None) -> Longest:
    """The longest sequence (a multiple of ``multiple``, default ``2 x SP`` for zigzag) whose step
    fits ``memory_bytes`` per GPU and whose host share fits ``host_bytes`` per node of
    ``ranks_per_node`` ranks; ``bound_by`` names the limit that stops it."""
    unit = multiple or 2 * ulysses * ring
    step = lambda k: step_memory(model, training, seq_len=k * unit, ulysses=ulysses, ring=ring,  # noqa: E731
                                 memory_bytes=memory_bytes)
    on_gpu = lambda k: step(k).total <= memory_bytes  # noqa: E731
    on_host = lambda k: step(k).host.total * ranks_per_node <= host_bytes  # noqa: E731
    gpu_only = _longest(on_gpu, unit)
    tokens = _longest(lambda k: on_gpu(k) and on_host(k), unit)
    bound = HOST_BOUND if tokens < gpu_only else GPU_BOUND
    best = step(tokens // unit) if tokens else None
    return Longest(tokens, best, bound, 0.0 if best is None else best.host.total * ranks_per_node)


def max_seq_len(model: Transformer, training: Training, memory_bytes: float, *, ulysses: int = 1, ring: int = 1,
                multiple: int | None = None) -> tuple[int, StepMemory | None]:
    """The longest sequence whose step fits in ``memory_bytes`` per rank (GPU memory only; see
    :func:`longest_sequence` for the host bound), and its breakdown; (0, None) if none does."""
    found = longest_sequence(model, training, memory_bytes, ulysses=ulysses, ring=ring, multiple=multiple)
    return found.tokens, found.step


__all__ = ["GPU_BOUND", "HOST_BOUND", "PRESETS", "HostMemory", "Longest", "StepMemory", "Training", "Transformer",
           "alst", "alst_attention_memory", "layer_kept", "long_sequence", "longest_sequence", "max_seq_len",
           "model_from", "norm_kept", "step_memory"]
