"""Kernel-contract checks shared by the backends' tests (their CPU doubles and the GPU)."""

from __future__ import annotations

from typing import Any

import torch

from oracle import GRAD_TOL, assert_close, oracle_results


def check_two_key_blocks(kernel: Any, inputs: dict[str, torch.Tensor], scale: float) -> None:
    """Queries ``[b, s, h, d]`` at positions s..2s-1 against keys ``[b, 2s, h_kv, d]``: a past
    key block (full) and their own (causal), merged as the ring merges them; each block's
    backward, fed the merged GLOBAL out and a strided lse (as a ring may hold it), must give that
    block's share of the float64 oracle's gradient."""
    q, k, v, dout = (inputs[n] for n in ("q", "k", "v", "dout"))
    s, dtype = q.shape[1], q.dtype
    own = torch.ones(s, s, dtype=torch.bool)
    want = oracle_results(inputs, causal=False, scale=scale, mask=torch.cat([own, own.tril()], 1))
    blocks = [(slice(0, s), False), (slice(s, 2 * s), True)]
    parts = [kernel.forward(q, k[:, b], v[:, b], causal=c, scale=scale) for b, c in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2).unsqueeze(-1) for o, l in parts).to(dtype)
    lse = lse.transpose(1, 2).contiguous().transpose(1, 2)
    grads = [kernel.backward(dout, q, k[:, b], v[:, b], out, lse, causal=c, scale=scale) for b, c in blocks]
    merged = (grads[0][0].double() + grads[1][0].double(), *(torch.cat([g[i] for g in grads], 1) for i in (1, 2)))
    for got, name in zip(merged, ("dq", "dk", "dv")):
        assert_close(name, got, want[name], GRAD_TOL[dtype])
