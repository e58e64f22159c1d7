"""Plain-PyTorch attention: the test oracle and the backend of last resort.

Materialises the ``[sq, sk]`` score matrix (O(sq * sk) memory), computes in float32
(float64 for float64 inputs) and accepts an arbitrary boolean mask, so tests can state
the mask they expect explicitly instead of trusting a kernel's alignment convention.
"""

from __future__ import annotations

import torch

from ..shapes import softmax_stat_dtype
from .base import check_block_shapes


def causal_mask(seq_q: int, seq_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Top-left aligned causal mask ``[seq_q, seq_k]`` (True = visible): row i sees keys j <= i."""
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()


def _expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, s, h_kv, d] -> [b, s, heads, d]: query head i uses KV head i // (heads / h_kv)."""
    return x.repeat_interleave(heads // x.shape[2], dim=2)


def _reduce_kv_heads(dx: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of ``_expand_kv_heads`` for gradients: sum the query heads of each group."""
    b, s, h, d = dx.shape
    return dx.view(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """[b, h, sq, sk] scaled scores in the compute dtype, masked entries at -inf."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def window_mask(seq: int, causal: bool, window: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Square ``[seq, seq]`` mask of a ``window`` block (True = visible): key c > query a - window,
    and c <= a when ``causal`` (see :mod:`ring_sp.kernels.base`)."""
    return band_mask(seq, seq, causal, window, 0, device)


def band_mask(seq_q: int, seq_k: int, causal: bool, window: int | None, diagonal: int,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """``[seq_q, seq_k]`` mask of the band ``diagonal - window < c - a <= diagonal`` (True =
    visible; the upper side only when ``causal``, the lower only with a ``window``)."""
    offset = torch.arange(seq_k, device=device).unsqueeze(0) - torch.arange(seq_q, device=device).unsqueeze(1)  # c - a
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if causal:
        visible &= offset <= diagonal
    if window is not None:
        visible &= offset > diagonal - window
    return visible


def _visible(causal: bool, mask: torch.Tensor | None, sq: int, sk: int, device: torch.device,
             window: int | None = None, diagonal: int = 0) -> torch.Tensor | None:
    if (causal or window is not None or diagonal) and mask is not None:
        raise ValueError("pass either causal=True / window / diagonal or an explicit mask, not both")
    if window is not None or diagonal:
        return band_mask(sq, sk, causal, window, diagonal, device)
    return causal_mask(sq, sk, device) if causal else mask


class ReferenceKernel:
    """Explicit-math backend (see module docstring). ``mask``: bool, broadcastable to
    ``[b, h, sq, sk]``, True where a key is visible."""

    name = "reference"
    supports_window = True  # any band, by its explicit mask
    supports_varlen = False
    explicit_masks = True  # computes the whole rectangle of a masked block
    head_major = False

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
        window: int | None = None,
        diagonal: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if mask is None:
            check_block_shapes(q, k, v, causal, window, diagonal, bands=True)
        compute = softmax_stat_dtype(q.dtype)
        h = q.shape[2]
        qc, kc, vc = q.to(compute), _expand_kv_heads(k.to(compute), h), _expand_kv_heads(v.to(compute), h)
        s = _scores(qc, kc, scale, _visible(causal, mask, q.shape[1], k.shape[1], q.device, window, diagonal))
        lse = torch.logsumexp(s, dim=-1)  # [b, h, sq]; -inf for rows with no visible key
        p = torch.exp(s - _finite_or_zero(lse).unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, vc)
        return out.to(q.dtype), lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
        window: int | None = None,
        diagonal: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        compute = softmax_stat_dtype(q.dtype)
        h, h_kv = q.shape[2], k.shape[2]
        qc, kc, vc = q.to(compute), _expand_kv_heads(k.to(compute), h), _expand_kv_heads(v.to(compute), h)
        do, oc = dout.to(compute), out.to(compute)
        s = _scores(qc, kc, scale, _visible(causal, mask, q.shape[1], k.shape[1], q.device, window, diagonal))
        p = torch.exp(s - _finite_or_zero(lse.to(compute)).unsqueeze(-1))  # global softmax rows
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vc)
        delta = (do * oc).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # D_i = sum_d dout * out
        ds = p * (dp - delta)
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kc) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, qc) * scale
        return dq.to(q.dtype), _reduce_kv_heads(dk, h_kv).to(k.dtype), _reduce_kv_heads(dv, h_kv).to(v.dtype)


def _finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf rows replaced by 0, so ``exp(-inf - lse)`` is 0 instead of NaN."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)
