"""The exact causal-LM loss of a sequence-parallel Hugging Face model.

transformers' own loss on a shard would be that rank's token mean; averaging those means
over the SP ranks is wrong whenever ranks hold different numbers of valid tokens (packed
documents, ignored labels). :func:`causal_lm_loss` is the token mean over the whole SP
group, with the backward scaled for the gradient reduction in use (see
:mod:`ring_sp.loss` for the convention; the DeepSpeed table is
:func:`ring_sp.integrations.gradient_reduction.gradients_averaged_over_sp`, shared with
:mod:`ring_sp.integrations.deepspeed`, which builds on this module and so is not imported here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ring_sp import SequenceParallelTopology, sequence_parallel_cross_entropy
from ring_sp.data import IGNORE_INDEX
from ring_sp.integrations.gradient_reduction import gradients_averaged_over_sp as averaged_by


def causal_lm_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    engine: Any = None,
    topology: SequenceParallelTopology | None = None,
    gradients_averaged_over_sp: bool | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean next-token cross entropy over every valid token of the SP group's sample(s).

    ``logits`` ``[b, n, vocab]`` (``model(**shard).logits``) and ``shift_labels`` ``[b, n]``
    (``shard["shift_labels"]``, from :func:`shard_batch`): this rank's shard. Returns a 0-d
    fp32-accurate tensor, equal on every SP rank. Say how gradients are reduced, one way:

    * ``engine=``: a DeepSpeed engine from ``ring_sp.integrations.deepspeed.initialize``
      (its ZeRO stage decides the scaling); an engine without a ``"ring_sp"`` section, or
      ``engine=None`` and ``topology=None``, means no sequence parallelism: the plain mean;
    * ``topology=`` with ``gradients_averaged_over_sp=True`` (gradients are AVERAGED over the
      ``DP x SP`` ranks, e.g. DDP over ``topology.dp_sp_group``) or ``False`` (SUMMED over SP).
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} must agree on [batch, seq]; "
            f"pass model(**shard).logits and shard['shift_labels'] of the same shard"
        )
    reduction = loss_reduction(engine=engine, topology=topology, gradients_averaged_over_sp=gradients_averaged_over_sp)
    if reduction is None:
        return _plain_mean(logits, shift_labels, ignore_index)
    group, averaged = reduction
    return sequence_parallel_cross_entropy(logits, shift_labels, group=group, ignore_index=ignore_index,
                                           gradients_averaged_over_sp=averaged)


def loss_reduction(*, engine: Any = None, topology: SequenceParallelTopology | None = None,
                   gradients_averaged_over_sp: bool | None = None) -> tuple[Any, bool] | None:
    """``(SP group, gradients_averaged_over_sp)`` for the loss of :func:`causal_lm_loss`'s arguments.

    None: no sequence parallelism (no engine and no topology, or an engine without a
    ``"ring_sp"`` section), the plain mean. Validates the combination (local, no communication).
    """
    if engine is not None and (topology is not None or gradients_averaged_over_sp is not None):
        raise ValueError("pass engine= alone (it knows its topology and gradient reduction), or topology= with "
                         "gradients_averaged_over_sp=, not both")
    if engine is not None:
        engine_topology = getattr(engine, "ring_sp_topology", None)
        if engine_topology is None:
            return None
        return engine_topology.sp_group, averaged_by(engine)
    if topology is None:
        if gradients_averaged_over_sp is not None:
            raise ValueError("gradients_averaged_over_sp= needs topology= (the SP group to reduce over)")
        return None
    if not isinstance(topology, SequenceParallelTopology):
        raise TypeError(f"topology must be a ring_sp.SequenceParallelTopology; got {type(topology).__name__}")
    if not isinstance(gradients_averaged_over_sp, bool):
        raise TypeError(
            f"with topology=, gradients_averaged_over_sp must be True (your reduction averages over DP x SP) or False "
            f"(it sums over SP); got {gradients_averaged_over_sp!r}"
        )
    return topology.sp_group, gradients_averaged_over_sp


def _plain_mean(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """No sequence parallelism: this rank holds whole samples."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index)


__all__ = ["causal_lm_loss", "loss_reduction"]
