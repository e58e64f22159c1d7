"""The host side of a step: what offloading puts in a node's RAM, per rank and per node.

* Offloaded checkpoints: each layer's input hidden state ``[n, hidden]`` in the model dtype,
  every layer (``2 x hidden x layers`` bytes per token in bf16: 256 KiB for Llama-3-8B). What
  a reentrant checkpoint saves is its positional tensor arguments; transformers passes a
  decoder layer only ``hidden_states`` positionally (the rest, position embeddings included,
  as keyword arguments bound in a ``partial``), so that is all that moves. torch's caching
  host allocator rounds every pinned block up to a power of two (``CachingHostAllocator.h``,
  "Round up the allocation to the nearest power of two"), up to 2x the bytes, so ring_sp's
  ``CudaMover`` copies each checkpoint into power-of-two pieces
  (:func:`ring_sp.shapes.pinned_piece_sizes`: the size rounded up to 2 MiB);
  ``pinned_rounding=True`` models one rounded block per checkpoint. ALST copies to pageable
  memory of the exact size (``tensor.cpu()``).
* The offloaded optimizer (DeepSpeed ``offload_optimizer``): fp32 master weights, Adam's two
  fp32 moments and the fp32 gradients of the rank's ZeRO shard, 16 bytes per parameter.
* Offloaded parameters (ZeRO-3 ``offload_param``): the rank's shard in the model dtype.

A node's RAM is shared by its ranks: :func:`node_bytes` multiplies by the ranks per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shapes import pinned_piece_sizes
from .request import dtype_bytes
from .training import Training
from .transformer import Transformer

FP32 = 4
OFFLOADED_OPTIMIZER_BYTES = 3 * FP32 + FP32  # master weights, exp_avg, exp_avg_sq; fp32 gradients


def pinned_block(nbytes: int) -> int:
    """The pinned host bytes torch's caching host allocator takes for ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class HostMemory:
    """Host bytes per rank: offloaded checkpoints, optimizer state and parameters."""

    checkpoints: float
    optimizer: float
    params: float

    @property
    def total(self) -> float:
        return self.checkpoints + self.optimizer + self.params


def host_memory(model: Transformer, training: Training, *, n: int, sp: int) -> HostMemory:
    """:class:`HostMemory` of one rank holding ``n`` tokens in an SP group of ``sp`` ranks."""
    e, _ = dtype_bytes(training.dtype)
    shards = training.zero_ranks or sp
    checkpoints = 0.0
    if training.offload_checkpoints:
        one = n * model.hidden * e
        if training.rounds_pinned:
            checkpoints = model.layers * pinned_block(one)
        elif training.library == "ring_sp":  # CudaMover's power-of-two pieces: within 2 MiB of the size
            checkpoints = model.layers * sum(pinned_piece_sizes(one))
        else:
            checkpoints = model.layers * one
    optimizer = 0.0
    if training.offload_optimizer:
        optimizer = model.params * OFFLOADED_OPTIMIZER_BYTES / (shards if training.zero_stage >= 1 else 1)
    params = model.params * e / shards if training.offload_params else 0.0
    return HostMemory(checkpoints, optimizer, params)


def ranks_per_node(world_size: int, gpus_per_node: int) -> int:
    """Ranks sharing one node's RAM: a node's GPUs, or all of them on a smaller job."""
    return max(1, min(world_size, gpus_per_node))


def node_bytes(host: HostMemory, ranks: int) -> float:
    """A node's host bytes when each of its ``ranks`` holds ``host``."""
    return host.total * ranks


__all__ = ["HostMemory", "OFFLOADED_OPTIMIZER_BYTES", "host_memory", "node_bytes", "pinned_block", "ranks_per_node"]
