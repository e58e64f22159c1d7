"""The ``mpu`` ("model parallel unit") that hands DeepSpeed ring_sp's process groups.

DeepSpeed 0.19 asks an ``mpu`` for its groups (``deepspeed.utils.groups`` and the engine):

* ``get_sequence_data_parallel_group``: ZeRO partitions parameters, gradients and
  optimizer state over it and averages gradients over it; here all ``DP x SP`` ranks.
* ``get_sequence_parallel_world_size``: DeepSpeed then divides the reduced gradients by
  ``DP x SP / SP = DP``, i.e. SUMS over the SP ranks and averages over DP (see
  :mod:`ring_sp.integrations.gradient_reduction` for what that means for the loss).
* ``get_data_parallel_world_size`` / ``_rank``: batch-size arithmetic and DeepSpeed's data
  loader, so the ranks of one SP group read the same samples.
* model / tensor / pipeline parallel: there is none, so size 1 and a one-rank group. The
  group must be real: gradient clipping and overflow checks all-reduce over it, and
  ``group=None`` would mean the whole world there.

The class deliberately has no ``initialize_sequence_parallel`` method: DeepSpeed treats an
mpu that has one as its own Ulysses state and then ignores the data-parallel group.
"""

from __future__ import annotations

import torch.distributed as dist

from ring_sp import SequenceParallelTopology


class SequenceParallelMPU:
    """DeepSpeed's ``mpu`` interface over a :class:`ring_sp.SequenceParallelTopology`.

    Collective on construction only through ``new_group`` of this rank alone (local
    synchronisation, so ranks need not agree on when they build it).
    """

    def __init__(self, topology: SequenceParallelTopology) -> None:
        if not isinstance(topology, SequenceParallelTopology):
            raise TypeError(f"topology must be a ring_sp.SequenceParallelTopology; got {type(topology).__name__}")
        self.topology = topology
        self._self_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)

    # -- sequence parallel: the U x R ranks sharing one sample --------------------------
    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.topology.sp_size

    def get_sequence_parallel_rank(self) -> int:
        """Rank in :meth:`get_sequence_parallel_group` (shard data with ``topology.sp_rank``)."""
        return dist.get_rank(self.topology.sp_group)

    # -- data x sequence parallel: ZeRO partitioning and gradient reduction -------------
    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.dp_sp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.topology.dp_size * self.topology.sp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.topology.dp_sp_group)

    # -- data parallel: ranks holding different samples ---------------------------------
    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.topology.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.topology.dp_size

    def get_data_parallel_rank(self) -> int:
        return self.topology.dp_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.topology.dp_group)

    # -- model / tensor / pipeline parallel: none (one rank) ----------------------------
    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self._self_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_pipeline_model_parallel_group = get_model_parallel_group
    get_pipeline_model_parallel_world_size = get_model_parallel_world_size
    get_pipeline_model_parallel_rank = get_model_parallel_rank

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_rank()

    def __repr__(self) -> str:
        return f"SequenceParallelMPU({self.topology!r})"


__all__ = ["SequenceParallelMPU"]
