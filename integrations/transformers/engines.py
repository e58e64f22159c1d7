"""Which engine reduces the sequence-parallel trainers' gradients; where none can be exact, a refusal.

Every SP rank back-propagates through every other rank's attention, so the exact gradient of
the step is the SUM of the SP ranks' gradients (:mod:`ring_sp.loss`), and the loss is scaled
for how the engine in use reduces them (:meth:`Engine.gradients_averaged_over_sp`):

* DeepSpeed (``TrainingArguments.deepspeed`` with a ``"ring_sp"`` section, applied by
  accelerate): ring_sp's ``initialize`` builds the engine; ZeRO 0-2 sum over SP, ZeRO-3
  averages (:mod:`ring_sp.integrations.gradient_reduction`);
* FSDP2 (``prepare_sequence_parallel``'s keywords and accelerate's FSDP2 config): the mean
  over all ``DP x SP`` ranks (:mod:`.fsdp`);
* DDP (the keywords without FSDP, or a DeepSpeed config accelerate did not apply):
  ``DistributedDataParallel`` over all ranks, the mean over ``DP x SP``.

accelerate picks the engine from its state, which every rank builds alike from the launcher's
environment and the arguments, so every check here raises on every rank: ``DEEPSPEED`` ->
DeepSpeed; ``FSDP`` -> FSDP2 (FSDP1 refused); ``MULTI_CPU``, ``MULTI_GPU``, ... -> DDP,
which is what ``TrainingArguments(use_cpu=True)`` / ``ACCELERATE_USE_CPU=true`` gives on CPU
ranks even beside a DeepSpeed config (accelerate then drops the config); ``NO`` on several
ranks wraps nothing and is refused, except that on CPU ranks an FSDP2 request leaves it there
and the trainer shards the model itself. Refused as well, naming the engine found, the one
configured and the fix: a model partitioned by ZeRO-3's ``zero.Init`` without a ZeRO-3
engine (its forward would crash on the empty weights), and ``offload_checkpoints`` outside
DeepSpeed. :func:`trainer_engine` decides when the trainer is built, :func:`check_prepared`
checks the model accelerate returns, before the first step. The table: docs/engines.md.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ring_sp.integrations.deepspeed.config import SECTION, RingSPConfig  # pure Python, no DeepSpeed import
from ring_sp.integrations.gradient_reduction import gradients_averaged_over_sp

from .fsdp import LAUNCH as FSDP2_LAUNCH
from .fsdp import requested_fsdp_version

DEEPSPEED, FSDP2, DDP, ONE_RANK = "DeepSpeed", "FSDP2", "DDP", "one rank"
_DROP_USE_CPU = ("unset ACCELERATE_USE_CPU / TrainingArguments(use_cpu=True) (DeepSpeed runs on CPU ranks without "
                 "it), or drop the DeepSpeed config and call prepare_sequence_parallel(args, ulysses_size=..., "
                 "ring_size=...) before building the model (DDP)")


@dataclass(frozen=True)
class Engine:
    """The engine a trainer runs on: ``kind`` (:data:`DEEPSPEED`, :data:`FSDP2`, :data:`DDP`, or
    :data:`ONE_RANK`: one process, nothing to reduce), ``configured`` (what the arguments asked
    for, for messages), ``shards_itself`` (FSDP2 on CPU ranks: the trainer shards the model)."""

    kind: str
    configured: str
    shards_itself: bool = False

    def gradients_averaged_over_sp(self, deepspeed_engine: Any = None) -> bool:
        """The loss's ``gradients_averaged_over_sp`` (``deepspeed_engine``: the trainer's, once built)."""
        if self.kind == DEEPSPEED:
            return deepspeed_engine is not None and gradients_averaged_over_sp(deepspeed_engine)
        return True  # FSDP2 and DDP average over all DP x SP ranks (one rank: a group of one, no scaling)


def keyword_settings(args: Any, settings: Mapping[str, Any]) -> RingSPConfig | None:
    """``prepare_sequence_parallel``'s keywords, validated; None when they say ``enabled=False``.

    The keywords train under FSDP2 when accelerate is asked for FSDP, else under DDP.
    Refused, before any communication: keywords beside a DeepSpeed config (its ``"ring_sp"``
    section is the DeepSpeed way), FSDP1, ``offload_checkpoints``.
    """
    if getattr(args, "deepspeed", None) is not None:
        raise ValueError(
            f"prepare_sequence_parallel got keyword settings {dict(settings)} AND TrainingArguments.deepspeed: give "
            f'ring_sp\'s settings one way only; with DeepSpeed put them in its config\'s "{SECTION}" section and call '
            f"prepare_sequence_parallel(args) without keywords; the keywords are for FSDP2 and DDP (no deepspeed=)")
    sp = RingSPConfig.from_dict(settings)  # unknown keys and bad values name the key
    if not sp.enabled:
        return None
    version = requested_fsdp_version(args)
    if version not in (None, 2):
        raise ValueError(
            f"FSDP version {version} (fsdp_version / FSDP_VERSION) is not supported with ring_sp: FSDP1 wraps the "
            f"model in flat parameters whose gradient reduction ring_sp's loss does not account for; set "
            f"fsdp_version: 2 in the accelerate config (fsdp_config={{'version': 2}}), or drop FSDP for DDP")
    if sp.offload_checkpoints:
        raise ValueError(
            "offload_checkpoints=True is not supported without DeepSpeed (it is applied at DeepSpeed's engine set-up); "
            "drop it, or train with DeepSpeed and the config's \"ring_sp\" section")
    return sp


def check_distributed(args: Any, sp: RingSPConfig) -> None:
    """After ``args.device``, for the keywords: a process group of the right size, and an engine
    accelerate will run (FSDP2 as asked; DDP: the model wrapped over all ranks)."""
    from accelerate.utils import DistributedType

    fsdp2 = requested_fsdp_version(args) == 2
    launch = FSDP2_LAUNCH if fsdp2 else "torchrun / accelerate launch (one process per rank)"
    if not dist.is_initialized():
        raise RuntimeError(f"ring_sp's trainers need one process per rank and torch.distributed set up: launch with "
                           f"{launch}")
    sp.check_world_size(dist.get_world_size())
    kind = args.distributed_state.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ValueError(
            "prepare_sequence_parallel got keyword settings but accelerate runs DeepSpeed (accelerate launch with a "
            "DeepSpeed config, ACCELERATE_USE_DEEPSPEED=true); found: DeepSpeed, configured: the keywords (FSDP2 or "
            f'DDP); with DeepSpeed put the settings in its config\'s "{SECTION}" section (TrainingArguments(deepspeed='
            "...)) and call prepare_sequence_parallel(args) without keywords")
    if fsdp2 and kind == DistributedType.MULTI_CPU:
        raise ValueError(
            "TrainingArguments(use_cpu=True) (or ACCELERATE_USE_CPU) with FSDP2: accelerate 1.15 then wraps the model "
            "in DistributedDataParallel instead of sharding it; leave use_cpu False (ranks without a GPU train on CPU "
            "anyway) and launch with the FSDP2 config, or drop FSDP to train under DDP")
    if fsdp2 and kind == DistributedType.NO and getattr(args, "fsdp_plugin_args", None) is not None:
        raise ValueError(
            "TrainingArguments(fsdp=...) on CPU ranks: transformers refuses it there (accelerate sees no distributed "
            "device type); ask for FSDP2 through accelerate launch's config instead (ACCELERATE_USE_FSDP=true, "
            "FSDP_VERSION=2), e.g. accelerate launch --config_file examples/trl/fsdp2.yaml")
    if not fsdp2 and kind == DistributedType.NO and dist.get_world_size() > 1:
        raise ValueError(_wraps_nothing("DDP (prepare_sequence_parallel's keywords, no FSDP)"))


def _wraps_nothing(configured: str) -> str:
    return (f"ring_sp's trainer would run {configured} on {dist.get_world_size()} ranks, but accelerate wraps the "
            f"model in no engine here (DistributedType.NO: CPU ranks without use_cpu), so no gradient would be reduced "
            f"across the ranks; found: no engine, configured: {configured}; on CPU ranks set "
            f"TrainingArguments(use_cpu=True) (ACCELERATE_USE_CPU=true) for DDP, or launch with {FSDP2_LAUNCH}")


def _configured(args: Any, ds_config: Mapping[str, Any] | None) -> str:
    """What the arguments ask for, in words (``ds_config``: the DeepSpeed config, None for the keywords)."""
    if ds_config is not None:
        stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        return f'DeepSpeed ZeRO-{stage} (TrainingArguments.deepspeed with a "{SECTION}" section)'
    if requested_fsdp_version(args) == 2:
        return "FSDP2 (prepare_sequence_parallel's keywords, accelerate's FSDP config)"
    return "DDP (prepare_sequence_parallel's keywords, no DeepSpeed, no FSDP)"


def _found(state: Any) -> str:
    """The engine accelerate's state will wrap the model in, in words."""
    from accelerate.utils import DistributedType

    kind = state.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "DeepSpeed"
    if kind == DistributedType.FSDP:
        return f"FSDP{getattr(state.fsdp_plugin, 'fsdp_version', 1)}"
    if kind == DistributedType.NO:
        return "no engine (accelerate's DistributedType.NO)"
    return f"DistributedDataParallel (accelerate's DistributedType.{kind.name})"


def _why_dropped(state: Any) -> str:
    if getattr(state, "_cpu", False) or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes"):
        return "TrainingArguments(use_cpu=True) / ACCELERATE_USE_CPU=true is set, and accelerate then drops it"
    return "accelerate did not apply it"


def trainer_engine(args: Any, accelerator: Any, model: torch.nn.Module, sp: RingSPConfig,
                   ds_config: Mapping[str, Any] | None) -> Engine:
    """The engine the trainer will run on, decided when it is built (local: the same on every rank).

    ``sp``: ring_sp's settings; ``ds_config``: the DeepSpeed config they came from, or None for
    ``prepare_sequence_parallel``'s keywords.
    """
    from accelerate.utils import DistributedType

    state = accelerator.state
    kind, configured, found = state.distributed_type, _configured(args, ds_config), _found(state)
    if kind == DistributedType.DEEPSPEED:
        if ds_config is None:
            raise ValueError(f"accelerate runs DeepSpeed (accelerate launch's config) but ring_sp's settings came as "
                             f"prepare_sequence_parallel's keywords; found: {found}, configured: {configured}; put "
                             f'them in the DeepSpeed config\'s "{SECTION}" section instead')
        return Engine(DEEPSPEED, configured)
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # deepspeed's is_zero_param
        raise ValueError(
            f"the model's parameters were partitioned by DeepSpeed ZeRO-3 (deepspeed.zero.Init, as transformers builds "
            f"a model under a ZeRO-3 config) but no ZeRO-3 engine will gather them: the DeepSpeed config is not "
            f"applied ({_why_dropped(state)}), so the forward would run on empty weights; found: {found}, "
            f"configured: {configured}; fix: {_DROP_USE_CPU}")
    if kind == DistributedType.FSDP:
        if getattr(state.fsdp_plugin, "fsdp_version", 1) != 2:
            raise ValueError(f"accelerate runs {found}; ring_sp supports FSDP2 (fsdp_version: 2); found: {found}, "
                             f"configured: {configured}")
        return Engine(FSDP2, configured)
    if ds_config is None and requested_fsdp_version(args) == 2:
        if kind != DistributedType.NO:  # prepare_sequence_parallel refused this already, unless the state changed
            raise ValueError(f"FSDP2 was asked for but accelerate will run {found}; found: {found}, configured: "
                             f"{configured}; leave use_cpu False and launch with {FSDP2_LAUNCH}")
        return Engine(FSDP2, configured, shards_itself=True)  # CPU ranks: accelerate set no FSDP up
    if kind == DistributedType.NO:
        if dist.get_world_size() > 1:
            raise ValueError(_wraps_nothing(configured))
        return Engine(ONE_RANK, configured)
    if ds_config is not None:  # a DeepSpeed config accelerate did not apply
        if sp.offload_checkpoints:
            raise ValueError(
                f'"{SECTION}": {{"offload_checkpoints": true}} is applied at DeepSpeed\'s engine set-up, but no '
                f"DeepSpeed engine will run ({_why_dropped(state)}); found: {found}, configured: {configured}; fix: "
                f"{_DROP_USE_CPU}, or set it false")
        warnings.warn(f"the DeepSpeed config is not applied ({_why_dropped(state)}): ring_sp trains under {found}, "
                      f"exactly (the loss is scaled for its mean over all ranks), without DeepSpeed's own settings; "
                      f"configured: {configured}", stacklevel=3)
    return Engine(DDP, configured)


def check_prepared(engine: Engine, wrapped: torch.nn.Module) -> None:
    """Before the first step: the model accelerate prepared (``wrapped``) runs ``engine``, whose
    reduction the loss is scaled for; else every rank raises (the same check on each)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    ranks = list(range(dist.get_world_size()))
    if isinstance(wrapped, DistributedDataParallel):
        group = dist.get_process_group_ranks(wrapped.process_group)
        found, ok = f"DistributedDataParallel over ranks {group}", engine.kind == DDP and group == ranks
    elif isinstance(wrapped, FSDPModule):
        found, ok = "FSDP2", engine.kind == FSDP2
    elif hasattr(wrapped, "zero_optimization_stage"):
        found, ok = f"DeepSpeed ZeRO-{wrapped.zero_optimization_stage()}", engine.kind == DEEPSPEED
    else:  # accelerate may leave one process's model unwrapped: nothing to reduce
        found, ok = f"{type(wrapped).__name__} (no engine)", engine.kind in (DDP, ONE_RANK) and len(ranks) == 1
    if not ok:
        raise ValueError(
            f"ring_sp's trainer set its loss up for {engine.kind} over all {len(ranks)} ranks but accelerate prepared "
            f"the model as {found}, whose gradient reduction the loss is not scaled for; found: {found}, configured: "
            f"{engine.configured}; launch the way docs/engines.md lists for the configured engine")


__all__ = ["DDP", "DEEPSPEED", "Engine", "FSDP2", "ONE_RANK", "check_distributed", "check_prepared", "keyword_settings",
           "trainer_engine"]
