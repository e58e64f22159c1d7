"""Running megatron-core on CPU ranks (gloo): what hard-codes CUDA, and the one shim.

Found in megatron-core 0.16.1, on a machine without CUDA:

* ``DistributedDataParallel`` allocates its gradient buffers on
  ``torch.cuda.current_device()``: :func:`ddp_buffers_on_cpu` makes that call answer
  ``"cpu"`` while the wrapper is built (its reduction itself runs on gloo unchanged).
* ``RotaryEmbedding`` moves its frequencies to CUDA and ``get_pos_emb_on_this_cp_rank``
  builds a pinned CUDA index: :func:`ring_sp.integrations.megatron.install_layout_rope`.
* ``DotProductAttention`` (the local spec's core attention) forks the CUDA RNG tracker
  for dropout, and its default causal mask is built on CUDA: the ring_sp spec replaces it.
* The optimizers in ``megatron.core.optimizer`` create ``device='cuda'`` tensors (loss
  scale, found-inf flag, grad-norm buffers) and the pipeline schedules count tokens on
  CUDA: on CPU, step ``torch.optim`` on the DDP's reduced ``main_grad`` instead.
* ``model_parallel_cuda_manual_seed`` needs CUDA: seed with ``torch.manual_seed`` and build
  with ``use_cpu_initialization=True`` (every rank then draws the full weights and keeps
  its tensor-parallel slice, so results do not depend on the parallel layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
import torch


@contextlib.contextmanager
def ddp_buffers_on_cpu() -> Iterator[None]:
    """Within the block, ``torch.cuda.current_device()`` returns ``"cpu"``: wrap the
    construction of megatron-core's ``DistributedDataParallel`` around a CPU model with it
    (its buffers are then allocated on CPU). Restored on exit; do not use it for CUDA models."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original
