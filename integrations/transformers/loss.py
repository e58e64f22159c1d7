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
import torch.distributed as dist
import torch.nn.functional as F

from ring_sp import SequenceParallelAttention, SequenceParallelTopology, sequence_parallel_cross_entropy
from ring_sp.agreement import CallSignature, agree, shard_values, validation_requested
from ring_sp.data import IGNORE_INDEX
from ring_sp.integrations.gradient_reduction import gradients_averaged_over_sp as averaged_by

from .attention import registered_topology, uses_ring_sp
from .shards import agreed_values, fingerprint_of, loss_labels_error


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

    Checks (an error on one rank is raised on every rank of the SP group: one small
    agreement before the loss's all-reduce, skipped with ``RING_SP_VALIDATE=0``): the shapes;
    ``shift_labels`` are those of the shard the logits were made from (when ``logits`` is the
    tensor a ring_sp model's forward returned: another rank's labels, or UNSHIFTED ones, raise);
    a ring_sp model's logits without ``engine=``/``topology=``, or with an engine made by
    ``deepspeed.initialize`` instead of ``ring_sp.integrations.deepspeed.initialize``, raise.
    """
    mark = fingerprint_of(logits)  # the shard the logits were made from (a forward of a ring_sp model), or None
    try:
        reduction = loss_reduction(engine=engine, topology=topology, gradients_averaged_over_sp=gradients_averaged_over_sp)
        if reduction is None and mark is not None:
            raise ValueError(
                "causal_lm_loss: these logits are one sequence-parallel rank's shard (a forward of a ring_sp model on "
                "several ranks) but neither engine= (from ring_sp.integrations.deepspeed.initialize) nor topology= was "
                "given, so the loss would be this rank's mean; pass one of them")
    except (TypeError, ValueError) as exc:
        registered = registered_topology()
        if mark is None or registered is None:
            raise  # no ring_sp forward behind these logits: no group to tell
        check_loss_inputs(logits, shift_labels, registered.sp_group, ignore_index=ignore_index, averaged=None,
                          mark=mark, error=exc)  # raises on every rank of the SP group
        raise  # not reached
    if reduction is None:
        _check_shapes(logits, shift_labels)
        return _plain_mean(logits, shift_labels, ignore_index)
    group, averaged = reduction
    check_loss_inputs(logits, shift_labels, group, ignore_index=ignore_index, averaged=averaged, mark=mark)
    return sequence_parallel_cross_entropy(logits, shift_labels, group=group, ignore_index=ignore_index,
                                           gradients_averaged_over_sp=averaged)


def check_loss_inputs(logits: torch.Tensor, labels: torch.Tensor, group: Any, *, ignore_index: int, averaged: bool | None,
                      mark: torch.Tensor | None = None, name: str = "shift_labels", error: Exception | None = None) -> None:
    """Every rank of ``group`` raises if any rank's loss inputs are wrong: ``error`` (found by the
    caller), the shapes, and the labels against the shard's fingerprint ``mark``
    (:func:`.shards.loss_labels_error`). One small agreement (skipped with ``RING_SP_VALIDATE=0``:
    then errors raise on their rank alone)."""
    try:
        _check_shapes(logits, labels, name)
        if error is None and mark is not None:
            error = loss_labels_error(mark, labels, "causal_lm_loss")
    except ValueError as exc:
        error = error or exc
    if validation_requested(None) and dist.get_world_size(group) > 1:
        signature = CallSignature.named("loss", (*_dims(logits, 3), *_dims(labels, 2), ignore_index,
                                                 -1 if averaged is None else int(averaged)),
                                        f"logits {tuple(logits.shape)}, {name} {tuple(labels.shape)}")
        with shard_values(agreed_values(mark)):
            agree(group, signature, error, always=True, device=logits.device)
    if error is not None:
        raise error


def _check_shapes(logits: torch.Tensor, labels: torch.Tensor, name: str = "shift_labels") -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and {name} {tuple(labels.shape)} must agree on [batch, seq]; "
            f"pass model(**shard).logits and shard[{name!r}] of the same shard"
        )


def _dims(t: torch.Tensor, count: int) -> tuple[int, ...]:
    return (*t.shape, *(-1,) * count)[:count] if t.dim() <= count else (-2,) * count


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
            _refuse_unprepared(engine)
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


def _refuse_unprepared(engine: Any) -> None:
    """An engine without ring_sp's hookup (``deepspeed.initialize`` itself) around a model whose
    attention runs on several SP ranks: DeepSpeed would average gradients and count batches as
    if every rank held whole samples, and the loss would be one rank's mean."""
    if getattr(engine, "_ring_sp_checked", False):
        return
    model = getattr(engine, "module", None)
    sizes = set()
    if isinstance(model, torch.nn.Module):
        sizes = {m.topology.sp_size for m in model.modules() if isinstance(m, SequenceParallelAttention)}
        if uses_ring_sp(model) and registered_topology() is not None:
            sizes.add(registered_topology().sp_size)
    if max(sizes, default=1) > 1:
        raise ValueError(
            f"engine= is a {type(engine).__name__} without ring_sp's hookup (no ring_sp_topology: made by "
            f"deepspeed.initialize, not ring_sp.integrations.deepspeed.initialize) around a model whose attention runs "
            f"on {max(sizes)} sequence-parallel ranks; DeepSpeed would treat every SP rank as a data-parallel replica. "
            f"Create the engine with ring_sp.integrations.deepspeed.initialize and a \"ring_sp\" config section")
    try:
        engine._ring_sp_checked = True
    except AttributeError:  # an object that takes no attributes: check it again next time
        pass


def _plain_mean(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """No sequence parallelism: this rank holds whole samples."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index)


__all__ = ["causal_lm_loss", "check_loss_inputs", "loss_reduction"]
