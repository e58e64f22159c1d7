"""Loss reduction over a sequence-parallel group, weighted by valid-token counts.

Every SP rank holds different tokens of the same sample, so the exact loss is the sum of
all ranks' token losses divided by the number of valid tokens in the whole group. A rank
with zero valid tokens contributes 0 and yields no NaN.

Gradient convention: each SP rank back-propagates through the attention of every other
rank, so the parameter gradient of the global loss is the SUM of the SP ranks' gradients.
Frameworks differ in what they do over the SP ranks, so say which with
``gradients_averaged_over_sp``:

* ``True`` when the gradient reduction AVERAGES over the DP x SP ranks (Megatron DDP over
  its data-parallel-with-context-parallel group; DeepSpeed ZeRO-3): the backward is scaled
  by the SP size to cancel that average, as Megatron scales its loss by the CP size;
* ``False`` when it SUMS over the SP ranks (DeepSpeed ZeRO 0/1/2 divide by DP only; a
  plain ``all_reduce(SUM)``).

The integrations pick it for you (``ring_sp.integrations.deepspeed.cross_entropy``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .data import IGNORE_INDEX


class _GroupMeanLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss_sum: torch.Tensor, count: torch.Tensor, group: dist.ProcessGroup | None, grad_scale: float) -> torch.Tensor:
        totals = torch.stack((loss_sum.detach().to(torch.float64), count.detach().to(torch.float64)))
        dist.all_reduce(totals, group=group)
        denominator = totals[1].clamp(min=1.0)
        ctx.save_for_backward(denominator)
        ctx.grad_scale = grad_scale
        return (totals[0] / denominator).to(loss_sum.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (denominator,) = ctx.saved_tensors
        return (grad * ctx.grad_scale / denominator).to(grad.dtype), None, None, None


def sequence_parallel_loss(
    loss_sum: torch.Tensor,
    num_tokens: torch.Tensor | int,
    *,
    group: dist.ProcessGroup | None = None,
    gradients_averaged_over_sp: bool,
) -> torch.Tensor:
    """Global mean loss over the SP ``group`` from this rank's summed loss and token count.

    ``loss_sum``: 0-d tensor, the sum of this rank's per-token losses; ``num_tokens``: its
    number of valid tokens (may be 0). Returns a 0-d tensor, the same on every SP rank.
    ``gradients_averaged_over_sp`` (required: frameworks differ) is explained in the
    module docstring.
    """
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
        raise ValueError(f"loss_sum must be a 0-d tensor (a sum over tokens); got {loss_sum!r}")
    count = torch.as_tensor(num_tokens, device=loss_sum.device)
    scale = float(dist.get_world_size(group)) if gradients_averaged_over_sp else 1.0
    return _GroupMeanLoss.apply(loss_sum, count, group, scale)


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
    gradients_averaged_over_sp: bool,
) -> torch.Tensor:
    """Token-weighted cross entropy over the SP ``group``.

    logits ``[b, n, vocab]`` and labels ``[b, n]`` (already shifted, e.g. by
    :func:`ring_sp.shard_batch`) for this rank's shard; returns the global mean (0-d).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must agree on [batch, seq]")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: fp32 softmax
    loss_sum = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    count = (labels != ignore_index).sum()
    return sequence_parallel_loss(loss_sum, count, group=group, gradients_averaged_over_sp=gradients_averaged_over_sp)
