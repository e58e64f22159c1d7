"""DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``) around our kernel.

DeepSpeed's module all-to-alls q, k and v from ``[b, s/P, h, d]`` to ``[b, s, h/P, d]``
(``batch_dim_idx=0``, ``scatter_idx=2`` = heads, ``gather_idx=1`` = sequence), calls
``local_attention`` and all-to-alls the output back. The gathered sequence comes in rank
order, so inputs are sharded ``contiguous``. It needs at least as many KV heads as ranks
and raises ``AssertionError`` before any collective otherwise. Without DeepSpeed installed
the mode reports the ``ImportError``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ring_sp.integrations.deepspeed import skip_cpu_inference_comm_build


def deepspeed_ulysses(group: dist.ProcessGroup, local_attention: nn.Module) -> Callable[..., torch.Tensor]:
    """``attend(q, k, v) -> out`` over ``group`` with DeepSpeed's all-to-alls."""
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention

    if not deepspeed.comm.is_initialized():  # wraps the torch.distributed world already running
        skip_cpu_inference_comm_build()  # on CPU the comm would JIT-compile a C++ op
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    module = DistributedAttention(local_attention, group, scatter_idx=2, gather_idx=1)
    return lambda q, k, v: module(q, k, v, 0)
