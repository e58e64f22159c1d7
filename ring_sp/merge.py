"""The online-softmax merge of partial attention results (DESIGN.md section 4).

Each block of keys gives a partial ``(out_b, lse_b)``; merging into the running
``(out, lse)`` in float32 is exact up to rounding::

    lse_new = logaddexp(lse, lse_b)
    out_new = out * exp(lse - lse_new) + out_b * exp(lse_b - lse_new)

``torch.logaddexp`` cannot overflow, and ``-inf`` rows are guarded: a block with no
visible key (``lse_b = -inf``) contributes nothing, and a row that has seen no key yet
(both ``-inf``) stays ``out = 0, lse = -inf`` instead of ``-inf - -inf = NaN``.
"""

from __future__ import annotations

import torch


def _weight(lse_part: torch.Tensor, lse_total: torch.Tensor) -> torch.Tensor:
    """``exp(lse_part - lse_total)`` as ``[b, s, h, 1]`` to scale a ``[b, s, h, d]`` output;
    0 where the row has seen no key at all (``lse_total = -inf``)."""
    safe_total = lse_total.masked_fill(torch.isneginf(lse_total), 0.0)
    return torch.exp(lse_part - safe_total).transpose(1, 2).unsqueeze(-1)


def merge_block_(out: torch.Tensor, lse: torch.Tensor, out_block: torch.Tensor, lse_block: torch.Tensor) -> None:
    """Merge one block's result into the running accumulators, in place.

    out ``[b, s, h, d]`` and lse ``[b, h, s]``: the accumulators (float32/64, views allowed);
    out_block ``[b, s, h, d]`` (any float dtype) and lse_block ``[b, h, s]``: the new block.
    """
    lse_new = torch.logaddexp(lse, lse_block)
    out.mul_(_weight(lse, lse_new)).add_(out_block.to(out.dtype) * _weight(lse_block, lse_new))
    lse.copy_(lse_new)


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge of ``n`` partial results at once (the same formula as :func:`merge_block_`, one
    pass of a few kernels instead of ``n``): out ``[n, b, s, h, d]`` and lse ``[n, b, h, s]`` (float32/64)
    -> the merged out ``[b, s, h, d]`` and lse ``[b, h, s]``; rows no part saw stay 0 and ``-inf``."""
    total = torch.logsumexp(lse, dim=0)
    safe_total = total.masked_fill(torch.isneginf(total), 0.0)
    weight = torch.exp(lse - safe_total).transpose(2, 3).unsqueeze(-1)  # [n, b, s, h, 1]
    return (out * weight).sum(dim=0), total


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add attention sinks to finished (fully merged) rows, exactly, once.

    A sink is one logit per head whose ``exp`` joins every row's softmax denominator with
    no value (gpt-oss): ``lse' = logaddexp(lse, sink)``, ``out' = out * exp(lse - lse')``.
    out ``[b, s, h, d_v]`` (any float dtype), lse ``[b, h, s]`` (float32/64), sinks ``[h]``
    (this call's heads) -> out' in lse's dtype and lse'. A row that saw no key gets
    ``out' = 0`` and ``lse' = sink``; a sink of ``-inf`` changes nothing.
    """
    lse_new = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return out.to(lse.dtype) * _weight(lse, lse_new), lse_new


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the sinks folded by :func:`fold_sinks`, from this call's rows:
    ``dsink[h] = -sum_{b,i} exp(sink[h] - lse'[b,h,i]) * D[b,i,h]`` with ``D = sum_d dout * out``.

    dout/out ``[b, s, h, d_v]`` (the folded out), lse ``[b, h, s]`` (the folded lse'),
    sinks ``[h]`` -> ``[h]`` in lse's dtype (float32/64 accumulation).
    """
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # D [b, s, h]
    weight = _weight(sinks.to(acc).view(1, -1, 1), lse)[..., 0]  # exp(sink - lse') [b, s, h]
    return -(weight * delta).sum(dim=(0, 1))
