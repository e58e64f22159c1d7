"""``initialize``: ``deepspeed.initialize`` with the ``"ring_sp"`` config section switched on.

Order on every rank: validate the section (no communication) -> initialise
torch.distributed the way DeepSpeed does -> check the sizes against the world -> take the
topology the model's :class:`ring_sp.SequenceParallelAttention` modules already use (or
build one) -> hand DeepSpeed a :class:`SequenceParallelMPU` over it. DeepSpeed is imported
inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ring_sp import SequenceParallelAttention, SequenceParallelTopology, init_sequence_parallel

from ring_sp.integrations.transformers.attention import registration, uses_ring_sp  # imports no transformers
from ring_sp.integrations.transformers.features import forbid_labels
from ring_sp.integrations.transformers.long_sequence import enable_long_sequence  # imports no transformers
from ring_sp.integrations.versions import require_supported

from .config import SECTION, RingSPConfig
from .cpu import skip_cpu_inference_comm_build
from .mpu import SequenceParallelMPU

_ARGS_CONFIG_ATTRS = ("deepspeed_config", "deepscale_config")  # where deepspeed.initialize looks in `args`


def load_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config as a dict: a dict as is, else a path (JSON/HJSON) or base64, read by DeepSpeed's loader."""
    if isinstance(config, Mapping):
        return dict(config)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(os.fspath(config))


def _init_distributed(distributed_port: int | None = None, dist_init_required: bool | None = None) -> None:
    """What ``deepspeed.initialize`` does first: join (or adopt) the default process group."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    skip_cpu_inference_comm_build()  # on CPU, DeepSpeed's comm would JIT-compile a C++ op here

    kwargs: dict[str, Any] = {"dist_init_required": dist_init_required}
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), **kwargs)


def build_topology(config: str | os.PathLike | Mapping[str, Any] | RingSPConfig) -> SequenceParallelTopology | None:
    """The ``DP x (U x R)`` topology a DeepSpeed config's ``"ring_sp"`` section describes.

    Build it BEFORE the model (whose ``SequenceParallelAttention`` needs it), then pass the
    model to :func:`initialize`, which adopts it. Returns None when the section is absent
    or disabled. Initialises torch.distributed through DeepSpeed if that has not happened.
    Collective over the default group.
    """
    sp = config if isinstance(config, RingSPConfig) else RingSPConfig.from_ds_config(load_config(config))
    if sp is None or not sp.enabled:
        return None
    require_supported("deepspeed", "the DeepSpeed config's 'ring_sp' section")
    if not dist.is_initialized():
        _init_distributed()
    sp.check_world_size(dist.get_world_size())
    return init_sequence_parallel(sp.ulysses_size, sp.ring_size, placement=sp.placement)


def _model_topology(model: torch.nn.Module, sp: RingSPConfig) -> SequenceParallelTopology | None:
    """The one topology the model's attention modules share (checked against the section), or None.

    A Hugging Face model running ``attn_implementation="ring_sp"`` counts as one such module:
    the registration of ``ring_sp.integrations.transformers.register``.
    """
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, SequenceParallelAttention)]
    if uses_ring_sp(model):
        registered = registration()
        if registered is None:
            raise ValueError('the model uses attn_implementation="ring_sp" but nothing is registered: call '
                             "ring_sp.integrations.transformers.register(build_topology(ds_config)) before the model")
        modules.append(('attn_implementation="ring_sp"', registered))
    topologies = {id(m.topology): m.topology for _, m in modules}
    if len(topologies) > 1:
        raise ValueError(
            f"the model's SequenceParallelAttention modules use {len(topologies)} different topologies; build one "
            f"with build_topology(ds_config) and pass it to every module"
        )
    for name, module in modules:
        for key in ("layout", "backend", "kv_exchange"):
            if getattr(module, key) != getattr(sp, key):
                raise ValueError(
                    f"{SECTION}.{key}={getattr(sp, key)!r} but module {name!r} was built with {key}="
                    f"{getattr(module, key)!r}; build the attention with the section's {key} (data is sharded with it)"
                )
    if not topologies:
        return None
    topology = next(iter(topologies.values()))
    for key in ("ulysses_size", "ring_size", "placement"):
        if getattr(topology, key) != getattr(sp, key):
            raise ValueError(
                f"{SECTION}.{key}={getattr(sp, key)!r} but the model's attention topology has {key}="
                f"{getattr(topology, key)!r}; build the topology from the same config (build_topology(ds_config))"
            )
    if topology.dp_size * topology.sp_size != dist.get_world_size():
        raise ValueError(
            f"the model's topology spans {topology.dp_size * topology.sp_size} ranks but DeepSpeed runs on all "
            f"{dist.get_world_size()}; build it over the default group (build_topology(ds_config))"
        )
    return topology


def _partition_over_dp_sp(model: torch.nn.Module, ds_config: dict[str, Any], topology: SequenceParallelTopology,
                          mpu: SequenceParallelMPU) -> None:
    """ZeRO-3: shard the parameters over all ``DP x SP`` ranks, where gradients are reduce-scattered.

    Left alone, the engine would partition them over ``mpu.get_data_parallel_group()`` (DP
    only, the group DeepSpeed's own Ulysses mpu does not have) and reduce-scatter their
    gradients over DP x SP: wrong gradients. Parameters already converted (a model built
    under ``deepspeed.zero.Init``) must have used ``data_parallel_group=topology.dp_sp_group``.
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    dp_sp_ranks = dist.get_process_group_ranks(topology.dp_sp_group)
    for name, param in model.named_parameters():
        if is_zero_param(param) and dist.get_process_group_ranks(param.ds_process_group) != dp_sp_ranks:
            raise ValueError(
                f"parameter {name!r} was partitioned by deepspeed.zero.Init over ranks "
                f"{dist.get_process_group_ranks(param.ds_process_group)}, but ZeRO-3 with the {SECTION!r} section "
                f"needs all DP x SP ranks {dp_sp_ranks}: build the model under "
                f"deepspeed.zero.Init(data_parallel_group=topology.dp_sp_group, ...)"
            )
    if not any(is_zero_param(p) for p in model.parameters()):  # else the engine converts the rest alike
        deepspeed.zero.Init(module=model, data_parallel_group=topology.dp_sp_group, config_dict_or_path=ds_config, mpu=mpu)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | os.PathLike | Mapping[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Drop-in for ``deepspeed.initialize``: same arguments, same ``(engine, optimizer, dataloader, lr_scheduler)``.

    Without an enabled ``"ring_sp"`` section it IS ``deepspeed.initialize``. With one, the
    engine's ZeRO partitioning and gradient reduction run over the ``DP x SP`` ranks,
    DeepSpeed's ``sequence_parallel_size`` is ``U * R`` and its batch arithmetic counts
    ``DP = world / (U * R)`` replicas; ``engine.ring_sp_topology`` and
    ``engine.ring_sp_config`` give the topology and the parsed section. The topology is the
    one the model's ``SequenceParallelAttention`` modules use, or a new one when the model
    has none. Compute the loss with :func:`ring_sp.integrations.deepspeed.cross_entropy`, or
    for a Hugging Face model ``ring_sp.integrations.transformers.model_loss(engine, shard)``,
    which honours the section's ``tiled_mlp`` / ``tiled_loss`` / ``offload_checkpoints``
    (applied to the model here, before any collective).
    ``distributed_port=None`` means DeepSpeed's default. On CPU ranks DeepSpeed's comm starts
    without building its C++ shared-memory op (:func:`skip_cpu_inference_comm_build`).
    """
    import deepspeed

    skip_cpu_inference_comm_build()  # also on the plain path: deepspeed.initialize starts the comm
    passthrough = dict(
        args=args, model=model, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
        lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn,
        config=config, mesh_param=mesh_param, config_params=config_params,
    )
    if distributed_port is not None:
        passthrough["distributed_port"] = distributed_port
    source = _config_source(args, config, config_params)
    user_config = None if source is None else load_config(source)
    sp = None if user_config is None else RingSPConfig.from_ds_config(user_config)
    if sp is None and model is not None:
        _refuse_sequence_parallel_model(model, user_config)
    if sp is None or model is None:
        return deepspeed.initialize(**passthrough)  # nothing of ours (or DeepSpeed's own error)

    require_supported("deepspeed", "the DeepSpeed config's 'ring_sp' section")  # its mpu/engine hooks
    if mpu is not None:
        raise ValueError(f"mpu= cannot be combined with the {SECTION!r} config section, which supplies the mpu; drop one")
    if mesh_param is not None:
        raise ValueError(f"mesh_param= cannot be combined with the {SECTION!r} config section; the section defines the groups")
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        raise ValueError(f"the {SECTION!r} section does not support pipeline parallelism (model is a PipelineModule)")

    if sp.long_sequence is not None:
        _enable_long_sequence(model, sp)  # local: before any collective
    _init_distributed(distributed_port, dist_init_required)
    ds_config = sp.apply(user_config, dist.get_world_size())
    topology = _model_topology(model, sp)
    if topology is None:
        topology = init_sequence_parallel(sp.ulysses_size, sp.ring_size, placement=sp.placement)

    mpu = SequenceParallelMPU(topology)
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        _partition_over_dp_sp(model, ds_config, topology, mpu)

    ds_args = copy.copy(args)  # the config travels as config=, so args must not carry it too
    for attr in _ARGS_CONFIG_ATTRS:
        if getattr(ds_args, attr, None) is not None:
            setattr(ds_args, attr, None)
    passthrough.update(args=ds_args, mpu=mpu, config=ds_config, config_params=None)
    engine, ds_optimizer, dataloader, scheduler = deepspeed.initialize(**passthrough)
    if hasattr(args, "local_rank"):
        args.local_rank = engine.local_rank  # as deepspeed.initialize does to the caller's args
    if engine.sequence_parallel_size != topology.sp_size:
        # .loss's table of DeepSpeed's gradient divisors assumes DeepSpeed knows the SP size
        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__} reports sequence_parallel_size={engine.sequence_parallel_size}, "
            f"not {topology.sp_size}; its gradient averaging would not match ring_sp's loss"
        )
    engine.ring_sp_topology = topology
    engine.ring_sp_config = sp
    if uses_ring_sp(model):
        forbid_labels(model, topology.sp_size)  # engine(**shard, labels=...) would compute a per-shard loss
    return engine, ds_optimizer, dataloader, scheduler


def _refuse_sequence_parallel_model(model: torch.nn.Module, user_config: Mapping[str, Any] | None) -> None:
    """A model whose attention is ring_sp's must not start without the section: DeepSpeed would
    treat every SP rank as a data-parallel replica (ZeRO groups, gradient averaging, batch size)."""
    where = next((f"module {name!r} is a ring_sp.SequenceParallelAttention" for name, m in model.named_modules()
                  if isinstance(m, SequenceParallelAttention)), None)
    if where is None and uses_ring_sp(model):
        where = 'the model uses attn_implementation="ring_sp"'
    if where is None:
        return
    section = None if user_config is None else user_config.get(SECTION)
    state = f'its "{SECTION}" section has "enabled": false' if isinstance(section, Mapping) else f'it has no "{SECTION}" section'
    raise ValueError(
        f"{where}, but the DeepSpeed config passed to initialize is not sequence parallel ({state}), so DeepSpeed "
        f"would average gradients and count batches as if every rank held whole samples; add the section the "
        f"topology was built from (e.g. \"{SECTION}\": {{\"ulysses_size\": 2, \"ring_size\": 2}}), or build the "
        f'model without ring_sp (attn_implementation="sdpa" / a plain attention)'
    )


def _enable_long_sequence(model: torch.nn.Module, sp: RingSPConfig) -> None:
    """The section's ``tiled_mlp`` / ``tiled_loss`` / ``offload_checkpoints`` / ``tile_tokens`` /
    ``lean_layers`` on ``model``.

    A model with an ``enable_long_sequence(**options)`` method of its own (the DeepSpeed GPT
    example) takes them itself; any other is a Hugging Face causal LM
    (``ring_sp.integrations.transformers.enable_long_sequence``). Errors name the config keys.
    """
    own = getattr(model, "enable_long_sequence", None)
    try:
        if callable(own):
            own(**sp.long_sequence)
        else:
            enable_long_sequence(model, **sp.long_sequence)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f'the DeepSpeed config\'s "{SECTION}" section asks for {sp.long_sequence}: {exc} (a keyword '
                        f'"x=False" is "{SECTION}": {{"x": false}} in the config)') from exc


def save_checkpoint(engine: Any, save_dir: str | os.PathLike, tag: str, client_state: Mapping[str, Any] | None = None) -> None:
    """``engine.save_checkpoint`` whose ``latest`` never names a half-written tag (all ranks call it).

    DeepSpeed 0.19 writes ``latest`` on rank 0 right after rank 0's own files, before the
    other ranks finish theirs, with a plain ``open(..., "w")``: a rank killed while saving
    leaves ``latest`` naming a tag with a missing or truncated shard. Here every rank writes
    its files (``save_latest=False``), all wait at a barrier, and only then does rank 0 (the
    node's local rank 0 with node-local storage) replace ``latest`` atomically.
    """
    engine.save_checkpoint(save_dir, tag=tag, client_state=dict(client_state or {}), save_latest=False)
    dist.barrier()  # every rank's files of ``tag`` are written
    writer = engine.local_rank if engine.use_node_local_storage() else dist.get_rank()
    if writer == 0:
        write_file_atomically(os.path.join(save_dir, "latest"), tag)


def write_file_atomically(path: str | os.PathLike, text: str) -> None:
    """``path`` holds ``text`` or its previous content, never a part: a temporary file, fsync, rename."""
    temporary = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config ``deepspeed.initialize`` would use, or None when it would raise instead."""
    source = config if config is not None else config_params
    for attr in _ARGS_CONFIG_ATTRS:
        value = getattr(args, attr, None)
        if value is not None:
            if source is not None:
                return None  # two configs: DeepSpeed raises its own error
            source = value
    return source


__all__ = ["build_topology", "initialize", "load_config", "save_checkpoint", "write_file_atomically"]
