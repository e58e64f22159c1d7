"""The independent oracle and the tolerances of ../shared/TESTING.md.

The oracle is plain float64 attention on the full sequence, differentiated by autograd
(not by any ring_sp backward formula), from the SAME dtype-rounded inputs the
distributed path receives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# (out, grads, lse, ratio-rule floor) per dtype; None floor = no ratio rule.
# fp16 (the flash kernels: CUDA, or flash-attn's CPU double): TESTING.md's atol = rtol = 5e-3; lse as bf16's.
OUT_TOL = {torch.float64: Tolerance(1e-10, 1e-8), torch.float32: Tolerance(2e-5, 2e-4), torch.bfloat16: Tolerance(2e-2, 2e-2),
           torch.float16: Tolerance(5e-3, 5e-3)}
GRAD_TOL = {torch.float64: Tolerance(1e-10, 1e-8), torch.float32: Tolerance(1e-4, 1e-3), torch.bfloat16: Tolerance(3.5e-2, 3.5e-2),
            torch.float16: Tolerance(5e-3, 5e-3)}
LSE_ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
# The ratio rule's floor, RELATIVE to the tensor's largest magnitude: one bf16 (fp16)
# rounding step (8 (11) significant bits), 16 fp32 ulps (summation-order noise; measured worst 4.9e-7
# relative over 600 random fp32 cases). An absolute floor cannot work for gradients of
# magnitude ~10, where one bf16 ulp is 0.06, and a tiny problem can make the
# single-device error arbitrarily small by luck.
RATIO_FLOOR = {torch.float32: 2.0**-19, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def visibility_mask(seq_len: int, causal: bool) -> torch.Tensor | None:
    """[N, N] True where query i may see key j (natural order)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool).tril() if causal else None


def oracle_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None = None,
                     mask: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out ``[b, N, h, d_v]``, lse ``[b, h, N]``); GQA by repeat_interleave; autograd-able.
    ``sinks`` ``[h]``: one extra logit per head in every row's softmax, with no value (a
    column of the score matrix whose probabilities are dropped, as gpt-oss writes it)."""
    h = q.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(h // k.shape[2], 2), v.double().repeat_interleave(h // v.shape[2], 2)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = mask if mask is not None else visibility_mask(q.shape[1], causal)
    if visible is not None:
        s = s.masked_fill(~visible.to(s.device), -math.inf)  # a mask built on the CPU serves CUDA inputs too
    if sinks is not None:  # the sink column: in the denominator, then dropped
        s = torch.cat((s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)), dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isneginf(lse), 0).unsqueeze(-1))
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def make_inputs(seed: int, b: int, n: int, h: int, h_kv: int, d: int, dtype: torch.dtype, *,
                d_v: int | None = None, sinks: bool | tuple[float, ...] = False) -> dict[str, torch.Tensor]:
    """Global q, k, v, dout rounded to ``dtype`` (identical on every rank for one seed);
    ``d_v``: v's head size (None = d); ``sinks``: also one logit per head, ``2 * N(0, 1)``
    (True) or these values (a tuple of length h)."""
    g = torch.Generator().manual_seed(seed)
    d_v = d if d_v is None else d_v
    shapes = {"q": (b, n, h, d), "k": (b, n, h_kv, d), "v": (b, n, h_kv, d_v), "dout": (b, n, h, d_v)}
    inputs = {name: torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for name, shape in shapes.items()}
    if sinks is True:
        inputs["sinks"] = (2 * torch.randn(h, generator=g, dtype=torch.float64)).to(dtype)
    elif sinks:
        inputs["sinks"] = torch.tensor(sinks, dtype=torch.float64).to(dtype)
    return inputs


def oracle_results(inputs: dict[str, torch.Tensor], *, causal: bool, scale: float | None = None,
                   mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """float64 out, lse, dq, dk, dv (and dsinks when ``inputs`` has sinks) for ``inputs``
    (a random ``dout``, never ``out.sum()``)."""
    # detach() first: for float64 inputs .double() returns the input itself, and its
    # .grad would then accumulate across calls.
    q, k, v = (inputs[n].detach().double().requires_grad_() for n in ("q", "k", "v"))
    sinks = inputs["sinks"].detach().double().requires_grad_() if "sinks" in inputs else None
    out, lse = oracle_attention(q, k, v, causal=causal, scale=scale, mask=mask, sinks=sinks)
    out.backward(inputs["dout"].double())
    results = {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if sinks is not None:
        results["dsinks"] = sinks.grad
    return results


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> float:
    """Finite and ``|a - e| <= atol + rtol * |e|`` elementwise; returns the max abs error."""
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{name}: {int((~torch.isfinite(actual)).sum())} non-finite values")
    a, e = actual.double(), expected.double()
    excess = (a - e).abs() - (tol.atol + tol.rtol * e.abs())
    if (excess > 0).any():
        worst = int(excess.argmax())
        raise AssertionError(
            f"{name}: max abs error {max_abs_error(a, e):.3e} exceeds atol={tol.atol} rtol={tol.rtol} "
            f"(worst at flat index {worst}: got {a.flatten()[worst].item():.6g}, expected {e.flatten()[worst].item():.6g})"
        )
    return max_abs_error(a, e)


def assert_lse_close(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float) -> float:
    """lse may be -inf where a row sees nothing: -inf must match exactly, finite values within atol."""
    if torch.isnan(actual).any() or torch.isposinf(actual).any():
        raise AssertionError(f"{name}: NaN or +inf in lse")
    if not torch.equal(torch.isneginf(actual), torch.isneginf(expected)):
        raise AssertionError(f"{name}: -inf pattern of lse differs from the oracle")
    finite = torch.isfinite(expected)
    err = max_abs_error(actual[finite], expected[finite]) if finite.any() else 0.0
    if err > atol:
        raise AssertionError(f"{name}: lse max abs error {err:.3e} > {atol}")
    return err
