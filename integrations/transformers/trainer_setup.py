"""Around the Hugging Face ``Trainer``: what ring_sp sets up before it and where accelerate calls out.

* :func:`prepare_sequence_parallel`: the grid of ``TrainingArguments.deepspeed``'s
  ``"ring_sp"`` section, registered as ``attn_implementation="ring_sp"`` before the model;
* :class:`SequenceParallelCollator`: a collator of GLOBAL batches -> this rank's shard;
* :func:`ring_sp_engine`: accelerate's ``deepspeed.initialize`` call routed to
  :func:`ring_sp.integrations.deepspeed.initialize` while the Trainer trains;
* :func:`unshard`: accelerate's split of the batches over all ranks undone (the sampler
  already splits over the ``DP`` replicas).

Importing this module (with DeepSpeed installed) keeps DeepSpeed's CPU backend from
JIT-compiling its C++ shared-memory op when ``TrainingArguments`` starts it. The Trainer
subclass that uses all of this is :mod:`.trainer`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from transformers import TrainingArguments

from ring_sp import SequenceParallelTopology
from ring_sp.integrations import deepspeed as rsp_ds
from ring_sp.integrations.versions import require_supported

from .attention import register, registration
from .data import shard_batch

if importlib.util.find_spec("deepspeed") is not None:
    # TrainingArguments(deepspeed=...) starts DeepSpeed's comm in its constructor, before any
    # other call of ours: on CPU ranks it must already find the C++ op marked unbuildable
    rsp_ds.skip_cpu_inference_comm_build()


def _ds_config(args: TrainingArguments) -> dict[str, Any] | None:
    """The DeepSpeed config dict the Trainer will use (``args.deepspeed``), or None."""
    processed = getattr(args, "hf_deepspeed_config", None)  # "auto" values already filled by transformers
    if processed is not None:
        return processed.config
    return None if args.deepspeed is None else rsp_ds.load_config(args.deepspeed)


def prepare_sequence_parallel(args: TrainingArguments) -> SequenceParallelTopology | None:
    """Build the grid of ``args.deepspeed``'s ``"ring_sp"`` section and register ``attn_implementation="ring_sp"``.

    Call it on every rank after ``TrainingArguments`` and BEFORE building the model (the
    attention needs the groups). Returns the topology, or None when the config has no
    enabled section (then nothing is registered and the Trainer runs as usual).
    Collective over the default group.
    """
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be transformers.TrainingArguments; got {type(args).__name__}")
    require_supported("accelerate", "ring_sp.integrations.transformers.trainer")
    config = _ds_config(args)
    sp = None if config is None else rsp_ds.RingSPConfig.from_ds_config(config)
    if sp is None:
        return None
    args.device  # noqa: B018 -- sets up torch.distributed through accelerate/DeepSpeed as the Trainer will
    topology = rsp_ds.build_topology(sp)
    register(topology, layout=sp.layout, backend=sp.backend, kv_exchange=sp.kv_exchange)
    return topology


class SequenceParallelCollator:
    """Wraps a collator of GLOBAL batches: returns this rank's shard (``shard_batch``).

    ``collator(features)`` must return ``input_ids`` ``[b, N]`` and optionally ``labels``,
    ``position_ids``, an all-ones ``attention_mask``; the result holds ``input_ids``,
    ``position_ids``, ``shift_labels`` (and ``cu_seq_lens_q/k`` for packed documents),
    each ``[b, N / sp_size]``. No communication (safe in DataLoader workers).
    """

    def __init__(self, collator: Callable[[list[Any]], Mapping[str, Any]], topology: SequenceParallelTopology,
                 *, layout: str) -> None:
        if not callable(collator):
            raise TypeError(f"collator must be callable; got {type(collator).__name__}")
        self.collator, self.topology, self.layout = collator, topology, layout

    def __call__(self, features: list[Any]) -> dict[str, torch.Tensor]:
        return shard_batch(self.collator(features), self.topology, layout=self.layout)


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
def ring_sp_engine() -> Iterator[None]:
    """While active, ``deepspeed.initialize`` (as accelerate calls it) is ring_sp's ``initialize``.

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


__all__ = ["SequenceParallelCollator", "prepare_sequence_parallel", "ring_sp_engine", "unshard"]
