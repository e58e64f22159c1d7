"""The order of a ring pass: which KV shard each step reads and who hands it over (pure).

A flat ring of ``R`` ranks reads, at step ``t``, the shard of rank ``r - t``, sent straight by
its owner (``kv_exchange="ring"``). When the ring spans nodes, every rank then sends its shard to
every rank of every other node: ``R - R_in`` inter-node messages per rank and pass.

A double ring (``kv_exchange="double_ring"``; LoongTrain's double-ring attention, TransformerEngine's
hierarchical CP) numbers ring rank ``r = n * R_in + l`` (node ``n`` of ``R_out``, local rank ``l``
of ``R_in`` ring ranks per node) and walks step ``t = o * R_in + i``, outer step ``o``, inner step ``i``:

* step ``(o, i)`` reads the shard of ``((n - o) mod R_out, (l - i) mod R_in)``;
* at outer step ``o >= 1`` each rank **holds** the shard of its peer ``(n - o, l)`` in node
  ``n - o``, sent to it once, straight from that peer over the inter-node link (the rows any
  rank of node ``n`` reads of it), posted a whole inner pass ahead;
* inner step ``i >= 1`` receives from ``(n, l - i)``, inside the node, the rows it reads of the
  shard that rank holds; step ``(o, 0)`` reads the held shard itself.

So each shard crosses to every other node once (``R_out - 1`` inter-node messages per rank and
pass, ``R_in`` times fewer than the flat ring's) and is forwarded inside the node. ``R_in = R`` is
the flat ring, step for step (one node: every step is an inner step), and so is ``R_in = 1``
(every step is an outer step, sent by its owner).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RingOrder:
    """The pass order of a ring of ``world_size`` ranks with ``inner_size`` ranks per node."""

    world_size: int
    inner_size: int

    def __post_init__(self) -> None:
        if self.inner_size < 1 or self.world_size % self.inner_size:
            raise ValueError(f"inner_size={self.inner_size} must divide the ring size {self.world_size}")

    @staticmethod
    def flat(world_size: int) -> RingOrder:
        return RingOrder(world_size, world_size)

    @property
    def outer_size(self) -> int:
        return self.world_size // self.inner_size

    @property
    def double(self) -> bool:
        """Both levels have more than one rank (else the order is the flat ring's)."""
        return 1 < self.inner_size < self.world_size

    def _rank(self, node: int, local: int) -> int:
        return (node % self.outer_size) * self.inner_size + local % self.inner_size

    def source(self, rank: int, step: int) -> int:
        """The ring rank whose shard ``rank`` reads at ``step``."""
        if not self.double:
            return (rank - step) % self.world_size
        (n, l), (o, i) = divmod(rank, self.inner_size), divmod(step, self.inner_size)
        return self._rank(n - o, l - i)

    def held(self, rank: int, step: int) -> int:
        """The ring rank whose shard ``rank`` holds during ``step``'s outer step (its own for outer step 0)."""
        return self.source(rank, step - self.inner_step(step))

    def inner_step(self, step: int) -> int:
        """``i`` of step ``(o, i)`` (the flat ring: the step itself)."""
        return step % self.inner_size if self.double else step

    def reads_held(self, step: int) -> bool:
        """Step ``step`` is a double ring's outer step's first (``o >= 1``): its KV is the held message, which
        came over the inter-node link (never for the flat ring)."""
        return step > 0 and self.inner_step(step) == 0

    def sender(self, rank: int, step: int) -> int:
        """Who sends ``rank`` its KV of ``step`` (a step with ``inner_step == 0`` of a double ring: the
        inter-node message of the held shard, from its owner)."""
        if not self.double or self.inner_step(step) == 0:
            return self.source(rank, step)
        n, l = divmod(rank, self.inner_size)
        return self._rank(n, l - self.inner_step(step))

    def reader(self, rank: int, step: int) -> int:
        """Whom ``rank`` sends, at an inner step ``step``, the rows it reads of the shard ``rank`` holds."""
        if not self.double:
            return (rank + step) % self.world_size
        n, l = divmod(rank, self.inner_size)
        return self._rank(n, l + self.inner_step(step))

    def inter_readers(self, rank: int, outer: int) -> tuple[int, ...]:
        """The ranks of node ``n + outer`` (they read ``rank``'s shard at their outer step ``outer``)."""
        n = rank // self.inner_size
        return tuple(self._rank(n + outer, l) for l in range(self.inner_size))

    def inter_peer(self, rank: int, outer: int) -> int:
        """``rank``'s peer in node ``n + outer``: it holds ``rank``'s shard during its outer step ``outer``."""
        n, l = divmod(rank, self.inner_size)
        return self._rank(n + outer, l)


__all__ = ["RingOrder"]
