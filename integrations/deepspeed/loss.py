"""The training loss under DeepSpeed's gradient reduction, which depends on the ZeRO stage.

:func:`cross_entropy` scales its backward by the table of
:mod:`ring_sp.integrations.gradient_reduction` (re-exported here as
:func:`gradients_averaged_over_sp`): ZeRO 0-2 sum gradients over SP, ZeRO 3 averages them.
:func:`evaluation_loss` is the exact loss over an evaluation set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ring_sp import SequenceParallelTopology, sequence_parallel_cross_entropy
from ring_sp.agreement import CallSignature, raise_together
from ring_sp.data import IGNORE_INDEX
from ring_sp.integrations.gradient_reduction import gradients_averaged_over_sp
from ring_sp.integrations.transformers.loss import check_loss_inputs  # imports no transformers


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
    backward, once ``engine`` has reduced it, gives the exact full-sequence gradients. A shape
    error on one rank is raised on every rank (one small agreement before the all-reduce).
    """
    group, averaged = _engine_topology(engine).sp_group, gradients_averaged_over_sp(engine)
    check_loss_inputs(logits, labels, group, ignore_index=ignore_index, averaged=averaged, name="labels")  # on every rank
    return sequence_parallel_cross_entropy(logits, labels, group=group, ignore_index=ignore_index,
                                           gradients_averaged_over_sp=averaged)


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
    one, uncounted. An error fetching a batch on any rank (the collator's) raises on every rank
    (one agreement per batch, before its forward; off with ``RING_SP_VALIDATE=0``). Collective
    over ``topology.dp_sp_group`` (or the default group).
    """
    group = None if topology is None else topology.dp_sp_group
    steps = torch.tensor(len(batches), device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    iterator, last = iter(batches), None
    signature = CallSignature.named("shard", (int(steps),), "an evaluation batch")
    for _ in range(int(steps)):
        try:  # a collator's error on one rank (shard_batch's, say): every rank raises it, before the forward
            batch, error = next(iterator, None), None
        except (TypeError, ValueError) as exc:
            batch, error = None, exc
        if error is None and batch is None and last is None:
            error = ValueError(
                f"the evaluation set gives this data-parallel replica no batch while others have some; use at least "
                f"{1 if topology is None else topology.dp_size} x the evaluation batch size samples")
        raise_together(dist.group.WORLD if group is None else group, signature, error, device=torch.device(device))
        with torch.no_grad():
            loss_sum, count = loss_sum_of(last if batch is None else batch)
        if batch is not None:
            totals += torch.stack((loss_sum.detach().double().to(device), torch.as_tensor(count).double().to(device)))
            last = batch
    dist.all_reduce(totals, group=group)
    return (totals[0] / totals[1].clamp(min=1)).item(), int(totals[1].item())


__all__ = ["cross_entropy", "evaluation_loss", "gradients_averaged_over_sp"]
