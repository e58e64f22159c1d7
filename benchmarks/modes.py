"""The problems and the modes the benchmark compares, bound to this rank.

A :class:`Problem` is one attention layer's global inputs (seeded, identical on every
rank); a :class:`Mode` is a way to compute it over ``P`` ranks. :func:`bind` turns the
pair into a callable on this rank's shard, with the shard function that mode expects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ring_sp
from ring_sp.kernels import get_kernel

from .deepspeed_baseline import deepspeed_ulysses
from .local_attention import LocalAttention


@dataclass(frozen=True)
class Problem:
    """One attention layer: q ``[batch, seq_len, heads, head_dim]``, k/v with ``kv_heads``."""

    seq_len: int
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    batch: int = 1
    dtype: str = "float32"
    causal: bool = True
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Global q, k, v and the upstream gradient, identical on every rank."""
        g = torch.Generator().manual_seed(self.seed)
        shapes = [(self.batch, self.seq_len, h, self.head_dim) for h in (self.heads, self.kv_heads, self.kv_heads)]
        tensors = [torch.randn(s, generator=g, dtype=self.torch_dtype) for s in shapes + shapes[:1]]
        return tuple(t.to(device) for t in tensors)


@dataclass(frozen=True)
class Mode:
    """``kind``: ring, ulysses, hybrid (U x P/U), deepspeed (DistributedAttention) or single
    (one rank, the whole sequence)."""

    name: str
    kind: str
    layout: str = "zigzag"
    ulysses: int = 1  # hybrid only

    def grid(self, world_size: int) -> tuple[int, int]:
        """(U, R) on ``world_size`` ranks."""
        if self.kind == "ring":
            return 1, world_size
        if self.kind == "hybrid":
            return self.ulysses, world_size // self.ulysses
        return (world_size, 1) if self.kind in ("ulysses", "deepspeed") else (1, 1)


SINGLE = Mode("1 rank", "single", "contiguous")
DEEPSPEED = Mode("DeepSpeed Ulysses", "deepspeed", "contiguous")


def comparison_modes(world_size: int) -> list[Mode]:
    """Every mode on ``world_size`` ranks: the ring with each layout, Ulysses, the 2 x P/2 grid, DeepSpeed."""
    modes = [Mode(f"ring {layout}", "ring", layout) for layout in ("contiguous", "zigzag", "striped")]
    modes.append(Mode("Ulysses", "ulysses", "contiguous"))  # DeepSpeed's layout: no reorder on either side
    if world_size >= 4 and world_size % 2 == 0:
        modes.append(Mode("hybrid U=2", "hybrid", "zigzag", ulysses=2))
    return modes + [DEEPSPEED]


_topologies: dict[tuple, ring_sp.SequenceParallelTopology] = {}


def topology(group: dist.ProcessGroup, ulysses: int, ring: int) -> ring_sp.SequenceParallelTopology:
    """One topology per grid and group (creating groups is collective and not free)."""
    key = (id(group), ulysses, ring)
    if key not in _topologies:
        _topologies[key] = ring_sp.init_sequence_parallel(ulysses, ring, group=group)
    return _topologies[key]


@dataclass(frozen=True)
class Bound:
    """A mode on this rank: ``attend(q, k, v)`` on shards made by ``shard``."""

    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    rank: int  # the layout rank whose shard this rank holds
    world_size: int
    layout: str

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        return ring_sp.shard_sequence(x, rank=self.rank, world_size=self.world_size, layout=self.layout).contiguous()


def bind(mode: Mode, problem: Problem, group: dist.ProcessGroup, device: torch.device, backend: str = "auto") -> Bound:
    """``mode`` over ``group`` (``single`` ignores it), with ring_sp's ``backend`` kernel everywhere."""
    options = dict(causal=problem.causal, layout=mode.layout, backend=backend)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if mode.kind in ("single", "deepspeed"):
        kernel = get_kernel(backend, device, problem.torch_dtype, problem.head_dim)
        local = LocalAttention(kernel, causal=problem.causal, scale=problem.scale)
        if mode.kind == "single":
            return Bound(local, 0, 1, mode.layout)
        return Bound(deepspeed_ulysses(group, local), rank, world_size, mode.layout)
    if mode.kind == "ring":
        return Bound(functools.partial(ring_sp.ring_attention, group=group, **options), rank, world_size, mode.layout)
    if mode.kind == "ulysses":
        return Bound(functools.partial(ring_sp.ulysses_attention, group=group, **options), rank, world_size, mode.layout)
    topo = topology(group, *mode.grid(world_size))
    return Bound(functools.partial(ring_sp.hybrid_attention, topology=topo, **options), topo.sp_rank, world_size,
                 mode.layout)
