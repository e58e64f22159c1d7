"""A CPU double of torch's ``aten._flash_attention_forward`` / ``aten._flash_attention_backward``,
the FlashAttention-2 port behind ring_sp's CUDA "torch" backend, with its window and varlen
semantics, so CI runs the band and varlen paths of :class:`ring_sp.kernels.torch_cuda.TorchCUDAKernel`.

It computes what the ops compute, in float32 from the definitions (no ring_sp code: a
reference, not a second kernel), behind the ops' schemas as torch 2.13 has them, read from
aten/src/ATen/native/transformers/cuda/attention.cu (``_flash_attention_forward``: the
optional windows become -1, ``cum_seq_q`` picks ``mha_varlen_fwd`` over ``mha_fwd``; the scale
defaults to 1/sqrt(d)), attention_backward.cu (the same for the backward; ``grad_out`` and
``out`` made contiguous) and cuda/flash_attn/flash_api.cpp:

* dense: q ``[b, sq, h, d]``, k/v ``[b, sk, h_kv, d]``, lse ``[b, h, sq]``. ``mha_fwd``:
  ``left >= sk`` -> -1, ``right >= sk`` -> -1 (unbounded; this is why a right window at or past
  ``seqlen_k`` shows keys a shorter window would hide), ``sq == 1`` -> not causal, then causal
  -> ``right = 0``. ``mha_bwd``: causal -> ``right = 0``, then the same two rules.
* varlen: q ``[total_q, h, d]``, k/v ``[total_k, h_kv, d]``, ``cum_seq_q/k`` int32 contiguous
  ``[segments + 1]`` (any row and head strides on q/k/v), lse ``[h, total_q]`` (FlashAttention
  2.6's unpadded layout); segment i is rows ``cu_q[i]:cu_q[i+1]`` against keys
  ``cu_k[i]:cu_k[i+1]``. ``mha_varlen_fwd``: ``max_q == 1`` -> not causal, causal -> ``right =
  0``; with ``max_q == 1``, more q heads than KV heads and no window it takes a path that
  reshapes q as one query per segment (an error if that is not so); then ``left/right >=
  max_k`` -> -1 (the LONGEST segment's keys, not each one's). ``mha_varlen_bwd`` likewise.
* the mask, per segment of ``sq`` rows and ``sk`` keys (bottom-right aligned): query a sees
  key c iff ``a + sk - sq - left <= c <= a + sk - sq + right`` (-1: no bound); causal is
  ``right = 0``. A row that sees no key (a segment without keys, or masked out) gets out 0
  and lse +inf (softmax.h: ``sum == 0 ? INFINITY``). The backward reads lse from its data
  pointer as a dense ``[b, h, sq]`` / ``[h, total_q]`` float32 buffer, takes lse -inf as 0
  (``scale_apply_exp2``), and writes every row and key of the call: dq of rows without keys
  and dk/dv of keys without queries are 0 (their tiles exit early writing zeros; the
  dot(dout, out) pass clears dq's accumulator).
* precision: out and dq in the input dtype (one rounding of fp32 accumulators); with GQA
  dk/dv per query head in the input dtype, summed per KV head with ``at::sum_out``.
* checks that raise: fp16/bf16 (``float32=True`` lifts this one, so index errors show at fp32
  tolerances), equal dtypes, last dim contiguous, head_dim a multiple of 8 and <= 256, heads
  divisible, int32 offsets, shapes.

Not modelled: dropout (dropout_p > 0 raises), ``seqused_k``, ALiBi, paged KV, the debug mask.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from flash_attn_double import _visible  # the same kernel family's mask (bottom-right from 2.1)

_HALF = (torch.float16, torch.bfloat16)


def _check(condition: bool, message: str) -> None:
    """TORCH_CHECK (a RuntimeError)."""
    if not condition:
        raise RuntimeError(message)


def _normalised(left: int | None, right: int | None, causal: bool, keys: int) -> tuple[int, int]:
    """attention.cu's optional -> -1, then causal -> right 0, then ``>= keys`` -> -1."""
    left, right = (-1 if left is None else left), (-1 if right is None else right)
    if causal:
        right = 0
    return (-1 if left >= keys else left), (-1 if right >= keys else right)


class _Segment:
    """One segment's scores in float32 ``[h, sq, sk]`` (GQA expanded), from the definition."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, left: int, right: int) -> None:
        h, h_kv = q.shape[1], k.shape[1]
        self.group = h // h_kv
        self.q, self.k, self.v = q.float(), k.float().repeat_interleave(self.group, 1), v.float().repeat_interleave(self.group, 1)
        scores = torch.einsum("qhd,khd->hqk", self.q, self.k) * scale
        self.scores = scores.masked_fill(~_visible(q.shape[0], k.shape[0], left, right, top_left=False), -math.inf)
        self.scale = scale

    def forward(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(self.scores, dim=-1)  # [h, sq]
        empty = torch.isneginf(lse)
        p = torch.exp(self.scores - lse.masked_fill(empty, 0).unsqueeze(-1))
        out = torch.einsum("hqk,khd->qhd", p, self.v).to(dtype)
        return out, lse.masked_fill(empty, math.inf)

    def backward(self, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq ``[sq, h, d]``, dk / dv ``[sk, h_kv, d]`` in ``dtype`` from the GIVEN out and lse ``[h, sq]``."""
        p = torch.exp(self.scores - lse.masked_fill(torch.isneginf(lse), 0).unsqueeze(-1))
        do = dout.float()
        delta = (do * out.float()).sum(-1).transpose(0, 1)  # [h, sq]
        dv = torch.einsum("hqk,qhd->khd", p, do)
        ds = p * (torch.einsum("qhd,khd->hqk", do, self.v) - delta.unsqueeze(-1))
        dq = torch.einsum("hqk,khd->qhd", ds, self.k) * self.scale
        dk = torch.einsum("hqk,qhd->khd", ds, self.q) * self.scale
        return dq.to(dtype), self._sum_group(dk.to(dtype)), self._sum_group(dv.to(dtype))

    def _sum_group(self, x: torch.Tensor) -> torch.Tensor:
        if self.group == 1:
            return x
        sk, h, d = x.shape
        out = torch.empty(sk, h // self.group, d, dtype=x.dtype)
        return torch.sum(x.reshape(sk, h // self.group, self.group, d), dim=2, out=out)


class FlashDouble:
    """The two ops, as functions with the schemas' parameters (``float32``: take fp32 inputs too)."""

    def __init__(self, float32: bool = False) -> None:
        self.float32 = float32

    def _check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> None:
        if dropout_p > 0:
            raise NotImplementedError("the torch flash double does not model dropout")
        _check(q.dtype in _HALF or (self.float32 and q.dtype == torch.float32),
               "FlashAttention only support fp16 and bf16 data type")
        _check(k.dtype == q.dtype, "query and key must have the same dtype")
        _check(v.dtype == q.dtype, "query and value must have the same dtype")
        for x in (q, k, v):
            _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        d = q.shape[-1]
        _check(d % 8 == 0, "head_size must be a multiple of 8, this is ensured by padding!")
        _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query")
        _check(k.shape == v.shape and k.shape[-1] == d, f"k, v must match q's head size; got {tuple(k.shape)}, {tuple(v.shape)}")

    def _segments(self, q: torch.Tensor, k: torch.Tensor, cu_q: torch.Tensor | None, cu_k: torch.Tensor | None,
                  max_k: int) -> list[tuple[int, slice, slice]]:
        """(batch, rows, keys) of each segment (varlen: batch 0 of the 3-D tensors)."""
        if cu_q is None:
            return [(j, slice(0, q.shape[1]), slice(0, k.shape[1])) for j in range(q.shape[0])]
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
            _check(cu.is_contiguous(), f"{name} must be contiguous")
        _check(cu_q.shape == cu_k.shape, "cu_seqlens_k must have shape (batch_size + 1)")
        bq, bk = cu_q.tolist(), cu_k.tolist()
        _check(bq[-1] <= q.shape[0] and bk[-1] <= k.shape[0], "segments past the packed tensors")
        return [(0, slice(a, b), slice(c, d)) for a, b, c, d in zip(bq, bq[1:], bk, bk[1:])]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cum_seq_q: torch.Tensor | None,
                cum_seq_k: torch.Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                return_debug_mask: bool, *, scale: float | None = None, window_size_left: int | None = None,
                window_size_right: int | None = None, seqused_k: torch.Tensor | None = None,
                alibi_slopes: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                num_splits: int | None = None) -> tuple[torch.Tensor, ...]:
        self._check_inputs(query, key, value, dropout_p)
        if seqused_k is not None or alibi_slopes is not None or block_table is not None:
            raise NotImplementedError("the torch flash double does not model seqused_k, ALiBi or paged KV")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        varlen = cum_seq_q is not None
        if varlen:
            _check(query.dim() == 3, "varlen q must be [total_q, heads, head_dim]")
            causal = is_causal and max_q != 1
            left, right = _normalised(window_size_left, window_size_right, causal, max_k)
            if max_q == 1 and query.shape[1] > key.shape[1] and left < 0 and right < 0:
                _check(query.shape[0] == cum_seq_q.numel() - 1,  # the ngroups-swapped reshape
                       f"shape '[{cum_seq_q.numel() - 1}, ...]' is invalid for input of size {query.numel()}")
            out = torch.zeros(query.shape, dtype=query.dtype)
            lse = torch.full((query.shape[1], query.shape[0]), math.inf)
        else:
            causal = is_causal and query.shape[1] != 1
            left, right = _normalised(window_size_left, window_size_right, causal, key.shape[1])
            out = torch.zeros(query.shape, dtype=query.dtype)
            lse = torch.full((query.shape[0], query.shape[2], query.shape[1]), math.inf)
        for j, rows, keys in self._segments(query, key, cum_seq_q, cum_seq_k, max_k):
            qs, ks, vs = (query[rows], key[keys], value[keys]) if varlen else (query[j, rows], key[j, keys], value[j, keys])
            if qs.shape[0] == 0:
                continue
            seg_out, seg_lse = _Segment(qs, ks, vs, scale, left, right).forward(query.dtype) if ks.shape[0] else (
                torch.zeros(qs.shape, dtype=query.dtype), torch.full((qs.shape[1], qs.shape[0]), math.inf))
            if varlen:
                out[rows], lse[:, rows] = seg_out, seg_lse
            else:
                out[j], lse[j] = seg_out, seg_lse
        rng = torch.zeros(2, dtype=torch.int64)
        return out, lse, rng, torch.empty((), dtype=torch.int64), torch.empty(0, dtype=query.dtype)

    def backward(self, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, logsumexp: torch.Tensor, cum_seq_q: torch.Tensor | None,
                 cum_seq_k: torch.Tensor | None, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                 rng_state: torch.Tensor, unused: torch.Tensor, *, scale: float | None = None,
                 window_size_left: int | None = None,
                 window_size_right: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self._check_inputs(query, key, value, dropout_p)
        _check(out.dtype == query.dtype and grad_out.dtype == query.dtype, "query and out/dout must have the same dtype")
        _check(out.shape == query.shape and grad_out.shape == query.shape, "out and dout must have q's shape")
        _check(logsumexp.dtype == torch.float32, f"softmax_lse is read as float32; got {logsumexp.dtype}")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        varlen = cum_seq_q is not None
        keys_total = max_k if varlen else key.shape[1]
        left, right = _normalised(window_size_left, window_size_right, is_causal, keys_total)
        dq, dk, dv = (torch.zeros(x.shape, dtype=x.dtype) for x in (query, key, value))
        # the kernel reads lse from its data pointer as a dense buffer (neither shape nor strides are checked)
        if varlen:
            h, total = query.shape[1], query.shape[0]
            dense = torch.as_strided(logsumexp, (h, total), (total, 1), logsumexp.storage_offset())
        else:
            b, sq, h = query.shape[:3]
            dense = torch.as_strided(logsumexp, (b, h, sq), (h * sq, sq, 1), logsumexp.storage_offset())
        for j, rows, keys in self._segments(query, key, cum_seq_q, cum_seq_k, max_k):
            pick = (lambda x, s: x[s]) if varlen else (lambda x, s, j=j: x[j, s])  # noqa: E731
            qs, ks = pick(query, rows), pick(key, keys)
            if qs.shape[0] == 0 or ks.shape[0] == 0:
                continue  # zeros: rows without keys, keys without rows
            seg_lse = dense[:, rows] if varlen else dense[j][:, rows]
            grads = _Segment(qs, ks, pick(value, keys), scale, left, right).backward(
                pick(grad_out, rows), pick(out, rows), seg_lse, query.dtype)
            for buffer, grad, span in zip((dq, dk, dv), grads, (rows, keys, keys)):
                if varlen:
                    buffer[span] = grad
                else:
                    buffer[j, span] = grad
        return dq, dk, dv


@contextlib.contextmanager
def installed(float32: bool = False) -> Iterator[FlashDouble]:
    """The double in place of torch's CUDA flash ops for ring_sp's ``torch`` backend, and CPU
    tensors of the flash dtypes (fp32 too with ``float32``) routed to the CUDA kernel
    (``TorchCUDAKernel(flash=True)``); everything restored on exit. Works in any process."""
    import ring_sp.kernels as kernels
    from ring_sp.kernels import torch_cuda

    double = FlashDouble(float32)
    saved_ops, saved_kernel = torch_cuda._flash_ops, kernels._torch_kernel
    dtypes = _HALF + ((torch.float32,) if float32 else ())

    def torch_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, value_head_dim: int) -> Any:
        if device.type == "cpu" and dtype in dtypes and head_dim == value_head_dim:
            return torch_cuda.TorchCUDAKernel(flash=True)
        return saved_kernel(device, dtype, head_dim, value_head_dim)

    torch_cuda._flash_ops = lambda: (double.forward, double.backward)
    kernels._torch_kernel = torch_kernel
    try:
        yield double
    finally:
        torch_cuda._flash_ops, kernels._torch_kernel = saved_ops, saved_kernel


def run_installed(float32: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with the double installed (a pool case function)."""
    with installed(float32):
        return fn(*args, **kwargs)
