"""The training loss under DeepSpeed's gradient reduction, which depends on the ZeRO stage.

Each SP rank back-propagates through every other rank's attention, so the exact gradient
of the global loss is the SUM of the SP ranks' gradients (see :mod:`ring_sp.loss`).
DeepSpeed 0.19, told the sequence-parallel size by the mpu, reduces over all ``DP x SP``
ranks and then

* ZeRO 0, 1, 2 divide by ``DP`` only (engine ``_reduce_non_expert_gradients``; ZeRO 1/2
  ``average_tensor``, ``gradient_reduction_w_predivide``, ``allreduce_bucket``): a sum over
  SP, so the loss backward must not be scaled (``gradients_averaged_over_sp=False``);
* ZeRO 3 divides by ``DP x SP`` (``__avg_scatter_grads`` -> ``reduce_scatter_coalesced``,
  its default path with ``reduce_scatter: true``): an average over SP, which ring_sp's
  ``gradients_averaged_over_sp=True`` cancels.

:func:`gradients_averaged_over_sp` encodes that table and the tests prove each row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ring_sp import SequenceParallelTopology, sequence_parallel_cross_entropy
from ring_sp.data import IGNORE_INDEX


def gradients_averaged_over_sp(engine: Any) -> bool:
    """Whether ``engine`` (from ``ring_sp.integrations.deepspeed.initialize``) averages gradients over SP.

    Pass it as ``gradients_averaged_over_sp=`` to :func:`ring_sp.sequence_parallel_loss` or
    :func:`ring_sp.sequence_parallel_cross_entropy` for a custom loss.
    """
    return engine.zero_optimization_stage() == 3


def _engine_topology(engine: Any) -> SequenceParallelTopology:
    """The topology :func:`ring_sp.integrations.deepspeed.initialize` attached to ``engine``."""
    topology = getattr(engine, "ring_sp_topology", None)
    if topology is None:
        raise ValueError(
            "this engine has no ring_sp topology: create it with ring_sp.integrations.deepspeed.initialize and a "
            '"ring_sp" section in the DeepSpeed config'
        )
    return topology


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, engine: Any, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Token-weighted mean cross entropy of the whole sample(s) of ``engine``'s SP group.

    logits ``[b, n, vocab]``, labels ``[b, n]``: this rank's shard, labels already shifted
    (``topology.shard_batch``). Returns a 0-d tensor, equal on every SP rank, whose
    backward, once ``engine`` has reduced it, gives the exact full-sequence gradients.
    """
    return sequence_parallel_cross_entropy(
        logits, labels, group=_engine_topology(engine).sp_group, ignore_index=ignore_index,
        gradients_averaged_over_sp=gradients_averaged_over_sp(engine),
    )


def evaluation_loss(batches: Any, loss_sum_of: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
                    topology: SequenceParallelTopology | None, *, device: torch.device | str = "cpu") -> tuple[float, int]:
    """The exact loss over an evaluation set: ``(token mean, valid tokens)`` over ALL ranks.

    ``batches``: this rank's loader (a sized iterable; each DP replica a slice of the set,
    every sample once: :func:`..data.sequence_parallel_eval_sampler`; each SP rank its shard).
    ``loss_sum_of(batch) -> (sum of its token losses, its valid-token count)``, run under
    ``torch.no_grad()``. Sums and counts are summed over the ``DP x SP`` ranks (the default
    group without ``topology``) ONCE at the end, so the mean is what one rank holding every
    whole sequence computes. Every rank runs as many forwards as the busiest replica (ZeRO-3
    gathers parameters over all ranks in each): a replica out of batches repeats its last
    one, uncounted. Collective over ``topology.dp_sp_group`` (or the default group).
    """
    group = None if topology is None else topology.dp_sp_group
    steps = torch.tensor(len(batches), device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    iterator, last = iter(batches), None
    for _ in range(int(steps)):
        batch = next(iterator, None)
        if batch is None and last is None:
            raise ValueError(
                f"the evaluation set gives this data-parallel replica no batch while others have some; use at least "
                f"{1 if topology is None else topology.dp_size} x the evaluation batch size samples")
        with torch.no_grad():
            loss_sum, count = loss_sum_of(last if batch is None else batch)
        if batch is not None:
            totals += torch.stack((loss_sum.detach().double().to(device), torch.as_tensor(count).double().to(device)))
            last = batch
    dist.all_reduce(totals, group=group)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())


__all__ = ["cross_entropy", "evaluation_loss", "gradients_averaged_over_sp"]
