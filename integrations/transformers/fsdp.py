"""FSDP2 under the sequence-parallel trainers: accelerate's ``fsdp_version: 2``, no DeepSpeed.

ring_sp's settings come as keywords, ``prepare_sequence_parallel(args, ulysses_size=2,
ring_size=2, ...)``, validated by the same :class:`ring_sp.integrations.deepspeed.RingSPConfig`
as DeepSpeed's ``"ring_sp"`` section (:func:`.engines.keyword_settings`; without FSDP the
same keywords train under DDP, :mod:`.engines`). FSDP2 itself is asked for as accelerate
asks for it: ``accelerate launch --config_file fsdp2.yaml`` (``ACCELERATE_USE_FSDP=true``,
``FSDP_VERSION=2`` in each rank's environment) or ``TrainingArguments(fsdp=True,
fsdp_config={"version": 2})``. What accelerate 1.15 then does depends on the device:

* GPUs: the ``AcceleratorState`` becomes ``DistributedType.FSDP``, the Trainer sees
  ``is_fsdp_enabled`` and ``accelerator.prepare`` shards the model when training starts
  (``fsdp2_prepare_model``: ``fully_shard`` on every decoder layer, the embeddings, the
  final norm + LM head, the root; mixed precision, offload and activation checkpointing from
  the plugin). The trainer leaves it all to accelerate.
* CPU ranks: ``AcceleratorState`` turns FSDP on only for GPU-like device types, so the
  state stays ``DistributedType.NO``, the plugin is dropped, the model would be neither
  sharded nor its gradients synchronised. The trainer therefore shards it itself when it is
  built (:func:`shard_model`), with accelerate's own ``fsdp2_prepare_model`` and the same
  plugin, so both devices wrap the same modules the same way.

Either way FSDP2 reduce-scatters each gradient as the MEAN over all ``DP x SP`` ranks (its
mesh is the whole world; a ``parallelism_config`` is refused), as ZeRO-3 does: the loss is
built with ``gradients_averaged_over_sp=True``. Imports accelerate only inside functions.
Which engine runs, and what is refused (FSDP1, ``use_cpu``), is :mod:`.engines`' business.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

LAUNCH = ("accelerate launch --config_file examples/trl/fsdp2.yaml (distributed_type: FSDP, fsdp_version: 2), "
          "or on GPUs TrainingArguments(fsdp=True, fsdp_config={'version': 2})")


def requested_fsdp_version(args: Any) -> int | None:
    """The FSDP version ``args`` or accelerate's launcher asks for, or None without FSDP.

    ``TrainingArguments(fsdp=...)`` first (transformers' ``fsdp_plugin_args``), else the
    environment ``accelerate launch`` sets from an FSDP config (``ACCELERATE_USE_FSDP``,
    ``FSDP_VERSION``, whose unset default is accelerate's own: 1).
    """
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if plugin_args is not None:
        return int(plugin_args.get("fsdp_version", 1))
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def check_trainer(args: Any, accelerator: Any, *, shards_itself: bool) -> None:
    """What must hold for the trainer under FSDP2 (names the argument and the fix)."""
    refused = {
        "parallelism_config": (getattr(args, "parallelism_config", None) is not None
                               or getattr(accelerator, "parallelism_config", None) is not None,
                               "drop it: ring_sp's grid is the sequence parallelism, FSDP2 shards over all ranks"),
    }
    if shards_itself:
        where = "on CPU ranks, where the trainer shards the model itself"
        save = getattr(args.save_strategy, "value", args.save_strategy)  # transformers' SaveStrategy enum
        refused.update({
            f"save_strategy={save!r} {where}": (
                save != "no",
                "set save_strategy='no' and call trainer.save_model() at the end (a full state dict); FSDP2 "
                "checkpoints are accelerate's, on GPUs"),
            f"mixed precision (bf16/fp16) {where}": (bool(args.bf16 or args.fp16), "train in fp32 on CPU"),
        })
    for name, (present, fix) in refused.items():
        if present:
            raise ValueError(f"ring_sp under FSDP2 does not support {name}; {fix}")


def fsdp_plugin(args: Any) -> Any:
    """The plugin accelerate would use: from ``TrainingArguments(fsdp=...)``, else from the launcher's environment."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin_args = getattr(args, "fsdp_plugin_args", None)
    return FullyShardedDataParallelPlugin(**plugin_args) if plugin_args else FullyShardedDataParallelPlugin()


def shard_model(model: torch.nn.Module, plugin: Any) -> torch.nn.Module:
    """``model`` sharded over all ranks with accelerate's ``fsdp2_prepare_model``, in place (CPU ranks).

    Before the optimizer exists (its parameters are then the sharded ones). The plugin's
    options that accelerate applies outside that function on GPUs (activation
    checkpointing, offload, rank-0 loading) are refused here rather than dropped.
    """
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import CPUOffloadPolicy

    unsupported = {
        "activation_checkpointing": (plugin.activation_checkpointing,
                                     "use TrainingArguments(gradient_checkpointing=True)"),
        "cpu_offload": (isinstance(plugin.cpu_offload, CPUOffloadPolicy), "the ranks are on CPU already; set it false"),
        "cpu_ram_efficient_loading": (plugin.cpu_ram_efficient_loading, "set it false (every rank builds the model)"),
    }
    for name, (present, fix) in unsupported.items():
        if present:
            raise ValueError(f"FSDP2 {name} on CPU ranks (the trainer shards the model itself there): {fix}")
    # the part of the Accelerator fsdp2_prepare_model reads; no device mesh: the whole world
    view = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None, mixed_precision="no",
                           is_main_process=dist.get_rank() == 0, device=torch.device("cpu"))
    return fsdp2_prepare_model(view, model)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU (collective: every rank calls it; every rank gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def mean_over_ranks_(value: torch.Tensor) -> None:
    """``value`` becomes its mean over all ranks, in place (gloo has no AVG: sum, then divide)."""
    dist.all_reduce(value)
    value.div_(dist.get_world_size())


__all__ = ["LAUNCH", "check_trainer", "fsdp_plugin", "full_state_dict", "mean_over_ranks_", "requested_fsdp_version",
           "shard_model"]
