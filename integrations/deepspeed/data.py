"""Feeding a sequence-parallel job: one sample per SP group, sharded per SP rank.

The ``U x R`` ranks of one SP group must read the SAME samples (each holds different
tokens of them) while different data-parallel replicas read different ones. The sampler
therefore splits the dataset over ``dp_size`` replicas (by ``dp_rank``), not over all
ranks, and the collator shards each full batch with ``topology.shard_batch`` (labels
shifted on the full sequence before sharding, ``position_ids`` kept global for RoPE).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.data import default_collate

from ring_sp import SequenceParallelTopology, shard_batch


def _replicas(topology: SequenceParallelTopology | None) -> tuple[int, int]:
    """(data-parallel replicas, this rank's replica): ``topology``'s, else every rank of the default group its own."""
    if topology is not None:
        return topology.dp_size, topology.dp_rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


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
    replicas, rank = _replicas(topology)
    return DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)


class ReplicaSlice(torch.utils.data.Sampler[int]):
    """Indices ``dp_rank, dp_rank + dp_size, ...`` of a dataset in order: each sample once.

    For evaluation, where ``DistributedSampler``'s padding (repeating samples so replicas
    get equal counts) would count some samples twice in the mean; replicas may get one
    sample less than others. Every rank of one SP group gets the same indices.
    """

    def __init__(self, length: int, replicas: int, rank: int) -> None:
        self.length, self.replicas, self.rank = length, replicas, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.replicas))


def sequence_parallel_eval_sampler(dataset: Dataset, topology: SequenceParallelTopology | None) -> ReplicaSlice:
    """The evaluation sampler over ``topology``'s data-parallel replicas (:class:`ReplicaSlice`):
    every sample of ``dataset`` exactly once, in order. ``topology=None``: over the default group."""
    replicas, rank = _replicas(topology)
    return ReplicaSlice(len(dataset), replicas, rank)


class ShardingCollator:
    """``collate_fn`` that stacks samples into ``[b, N]`` and returns this rank's shard.

    A sample is a ``[N]`` token tensor (taken as ``input_ids``) or a mapping of ``[N, ...]``
    tensors with ``input_ids`` and optionally ``labels``, ``position_ids``, masks. Returns
    ``{"input_ids", "labels", "position_ids", ...}``, each ``[b, N_pad / sp_size, ...]``: see
    :func:`ring_sp.shard_batch` for ``shift`` (True: labels are next-token targets made by
    shifting on the full sequence). ``N`` may be any length: when it is not a multiple of
    the layout's unit the batch is padded at its end (labels ignored) and ``cu_seqlens``
    (int32, the padding as its own document) is added, to pass to the attention (needed
    for non-causal attention; causal attention never sees the tail padding). ``topology=None``
    only stacks and shifts (SP size 1).
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


class PackingCollator:
    """``collate_fn`` for packed documents: the micro-batch becomes ONE packed row (THD).

    A sample is ``{"input_ids": [n], "cu_seqlens": [k + 1]}`` (its documents' boundaries,
    0 .. n). The samples are concatenated into ``[1, N = sum n]`` with merged boundaries (our
    ``cu_seqlens`` describes one row). No document is padded (``document_zigzag`` splits
    documents of any length); only the end of the row is, to a multiple of the layout's
    unit, as its own document (fewer than ``sp_size`` tokens for ``document_zigzag``;
    padding never enters the loss). The row is sharded for this SP rank with labels shifted
    inside each document and positions restarting per document. Returns ``input_ids``,
    ``labels``, ``position_ids`` ``[1, N_pad / sp_size]`` and ``cu_seqlens`` (int32
    ``[docs + 1]``, the GLOBAL boundaries with the padding document, the same on every rank
    of the SP group) to pass to the attention.
    """

    def __init__(self, topology: SequenceParallelTopology | None, *, layout: str = "document_zigzag", pad_id: int = 0) -> None:
        if topology is not None and not isinstance(topology, SequenceParallelTopology):
            raise TypeError(f"topology must be a ring_sp.SequenceParallelTopology or None; got {type(topology).__name__}")
        self.topology, self.layout, self.pad_id = topology, layout, pad_id

    def __call__(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        pieces, boundaries = [], [0]
        for sample in samples:
            if not isinstance(sample, Mapping) or "cu_seqlens" not in sample:
                raise TypeError("PackingCollator samples must be mappings with 'input_ids' [n] and 'cu_seqlens' [k + 1]")
            pieces.append(sample["input_ids"])
            offset = boundaries[-1]
            boundaries.extend(offset + int(end) for end in sample["cu_seqlens"].tolist()[1:])
        batch: dict[str, torch.Tensor] = {"input_ids": torch.cat(pieces).unsqueeze(0)}
        cu = tuple(boundaries)
        if self.topology is None:
            return shard_batch(batch, rank=0, world_size=1, layout=self.layout, cu_seqlens=cu, pad_id=self.pad_id)
        return self.topology.shard_batch(batch, layout=self.layout, cu_seqlens=cu, pad_id=self.pad_id)


def sequence_parallel_dataloader(
    dataset: Dataset,
    topology: SequenceParallelTopology | None,
    *,
    batch_size: int,
    layout: str = "zigzag",
    shuffle: bool = True,
    seed: int = 0,
    shift: bool = True,
    pack: bool = False,
    **loader_kwargs: Any,
) -> DataLoader:
    """A ``DataLoader`` of sharded batches: :func:`sequence_parallel_sampler` + :class:`ShardingCollator`.

    ``batch_size`` is the micro-batch per SP group (DeepSpeed's
    ``train_micro_batch_size_per_gpu``); each batch holds ``[batch_size, N / sp_size]``
    tensors. ``pack=True``: samples carry ``cu_seqlens`` and each micro-batch becomes one
    packed row (:class:`PackingCollator`, ``shift`` ignored). The loader's ``sampler``
    attribute is the ``DistributedSampler`` (``set_epoch``). Extra keyword arguments go to
    ``DataLoader`` (``num_workers``, ...).
    """
    sampler = sequence_parallel_sampler(dataset, topology, shuffle=shuffle, seed=seed)
    collate = PackingCollator(topology, layout=layout) if pack else ShardingCollator(topology, layout=layout, shift=shift)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate, drop_last=True, **loader_kwargs)


__all__ = ["PackingCollator", "ReplicaSlice", "ShardingCollator", "sequence_parallel_dataloader", "sequence_parallel_eval_sampler",
           "sequence_parallel_sampler"]
