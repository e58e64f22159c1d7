"""DeepSpeed integration: a ``"ring_sp"`` section in the DeepSpeed config turns ring x Ulysses
sequence parallelism on.

    import ring_sp.integrations.deepspeed as rsp_ds

    topology = rsp_ds.build_topology(ds_config)           # before the model: its attention needs it
    model = MyModel(attention=ring_sp.SequenceParallelAttention(topology, causal=True))
    engine, optimizer, _, _ = rsp_ds.initialize(model=model, optimizer=opt, config=ds_config)
    loader = rsp_ds.sequence_parallel_dataloader(dataset, topology, batch_size=micro_batch)
    loss = rsp_ds.cross_entropy(engine(batch["input_ids"], batch["position_ids"]), batch["labels"], engine)

Importing this package imports neither DeepSpeed nor anything that communicates; the
config part (:class:`RingSPConfig`) works without DeepSpeed installed. On CPU ranks nothing
here lets DeepSpeed JIT-compile a C++ op (:func:`skip_cpu_inference_comm_build`, applied
wherever this package starts DeepSpeed's comm). It builds on
:mod:`ring_sp.integrations.transformers` (the registration and the long-sequence switch),
never the other way round; the ZeRO-stage table both packages' losses read is
:mod:`ring_sp.integrations.gradient_reduction`.
"""

from .config import SECTION, RingSPConfig
from .cpu import skip_cpu_inference_comm_build
from .data import (PackingCollator, ShardingCollator, sequence_parallel_dataloader, sequence_parallel_eval_sampler,
                   sequence_parallel_sampler)
from .engine import build_topology, initialize, load_config
from .loss import cross_entropy, evaluation_loss, gradients_averaged_over_sp
from .mpu import SequenceParallelMPU

__all__ = [
    "PackingCollator",
    "RingSPConfig",
    "SECTION",
    "SequenceParallelMPU",
    "ShardingCollator",
    "build_topology",
    "cross_entropy",
    "evaluation_loss",
    "gradients_averaged_over_sp",
    "initialize",
    "load_config",
    "sequence_parallel_dataloader",
    "sequence_parallel_eval_sampler",
    "sequence_parallel_sampler",
    "skip_cpu_inference_comm_build",
]
