"""The rank arithmetic of a ``DP x (U x R)`` grid: which positions form each group (pure).

No process groups here (:mod:`ring_sp.topology` builds those from this grid), so the
planner can place a grid on nodes without touching the runtime. The parent group's ranks
are split into ``DP`` consecutive blocks of ``SP = U * R`` ranks (DP outermost, as in
DeepSpeed and Megatron); inside a block, position ``p`` is ``ring_rank * U + ulysses_rank``
(``ulysses_inner``, the default) or ``ulysses_rank * R + ring_rank`` (``ring_inner``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEMENTS = ("ulysses_inner", "ring_inner")


@dataclass(frozen=True)
class Coordinates:
    dp_rank: int
    ring_rank: int
    ulysses_rank: int


@dataclass(frozen=True)
class RankGrid:
    """Every group of a ``DP x (U x R)`` grid as lists of positions ``0..num_ranks-1``."""

    num_ranks: int
    ulysses_size: int
    ring_size: int
    placement: str
    sp_groups: list[list[int]] = field(default_factory=list)
    ulysses_groups: list[list[int]] = field(default_factory=list)
    ring_groups: list[list[int]] = field(default_factory=list)
    dp_groups: list[list[int]] = field(default_factory=list)

    @property
    def sp_size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def dp_size(self) -> int:
        return self.num_ranks // self.sp_size

    def position(self, dp_rank: int, ring_rank: int, ulysses_rank: int) -> int:
        if self.placement == "ulysses_inner":
            inner = ring_rank * self.ulysses_size + ulysses_rank
        else:
            inner = ulysses_rank * self.ring_size + ring_rank
        return dp_rank * self.sp_size + inner

    def coordinates(self, position: int) -> Coordinates:
        dp_rank, inner = divmod(position, self.sp_size)
        if self.placement == "ulysses_inner":
            ring_rank, ulysses_rank = divmod(inner, self.ulysses_size)
        else:
            ulysses_rank, ring_rank = divmod(inner, self.ring_size)
        return Coordinates(dp_rank, ring_rank, ulysses_rank)


def check_sizes(ulysses_size: object, ring_size: object, placement: object, num_ranks: int) -> None:
    """Raise ``TypeError``/``ValueError`` naming the bad size (the failing equation included)."""
    for name, value in (("ulysses_size", ulysses_size), ("ring_size", ring_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r} is not one of {PLACEMENTS}")
    sp = ulysses_size * ring_size  # type: ignore[operator]
    if num_ranks % sp != 0:
        raise ValueError(
            f"the group's {num_ranks} ranks are not divisible by ulysses_size x ring_size = "
            f"{ulysses_size} x {ring_size} = {sp} ({num_ranks} % {sp} = {num_ranks % sp}); "
            f"choose sizes whose product divides {num_ranks}"
        )


def rank_grid(num_ranks: int, ulysses_size: int, ring_size: int, placement: str = "ulysses_inner") -> RankGrid:
    """The groups of a ``DP x (U x R)`` grid over positions ``0..num_ranks-1`` (pure)."""
    check_sizes(ulysses_size, ring_size, placement, num_ranks)
    grid = RankGrid(num_ranks, ulysses_size, ring_size, placement)
    dps, rs, us = range(grid.dp_size), range(ring_size), range(ulysses_size)
    grid.sp_groups.extend(sorted(grid.position(d, r, u) for r in rs for u in us) for d in dps)
    grid.ulysses_groups.extend([grid.position(d, r, u) for u in us] for d in dps for r in rs)
    grid.ring_groups.extend([grid.position(d, r, u) for r in rs] for d in dps for u in us)
    grid.dp_groups.extend(sorted(grid.position(d, r, u) for d in dps) for r in rs for u in us)
    return grid
