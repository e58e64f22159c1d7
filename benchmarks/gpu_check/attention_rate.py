"""The attention rate: each backend's single causal call against cuDNN SDPA's own rate.

At ``rate_tokens`` (32K: Llama-3-8B's attention, 32 q / 8 kv heads x 128, bf16), every fused
backend of ring_sp that runs here (:func:`available_backends`: every name of
``ring_sp.kernels.BACKENDS`` but ``auto`` and ``reference`` whose ``unavailable_reason`` is
None, so a backend joins as soon as ring_sp has it) runs one causal forward (out + lse) and
one backward through ring_sp's kernel object, against
``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`` on the
same tensors (``[b, h, s, d]`` storage, its native layout; GQA through ``enable_gqa``, or
with the KV heads repeated before the timing where cuDNN refuses it: the record says
which). FLOPs: ``4 pairs d h`` forward and 2.5 times that backward (five matmuls to two),
``pairs = N (N + 1) / 2``. Ratios are the reference's time over the backend's (target
>= 0.8). The table records the order ``auto`` must follow: which backend ``auto`` picked and
whether it was the fastest measured (forward + backward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ring_sp.kernels import BACKENDS, get_kernel, unavailable_reason

from ..tables import table
from .seam import Seam

Record = dict[str, Any]
NOT_FUSED = ("auto", "reference")  # a choice and the float64 oracle, not kernels to rate
BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's
RATE_TARGET = 0.8  # of the reference's rate, forward and backward


def available_backends(device: torch.device, dtype: torch.dtype, head_dim: int,
                       names: Sequence[str] = BACKENDS) -> tuple[list[str], dict[str, str]]:
    """(ring_sp's fused backends that run here, ``{backend: why not}`` for the others). A name
    ``unavailable_reason`` does not know is skipped with its error."""
    ok, why = [], {}
    for name in names:
        if name in NOT_FUSED:
            continue
        try:
            reason = unavailable_reason(name, device, dtype, head_dim)
        except ValueError as exc:  # not a backend of this ring_sp
            reason = str(exc)
        if reason is None:
            ok.append(name)
        else:
            why[name] = reason
    return ok, why


def forward_flops(seq_len: int, heads: int, head_dim: int) -> float:
    """FLOPs of one causal forward over ``seq_len`` tokens (two matmuls over the causal pairs)."""
    return 4.0 * seq_len * (seq_len + 1) / 2 * head_dim * heads


class _Inputs:
    """q ``[1, N, h, d]``, k / v ``[1, N, h_kv, d]`` and an output gradient, seeded."""

    def __init__(self, seam: Seam, seq_len: int, heads: int, kv_heads: int, head_dim: int) -> None:
        g = torch.Generator(device=seam.device).manual_seed(seq_len)
        make = lambda h: torch.randn((1, seq_len, h, head_dim), generator=g, device=seam.device,  # noqa: E731
                                     dtype=seam.dtype)
        self.q, self.k, self.v, self.dout = make(heads), make(kv_heads), make(kv_heads), make(heads)
        self.scale = head_dim ** -0.5


def _sdpa_rate(seam: Seam, x: _Inputs, repeats: int) -> tuple[Record, torch.Tensor | None]:
    """The reference's record (times, how GQA ran) and its output ``[1, N, h, d]``."""
    backend, name = seam.sdpa_reference()
    heads, kv_heads = x.q.shape[2], x.k.shape[2]
    record: Record = {"backend": name, "reference": True}
    errors = []
    for native_gqa in (True, False):
        # [b, h, s, d] storage, outside the timing; without native GQA the KV heads repeated first
        kv = [t if native_gqa else t.repeat_interleave(heads // kv_heads, dim=2) for t in (x.k, x.v)]
        q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (x.q, *kv, x.dout))
        for t in (q, k, v):
            t.requires_grad_()
        try:
            with sdpa_kernel(backend):
                def forward() -> torch.Tensor:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=x.scale,
                                                          enable_gqa=native_gqa)

                out = forward()
                torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # warm-up: plans built per shape
                record["forward_s"] = seam.median_time(forward, repeats, warmup=0)[0]
                record["backward_s"] = seam.median_time(
                    lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), repeats, warmup=0)[0]
        except RuntimeError as exc:  # this backend refuses the call (no kernel for these inputs)
            errors.append(f"{'enable_gqa' if native_gqa else 'KV heads repeated'}: {str(exc).splitlines()[0][:200]}")
            continue
        record["gqa"] = "native (enable_gqa=True)" if native_gqa else "KV heads repeated before the call, untimed"
        return record, out.detach().transpose(1, 2)
    record["error"] = "; ".join(errors)
    return record, None


def attention_rate(seam: Seam, seq_len: int, heads: int, kv_heads: int, head_dim: int, backends: Sequence[str],
                   unavailable: dict[str, str], repeats: int, log: Callable[[str], None]) -> Iterator[Record]:
    """One record per backend (and the reference, and each unavailable backend with its
    reason), then the ``auto`` record: the pick, the fastest measured, the measured order."""
    base: Record = {"section": "attention_rate", "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads,
                    "head_dim": head_dim, "dtype": str(seam.dtype).removeprefix("torch.")}
    fwd_flops = forward_flops(seq_len, heads, head_dim)
    x = _Inputs(seam, seq_len, heads, kv_heads, head_dim)
    log(f"attention rate: one causal call at N={seq_len:,}, {', '.join(backends)} against {seam.sdpa_reference()[1]}")
    reference, want = _sdpa_rate(seam, x, repeats)
    if "error" not in reference:
        reference.update(forward_tflops=fwd_flops / reference["forward_s"] / 1e12,
                         backward_tflops=BACKWARD_FLOPS * fwd_flops / reference["backward_s"] / 1e12)
    yield {**base, **reference}
    auto = get_kernel("auto", seam.device, seam.dtype, head_dim).name
    measured: dict[str, float] = {}
    for name in backends:
        kernel = get_kernel(name, seam.device, seam.dtype, head_dim)
        out, lse = kernel.forward(x.q, x.k, x.v, causal=True, scale=x.scale)  # warm-up, and the output to check
        kernel.backward(x.dout, x.q, x.k, x.v, out, lse, causal=True, scale=x.scale)
        fwd = seam.median_time(lambda: kernel.forward(x.q, x.k, x.v, causal=True, scale=x.scale), repeats, 0)[0]
        bwd = seam.median_time(lambda: kernel.backward(x.dout, x.q, x.k, x.v, out, lse, causal=True, scale=x.scale),
                               repeats, 0)[0]
        r: Record = {**base, "backend": name, "auto": name == auto, "forward_s": fwd, "backward_s": bwd,
                     "forward_tflops": fwd_flops / fwd / 1e12,
                     "backward_tflops": BACKWARD_FLOPS * fwd_flops / bwd / 1e12,
                     "max_abs_diff": None if want is None else (out.float() - want.float()).abs().max().item()}
        if "error" not in reference:
            r.update(forward_ratio=reference["forward_s"] / fwd, backward_ratio=reference["backward_s"] / bwd)
        measured[name] = fwd + bwd
        yield r
        del out, lse
    for name, reason in unavailable.items():
        yield {**base, "backend": name, "skipped": reason}
    order = sorted(measured, key=measured.get)  # type: ignore[arg-type]
    log(f"attention rate: auto picks {auto}; measured order (forward + backward) {' > '.join(order) or 'none'}")
    yield {**base, "backend": "auto", "auto_backend": auto, "measured_order": order,
           "fastest": order[0] if order else None, "auto_is_fastest": bool(order) and order[0] == auto}


def markdown(records: list[Record]) -> list[str]:
    rows = [r for r in records if r["section"] == "attention_rate"]
    if not rows:
        return []
    body = []
    for r in rows:
        if "auto_backend" in r:
            continue
        if "skipped" in r or "error" in r:
            body.append([f"`{r['backend']}`", r.get("skipped") or r["error"], "", "", "", "", "", ""])
            continue
        ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
        ratio = lambda key: f"**{r[key]:.2f}**" if key in r else "-"  # noqa: E731
        diff = r.get("max_abs_diff")
        name = r["backend"] if r.get("reference") else f"`{r['backend']}`" + (" (auto)" if r.get("auto") else "")
        body.append([name, ms(r["forward_s"]), f"{r['forward_tflops']:.3g}", ratio("forward_ratio"),
                     ms(r["backward_s"]), f"{r['backward_tflops']:.3g}", ratio("backward_ratio"),
                     "-" if diff is None or math.isnan(diff) else f"{diff:.1e}"])
    first = rows[0]
    reference = next((r for r in rows if r.get("reference")), {})
    out = [f"One causal call at N={first['seq_len']:,} ({first['heads']} q / {first['kv_heads']} kv heads x "
           f"{first['head_dim']}, {first['dtype']}) through ring_sp's kernel object, forward (out + lse) and backward, "
           f"against {reference.get('backend', 'the reference')} on the same tensors "
           f"(GQA: {reference.get('gqa', '-')}). Ratio = the reference's time / the backend's (target >= 0.8); "
           "TFLOP/s: 4 pairs d h forward, 2.5x that backward.", ""]
    out += table(["backend", "fwd ms", "fwd TFLOP/s", "fwd ratio", "bwd ms", "bwd TFLOP/s", "bwd ratio",
                  "max abs diff vs reference"], body)
    for r in rows:
        if "auto_backend" in r:
            verdict = "the fastest measured" if r["auto_is_fastest"] else f"**not** the fastest (`{r['fastest']}` is)"
            out += ["", f"`auto` picks `{r['auto_backend']}`: {verdict}; measured order (forward + backward): "
                    + (" > ".join(f"`{n}`" for n in r["measured_order"]) or "none measured") + "."]
    return out


def targets(records: list[Record]) -> list[list[str]]:
    """(target, measured, verdict) rows: ``auto``'s backend against the reference, forward and
    backward, and whether ``auto`` picked the fastest measured backend."""
    rates = [r for r in records if r["section"] == "attention_rate"]
    auto = next((r for r in rates if "auto_backend" in r), None)
    if auto is None:
        return []
    verdict = {True: "met", False: "**not met**"}
    reference = next((r for r in rates if r.get("reference")), {})
    mine = next((r for r in rates if r["backend"] == auto["auto_backend"] and "forward_s" in r
                 and not r.get("reference")), {})
    rows = []
    for d in ("forward", "backward"):
        name = (f"attention rate of `auto` (`{auto['auto_backend']}`) >= {RATE_TARGET} of "
                f"{reference.get('backend', 'the reference')}'s, {d}, N={auto['seq_len']:,} causal")
        if f"{d}_ratio" not in mine:
            rows.append([name, reference.get("error", "not measured"), "unmeasured"])
            continue
        rows.append([name, f"{mine[f'{d}_tflops']:.3g} / {reference[f'{d}_tflops']:.3g} TFLOP/s = "
                     f"{mine[f'{d}_ratio']:.2f}", verdict[mine[f"{d}_ratio"] >= RATE_TARGET]])
    order = " > ".join(f"`{n}`" for n in auto["measured_order"]) or "none measured"
    rows.append(["`auto` picks the fastest measured backend (forward + backward)",
                 f"picks `{auto['auto_backend']}`; measured {order}", verdict[auto["auto_is_fastest"]]])
    return rows
