"""Around the Hugging Face ``Trainer``: what ring_sp sets up before it and where accelerate calls out.

* :func:`prepare_sequence_parallel`: the grid of ``TrainingArguments.deepspeed``'s
  ``"ring_sp"`` section (or, under FSDP2 or DDP, of its keywords: :mod:`.engines`), registered
  as ``attn_implementation="ring_sp"`` before the model; :func:`ring_sp_settings`: which;
* :func:`registered_topology_for`: that registration checked against the settings and the model;
* :class:`SequenceParallelCollator`: a collator of GLOBAL batches -> this rank's shard;
* :func:`routed_deepspeed_initialize`: accelerate's ``deepspeed.initialize`` call routed to
  :func:`ring_sp.integrations.deepspeed.initialize` while the Trainer trains;
* :func:`unshard`: accelerate's split of the batches over all ranks undone (the sampler
  already splits over the ``DP`` replicas);
* :func:`mark_checkpoint_complete` / :func:`complete_checkpoint`: a ``checkpoint-N`` folder
  counts only once every rank has written it (transformers 5.18 writes the folder in place,
  and ``resume_from_checkpoint=True`` would take the newest folder, even a half-written one).

Importing this module (with DeepSpeed installed) keeps DeepSpeed's CPU backend from
JIT-compiling its C++ shared-memory op when ``TrainingArguments`` starts it. The Trainer
subclass that uses all of this is :mod:`.trainer`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ring_sp import SequenceParallelTopology, init_sequence_parallel
from ring_sp.integrations import deepspeed as rsp_ds
from ring_sp.integrations.deepspeed.engine import write_file_atomically
from ring_sp.integrations.versions import require_supported

from .attention import ATTN_IMPLEMENTATION, register, registration, uses_ring_sp
from .data import shard_batch
from .engines import check_distributed, keyword_settings

if importlib.util.find_spec("deepspeed") is not None:
    # TrainingArguments(deepspeed=...) starts DeepSpeed's comm in its constructor, before any
    # other call of ours: on CPU ranks it must already find the C++ op marked unbuildable
    rsp_ds.skip_cpu_inference_comm_build()

SETTINGS_ATTR = "ring_sp_keyword_settings"  # TrainingArguments attribute: the keyword settings (a RingSPConfig)


def _ds_config(args: TrainingArguments) -> dict[str, Any] | None:
    """The DeepSpeed config dict the Trainer will use (``args.deepspeed``), or None."""
    processed = getattr(args, "hf_deepspeed_config", None)  # "auto" values already filled by transformers
    if processed is not None:
        return processed.config
    return None if args.deepspeed is None else rsp_ds.load_config(args.deepspeed)


def prepare_sequence_parallel(args: TrainingArguments, **settings: Any) -> SequenceParallelTopology | None:
    """Build ring_sp's grid and register ``attn_implementation="ring_sp"``; returns the topology or None.

    DeepSpeed: ``prepare_sequence_parallel(args)`` reads ``args.deepspeed``'s ``"ring_sp"``
    section. Without DeepSpeed, the same settings as keywords,
    ``prepare_sequence_parallel(args, ulysses_size=2, ring_size=2, layout="zigzag")`` (the
    section's keys, validated by the same ``RingSPConfig``): under FSDP2 when it is asked for
    through accelerate (``accelerate launch --config_file fsdp2.yaml``; :mod:`.fsdp`), else
    under DDP (``torchrun``/``accelerate launch``; on CPU ranks with
    ``TrainingArguments(use_cpu=True)``, as accelerate wraps nothing there otherwise); a
    DeepSpeed config and keywords at once are refused (:mod:`.engines`). Call it on every rank
    after ``TrainingArguments`` and BEFORE building the model (the attention needs the
    groups). None: no enabled settings (nothing registered, the Trainer runs as usual).
    Collective over the default group.
    """
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be transformers.TrainingArguments; got {type(args).__name__}")
    require_supported("accelerate", "ring_sp.integrations.transformers.trainer")
    if settings:
        sp = keyword_settings(args, settings)  # validated before any communication
        setattr(args, SETTINGS_ATTR, sp)
        if sp is None:
            return None
        args.device  # noqa: B018 -- sets up torch.distributed through accelerate as the Trainer will
        check_distributed(args, sp)
        topology = init_sequence_parallel(sp.ulysses_size, sp.ring_size, placement=sp.placement)
    else:
        config = _ds_config(args)
        sp = None if config is None else rsp_ds.RingSPConfig.from_ds_config(config)
        if sp is None:
            return None
        args.device  # noqa: B018 -- sets up torch.distributed through accelerate/DeepSpeed as the Trainer will
        topology = rsp_ds.build_topology(sp)
    register(topology, layout=sp.layout, backend=sp.backend, kv_exchange=sp.kv_exchange, head_chunks=sp.head_chunks)
    return topology


def ring_sp_settings(args: Any) -> tuple[rsp_ds.RingSPConfig | None, dict[str, Any] | None]:
    """(ring_sp's enabled settings for ``args``, the DeepSpeed config they came from): the keywords
    :func:`prepare_sequence_parallel` kept on ``args`` (no config: FSDP2 or DDP), else
    ``args.deepspeed``'s section."""
    keywords = getattr(args, SETTINGS_ATTR, None)
    if keywords is not None:
        return keywords, None
    config = _ds_config(args) if getattr(args, "deepspeed", None) is not None else None
    return (None if config is None else rsp_ds.RingSPConfig.from_ds_config(config)), config


def registered_topology_for(sp: rsp_ds.RingSPConfig, model: torch.nn.Module, source: str) -> SequenceParallelTopology:
    """The topology :func:`prepare_sequence_parallel` registered, checked against the settings ``sp``
    and the model's attention (local: every rank raises alike); ``source``: the settings' origin."""
    current = registration()
    if current is None:
        raise ValueError(
            "ring_sp is not registered with transformers: call prepare_sequence_parallel(training_args) before "
            'building the model with attn_implementation="ring_sp"'
        )
    topology = current.topology
    for key in ("ulysses_size", "ring_size", "placement"):
        if getattr(topology, key) != getattr(sp, key):
            raise ValueError(
                f"{rsp_ds.SECTION}.{key}={getattr(sp, key)!r} but the registered topology has {key}="
                f"{getattr(topology, key)!r}; call prepare_sequence_parallel(training_args) with these settings"
            )
    for key in ("layout", "backend"):
        if getattr(current, key) != getattr(sp, key):
            raise ValueError(
                f"{rsp_ds.SECTION}.{key}={getattr(sp, key)!r} but ring_sp was registered with {key}="
                f"{getattr(current, key)!r}; call prepare_sequence_parallel(training_args) with these settings"
            )
    if not uses_ring_sp(model):
        raise ValueError(
            f"ring_sp is set up ({source}) but the model's attn_implementation is "
            f"{getattr(model.config, '_attn_implementation', None)!r}; build it with "
            f'attn_implementation="{ATTN_IMPLEMENTATION}" (or call model.set_attn_implementation("ring_sp"))'
        )
    return topology


class SequenceParallelCollator:
    """Wraps a collator of GLOBAL batches: returns this rank's shard (``shard_batch``).

    ``collator(features)`` must return ``input_ids`` ``[b, N]`` and optionally ``labels``,
    ``position_ids``, an all-ones ``attention_mask``; the result holds ``input_ids``,
    ``position_ids``, ``shift_labels`` (and ``cu_seq_lens_q/k`` for packed documents),
    each ``[b, N / sp_size]``. ``validate``: ``shard_batch``'s (its errors raised on every
    rank of the SP group by one agreement; none in DataLoader workers); the trainers pass
    False and agree once per step over all ranks instead. ``model``: ``shard_batch``'s, the
    model's config (a vision-language model's ``token_type_ids`` and ``pixel_values`` become its
    spans and this shard's images; the trainers pass their model's).
    """

    def __init__(self, collator: Callable[[list[Any]], Mapping[str, Any]], topology: SequenceParallelTopology,
                 *, layout: str, validate: bool | None = None, model: Any = None) -> None:
        if not callable(collator):
            raise TypeError(f"collator must be callable; got {type(collator).__name__}")
        self.collator, self.topology, self.layout, self.validate = collator, topology, layout, validate
        self.model = getattr(model, "config", model)  # the config: what shard_batch reads, and cheap to pickle

    def __call__(self, features: list[Any]) -> dict[str, torch.Tensor]:
        return shard_batch(self.collator(features), self.topology, layout=self.layout, validate=self.validate,
                           model=self.model)


def unshard(loader: Any) -> None:
    """Undo accelerate's split of the batches over ALL ranks (the sampler already splits over DP).

    accelerate wraps the batch sampler in a ``BatchSamplerShard`` over ``num_processes``
    ranks; made a one-process pass-through it keeps its other duties (``set_epoch``, skipping
    batches on resume), as the Trainer does for its own rank-aware ``BatchRebalanceSampler``.
    On CPU under DeepSpeed accelerate 1.15 sees one process and wraps nothing.
    """
    from accelerate.data_loader import BatchSamplerShard

    shard = getattr(loader, "batch_sampler", None)
    if isinstance(shard, BatchSamplerShard):
        shard.num_processes, shard.process_index = 1, 0


@contextlib.contextmanager
def section_hidden_from_accelerate(accelerator: Any) -> Iterator[dict[str, Any] | None]:
    """While active, ``accelerator``'s DeepSpeed config has no ``"ring_sp"`` section (yields it,
    or None). accelerate takes every ``"auto"`` of that config for a placeholder of its own to
    fill, and raises where it has none; ring_sp's section (``"layout": "auto"``,
    ``"kv_exchange": "auto"``, ...) is not accelerate's to fill."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    section = config.pop(rsp_ds.SECTION, None) if isinstance(config, dict) else None
    try:
        yield section
    finally:
        if section is not None:
            config.setdefault(rsp_ds.SECTION, section)


@contextlib.contextmanager
def routed_deepspeed_initialize(section: dict[str, Any] | None = None) -> Iterator[None]:
    """While active, ``deepspeed.initialize`` (as accelerate calls it) is ring_sp's ``initialize``,
    given ``section`` (the ``"ring_sp"`` section :func:`section_hidden_from_accelerate` took away).

    accelerate computes ``train_batch_size`` as micro x GA x ALL ranks; with sequence
    parallelism only ``world / (U x R)`` ranks hold different samples, so it is dropped and
    DeepSpeed derives it (ring_sp's ``initialize`` checks the arithmetic).
    """
    import deepspeed

    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args: Any, config: Any = None, config_params: Any = None, **kwargs: Any) -> tuple:
        source = config if config is not None else config_params
        ds_config = None if source is None else dict(rsp_ds.load_config(source))
        if ds_config is not None:
            ds_config.pop("train_batch_size", None)
            if section is not None:
                ds_config.setdefault(rsp_ds.SECTION, section)
        deepspeed.initialize = original  # ring_sp's initialize calls the real one
        try:
            engine, *rest = rsp_ds.initialize(*args, config=ds_config, **kwargs)
        finally:
            deepspeed.initialize = initialize
        current = registration()
        if current is None or getattr(engine, "ring_sp_topology", None) is not current.topology:
            raise RuntimeError("ring_sp.integrations.deepspeed.initialize did not adopt the topology registered for "
                               'attn_implementation="ring_sp"; its gradient groups would not be the attention\'s')
        return (engine, *rest)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


COMPLETE_MARKER = "ring_sp_checkpoint_complete"  # written last, by rank 0, once every rank's files are written


def mark_checkpoint_complete(folder: str, step: int) -> None:
    """After every rank wrote its part of ``folder``: rank 0 writes :data:`COMPLETE_MARKER` atomically."""
    dist.barrier()
    if dist.get_rank() == 0:
        write_file_atomically(os.path.join(folder, COMPLETE_MARKER), f"{step}\n")


def _checkpoint_folders(output_dir: str) -> list[str]:
    """``checkpoint-N`` folders of ``output_dir``, newest first."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = [(int(m.group(1)), name) for name in names if (m := pattern.match(name))]
    return [name for _, name in sorted(steps, reverse=True)]


def newest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` of ``output_dir`` holding :data:`COMPLETE_MARKER`, or None (none yet)."""
    for name in _checkpoint_folders(output_dir):
        if os.path.isfile(os.path.join(output_dir, name, COMPLETE_MARKER)):
            return os.path.join(output_dir, name)
    return None


def complete_checkpoint(output_dir: str, resume: str | bool | None) -> str | None:
    """``resume_from_checkpoint`` as the Trainer should take it: never a half-written folder.

    ``True``: the newest ``checkpoint-N`` of ``output_dir`` holding :data:`COMPLETE_MARKER`
    (half-written newer ones are skipped); a path: that folder, which must hold the marker;
    ``None`` / ``False``: no resume.
    """
    if resume is None or resume is False:
        return None
    if resume is True:
        newest = newest_complete_checkpoint(output_dir)
        if newest is None:
            raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir!r} (folders: "
                             f"{_checkpoint_folders(output_dir)}; complete ones hold {COMPLETE_MARKER!r}, written last)")
        return newest
    if not os.path.isfile(os.path.join(resume, COMPLETE_MARKER)):
        raise ValueError(
            f"resume_from_checkpoint={resume!r} has no {COMPLETE_MARKER!r}: the run stopped while writing it, or it "
            f"was not saved by SequenceParallelTrainer; resume_from_checkpoint=True takes the newest complete one "
            f"(a folder known to be whole can be marked by creating that file)")
    return resume


__all__ = ["COMPLETE_MARKER", "SETTINGS_ATTR", "SequenceParallelCollator", "complete_checkpoint",
           "mark_checkpoint_complete", "newest_complete_checkpoint", "prepare_sequence_parallel", "registered_topology_for", "ring_sp_settings",
           "routed_deepspeed_initialize", "section_hidden_from_accelerate", "unshard"]
