"""Causal work per rank, counted at the local kernel's calls.

Every mode (ring_sp's and the DeepSpeed baseline) computes attention through one kernel
class; :func:`count_scores` wraps its ``forward`` for the block and sums the attention
scores computed: ``batch x q heads x (query, key) pairs`` of each call, ``s(s+1)/2``
pairs for a causal square block. max/mean of that over ranks is the load balance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> int:
    """Attention scores of one kernel call: q ``[b, sq, h, d]``, k ``[b, sk, h_kv, d]``."""
    b, sq, h, _ = q.shape
    pairs = sq * (sq + 1) // 2 if causal else sq * k.shape[1]
    return b * h * pairs


@contextlib.contextmanager
def count_scores(kernel_class: type) -> Iterator[list[int]]:
    """``[scores]`` computed by ``kernel_class.forward`` calls in the block."""
    tally = [0]
    original = kernel_class.forward

    def counting(self, q, k, v, *, causal, scale):
        tally[0] += scores(q, k, causal)
        return original(self, q, k, v, causal=causal, scale=scale)

    kernel_class.forward = counting
    try:
        yield tally
    finally:
        kernel_class.forward = original
