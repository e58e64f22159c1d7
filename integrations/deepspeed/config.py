"""The ``"ring_sp"`` section of a DeepSpeed JSON config: parsing and validation.

Example section (every key optional; defaults shown in :class:`RingSPConfig`)::

    "ring_sp": {"ulysses_size": 2, "ring_size": 4, "layout": "zigzag",
                "placement": "ulysses_inner", "backend": "auto", "kv_exchange": "ring",
                "tiled_mlp": true, "tiled_loss": true, "offload_checkpoints": false, "tile_tokens": null,
                "lean_layers": null}

Everything here is pure Python (no DeepSpeed import, no communication), so every rank can
check the section before the first collective, and errors name the key and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ring_sp import LAYOUT_CHOICES, PLACEMENTS
from ring_sp.kernels import BACKENDS
from ring_sp.shapes import divisors
from ring_sp.tiling import check_tile_tokens
from ring_sp.validation import KV_EXCHANGES, check_head_chunks

SECTION = "ring_sp"
_SP_KEY = "sequence_parallel_size"  # DeepSpeed's own key: must equal ulysses_size * ring_size
_DP_KEY = "data_parallel_size"  # with _SP_KEY, deepspeed.initialize would build its own mesh groups
_EXAMPLE = '"ring_sp": {"ulysses_size": 2, "ring_size": 2, "layout": "zigzag"}'


def _describe(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


@dataclass(frozen=True)
class RingSPConfig:
    """The validated ``"ring_sp"`` section. Construction validates every field.

    ``ulysses_size`` (U) x ``ring_size`` (R) ranks form one sequence-parallel group;
    ``layout`` is how a global sequence is split over it (``topology.shard_batch`` and the
    attention must agree); ``placement`` whether a Ulysses group (``ulysses_inner``) or a
    ring (``ring_inner``) is made of consecutive ranks; ``backend`` the local attention
    kernel; ``kv_exchange`` how a ring group exchanges KV (``ring``, ``all_gather``, ``auto``
    or ``double_ring`` for a ring spanning nodes: see :func:`ring_sp.ring_attention`); ``enabled: false`` keeps the section but
    turns ring_sp off. ``tiled_mlp``, ``tiled_loss``, ``offload_checkpoints``, ``tile_tokens``
    and ``lean_layers`` (null: on with tiling) switch on the long-sequence step (default off; see
    ``head_chunks``: the attention's heads in chunks (null: unchunked, ``"auto"`` with the
    long-sequence step; an int or ``"auto"``); see
    ``ring_sp.integrations.transformers.enable_long_sequence``).
    """

    ulysses_size: int = 1
    ring_size: int = 1
    layout: str = "zigzag"
    placement: str = "ulysses_inner"
    backend: str = "auto"
    kv_exchange: str = "ring"
    enabled: bool = True
    tiled_mlp: bool = False
    tiled_loss: bool = False
    offload_checkpoints: bool = False
    tile_tokens: int | None = None
    lean_layers: bool | None = None
    head_chunks: int | str | None = None

    def __post_init__(self) -> None:
        for key in ("ulysses_size", "ring_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f'{SECTION}.{key} must be an integer >= 1; got {_describe(value)}. Write e.g. "{key}": 2')
            if value < 1:
                raise ValueError(f"{SECTION}.{key}={value} must be >= 1 (1 switches that dimension off)")
        for key, allowed in (("layout", LAYOUT_CHOICES), ("placement", PLACEMENTS), ("backend", BACKENDS),
                             ("kv_exchange", KV_EXCHANGES)):
            value = getattr(self, key)
            if not isinstance(value, str):
                raise TypeError(f"{SECTION}.{key} must be a string, one of {list(allowed)}; got {_describe(value)}")
            if value not in allowed:
                raise ValueError(f"{SECTION}.{key}={value!r} is not one of {list(allowed)}; pick one of them")
        for key in ("enabled", "tiled_mlp", "tiled_loss", "offload_checkpoints"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"{SECTION}.{key} must be true or false; got {_describe(getattr(self, key))}")
        check_tile_tokens(self.tile_tokens, name=f"{SECTION}.tile_tokens")
        if self.lean_layers is not None and not isinstance(self.lean_layers, bool):
            raise TypeError(f"{SECTION}.lean_layers must be true, false or null (on with tiling); got "
                            f"{_describe(self.lean_layers)}")
        try:
            check_head_chunks(self.head_chunks)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{SECTION}.head_chunks: {exc}") from None
        if self.layout == "striped" and self.ulysses_size > 1 and self.ring_size > 1:
            # after the Ulysses all-to-all a ring rank would not hold a striped ring shard
            raise ValueError(
                f"{SECTION}.layout='striped' cannot be combined with ulysses_size={self.ulysses_size} > 1 and "
                f"ring_size={self.ring_size} > 1; use layout 'zigzag' (balanced, causal) or 'contiguous', "
                f"or set one of the sizes to 1"
            )

    @property
    def sp_size(self) -> int:
        """Ranks per sequence-parallel group: ``ulysses_size * ring_size``."""
        return self.ulysses_size * self.ring_size

    @property
    def long_sequence(self) -> dict[str, Any] | None:
        """``enable_long_sequence``'s keyword arguments, or None when the section switches none of it on."""
        if not (self.tiled_mlp or self.tiled_loss or self.offload_checkpoints):
            return None
        return {"tiled_mlp": self.tiled_mlp, "tiled_loss": self.tiled_loss,
                "offload_checkpoints": self.offload_checkpoints, "tile_tokens": self.tile_tokens,
                "lean_layers": self.lean_layers, "head_chunks": "auto" if self.head_chunks is None else self.head_chunks}

    @classmethod
    def from_dict(cls, section: object) -> RingSPConfig:
        """Validate a ``"ring_sp"`` section (a mapping); unknown keys are errors."""
        if not isinstance(section, Mapping):
            raise TypeError(f'the "{SECTION}" section must be a JSON object such as {{{_EXAMPLE}}}; got {_describe(section)}')
        known = [f.name for f in dataclasses.fields(cls)]
        for key in section:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"{SECTION}.{key} is not a known key; {hint}known keys: {known}")
        return cls(**section)

    @classmethod
    def from_ds_config(cls, ds_config: Mapping[str, Any]) -> RingSPConfig | None:
        """The validated section of a DeepSpeed config dict, or None if absent or disabled."""
        if not isinstance(ds_config, Mapping):
            raise TypeError(f"the DeepSpeed config must be a dict here (load the JSON file first); got {_describe(ds_config)}")
        if SECTION not in ds_config:
            return None
        config = cls.from_dict(ds_config[SECTION])
        return config if config.enabled else None

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless ``U * R`` divides ``world_size`` (the rest is data parallel)."""
        if world_size % self.sp_size != 0:
            raise ValueError(
                f"{SECTION}.ulysses_size x {SECTION}.ring_size = {self.ulysses_size} x {self.ring_size} = "
                f"{self.sp_size} does not divide the world size {world_size}; choose sizes whose product is "
                f"one of {divisors(world_size)} (world = data_parallel x ulysses_size x ring_size)"
            )

    def apply(self, ds_config: Mapping[str, Any], world_size: int) -> dict[str, Any]:
        """A copy of ``ds_config`` ready for ``deepspeed.initialize`` with this section's groups.

        Sets DeepSpeed's ``sequence_parallel_size`` to ``U * R`` (a conflicting value is an
        error), drops a consistent ``data_parallel_size`` (the mpu supplies the groups; with
        both keys DeepSpeed would build a device mesh of its own) and checks the batch-size
        arithmetic, in which DeepSpeed's "world size" is the data-parallel size ``world / (U*R)``.
        """
        self.check_world_size(world_size)
        dp_size = world_size // self.sp_size
        config = copy.deepcopy(dict(ds_config))
        declared = config.get(_SP_KEY, "auto")
        if declared != "auto" and (isinstance(declared, bool) or declared != self.sp_size):
            raise ValueError(
                f"{_SP_KEY}={declared!r} conflicts with {SECTION}: ulysses_size x ring_size = "
                f"{self.ulysses_size} x {self.ring_size} = {self.sp_size}; remove \"{_SP_KEY}\" (ring_sp sets it) "
                f"or set it to {self.sp_size}"
            )
        config[_SP_KEY] = self.sp_size
        if _DP_KEY in config:
            if isinstance(config[_DP_KEY], bool) or config[_DP_KEY] != dp_size:
                raise ValueError(
                    f"{_DP_KEY}={config[_DP_KEY]!r} conflicts with {SECTION}: world size {world_size} / "
                    f"(ulysses_size x ring_size = {self.sp_size}) = {dp_size}; remove \"{_DP_KEY}\" (ring_sp derives it)"
                )
            del config[_DP_KEY]
        _check_batch_sizes(config, dp_size, self)
        zero = config.get("zero_optimization")
        if isinstance(zero, Mapping) and zero.get("stage") == 3 and zero.get("reduce_scatter") is False:
            # ZeRO-3 would then average some gradient buckets over SP and sum others (see .loss)
            raise ValueError(
                f"zero_optimization.reduce_scatter=false with stage 3 cannot be combined with the {SECTION} section: "
                f"DeepSpeed then scales gradients differently per bucket; remove reduce_scatter (default true)"
            )
        tensor_parallel = config.get("tensor_parallel")
        autotp = tensor_parallel.get("autotp_size", 0) if isinstance(tensor_parallel, Mapping) else 0
        if isinstance(autotp, int) and autotp > 1:
            raise ValueError(
                f"tensor_parallel.autotp_size={autotp} cannot be combined with the {SECTION} section: AutoTP replaces "
                f"the mpu that carries ring_sp's groups; remove one of the two"
            )
        return config


def _check_batch_sizes(config: Mapping[str, Any], dp_size: int, sp: RingSPConfig) -> None:
    """DeepSpeed's ``train_batch = micro * grad_acc * world`` holds with world = DP, not all ranks."""
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    steps = config.get("gradient_accumulation_steps")
    values = (train, micro, steps)
    if any(v is None or isinstance(v, bool) or not isinstance(v, int) for v in values):
        return  # DeepSpeed derives the missing one (or reports a bad type) itself
    if train != micro * steps * dp_size:
        raise ValueError(
            f"train_batch_size={train} must equal train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            f"data-parallel size = {micro} x {steps} x {dp_size} = {micro * steps * dp_size}: the "
            f"{sp.sp_size} ranks of a sequence-parallel group ({SECTION}.ulysses_size x ring_size) share one "
            f"sample, so only world / {sp.sp_size} = {dp_size} ranks count; set train_batch_size to "
            f"{micro * steps * dp_size} or drop it"
        )


__all__ = ["SECTION", "RingSPConfig"]
