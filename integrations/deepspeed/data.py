"""Feeding a sequence-parallel job: one sample per SP group, sharded per SP rank.

The ``U x R`` ranks of one SP group must read the SAME samples (each holds different
tokens of them) while different data-parallel replicas read different ones. The sampler
therefore splits the dataset over ``dp_size`` replicas (by ``dp_rank``), not over all
ranks, and the collator shards each full batch with ``topology.shard_batch`` (labels
shifted on the full sequence before sharding, ``position_ids`` kept global for RoPE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.data import default_collate

from ring_sp import SequenceParallelTopology, shard_batch


def sequence_parallel_sampler(
    dataset: Dataset,
    topology: SequenceParallelTopology | None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
) -> DistributedSampler:
    """A ``DistributedSampler`` over the data-parallel replicas of ``topology``.

    Every rank of one SP group draws the same indices; replicas draw disjoint ones. With
    ``topology=None`` (no sequence parallelism) every rank is its own replica (the default
    group, or one replica when torch.distributed is not initialised). Call
    ``set_epoch(epoch)`` each epoch as for any ``DistributedSampler``.
    """
    if topology is not None:
        replicas, rank = topology.dp_size, topology.dp_rank
    elif dist.is_available() and dist.is_initialized():
        replicas, rank = dist.get_world_size(), dist.get_rank()
    else:
        replicas, rank = 1, 0
    return DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)


class ShardingCollator:
    """``collate_fn`` that stacks samples into ``[b, N]`` and returns this rank's shard.

    A sample is a ``[N]`` token tensor (taken as ``input_ids``) or a mapping of ``[N, ...]``
    tensors with ``input_ids`` and optionally ``labels``, ``position_ids``, masks. Returns
    ``{"input_ids", "labels", "position_ids", ...}``, each ``[b, N / sp_size, ...]``: see
    :func:`ring_sp.shard_batch` for ``shift`` (True: labels are next-token targets made by
    shifting on the full sequence). ``topology=None`` only stacks and shifts (SP size 1).
    """

    def __init__(self, topology: SequenceParallelTopology | None, *, layout: str = "zigzag", shift: bool = True) -> None:
        if topology is not None and not isinstance(topology, SequenceParallelTopology):
            raise TypeError(f"topology must be a ring_sp.SequenceParallelTopology or None; got {type(topology).__name__}")
        self.topology, self.layout, self.shift = topology, layout, shift

    def __call__(self, samples: Sequence[torch.Tensor | Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch: Any = default_collate(list(samples))
        if isinstance(batch, torch.Tensor):
            batch = {"input_ids": batch}
        if not isinstance(batch, Mapping):
            raise TypeError(f"samples must be token tensors or mappings of tensors; got {type(samples[0]).__name__}")
        if self.topology is None:
            return shard_batch(batch, rank=0, world_size=1, layout=self.layout, shift=self.shift)
        return self.topology.shard_batch(batch, layout=self.layout, shift=self.shift)


def sequence_parallel_dataloader(
    dataset: Dataset,
    topology: SequenceParallelTopology | None,
    *,
    batch_size: int,
    layout: str = "zigzag",
    shuffle: bool = True,
    seed: int = 0,
    shift: bool = True,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` of sharded batches: :func:`sequence_parallel_sampler` + :class:`ShardingCollator`.

    ``batch_size`` is the micro-batch per SP group (DeepSpeed's
    ``train_micro_batch_size_per_gpu``); each batch holds ``[batch_size, N / sp_size]``
    tensors. The loader's ``sampler`` attribute is the ``DistributedSampler``
    (``set_epoch``). Extra keyword arguments go to ``DataLoader`` (``num_workers``, ...).
    """
    sampler = sequence_parallel_sampler(dataset, topology, shuffle=shuffle, seed=seed)
    collate = ShardingCollator(topology, layout=layout, shift=shift)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True, **loader_kwargs)


__all__ = ["ShardingCollator", "sequence_parallel_dataloader", "sequence_parallel_sampler"]
