"""A CPU double of flash-attn 2.x's low-level entry points, one per signature ring_sp supports.

flash-attn cannot be built without CUDA, so the ``flash_attn`` backend of ring_sp never ran
here. This module computes what ``_flash_attn_forward`` / ``_flash_attn_backward`` compute, in
float32 from the definitions (no ring_sp code: it is a reference, not a second kernel), behind
the exact Python signatures and return tuples of each release, and :func:`installed` puts it
where ``from flash_attn import flash_attn_interface`` finds it.

What it reproduces, read from Dao-AILab/flash-attention (flash_attn/flash_attn_interface.py,
csrc/flash_attn/flash_api.cpp, csrc/flash_attn/src/{softmax,mask,alibi}.h) at each tag:

* signatures (``RELEASES``): 2.0-2.2 ``fwd(q, k, v, dropout_p, softmax_scale, causal,
  return_softmax)``; 2.3 adds ``window_size`` (a pair) after ``causal``; 2.4.0 ``alibi_slopes``;
  2.4.1 the backward's ``deterministic``; 2.6 ``softcap``; 2.7 (to 2.8.3) splits the window into
  ``window_size_left/right`` and registers both as ``torch.library.custom_op`` (CPU here, CUDA
  upstream). Forward returns ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``
  before 2.7, ``(out, softmax_lse, S_dmask, rng_state)`` from 2.7; the backward writes into the
  ``dq, dk, dv`` it is given and returns ``(dq, dk, dv, softmax_d)`` before 2.7, ``softmax_d`` from
  2.7.
* the causal mask: top-left (query i sees keys j <= i) in 2.0.x, bottom-right (j <= i + sk - sq)
  from 2.1 (commit 9e5e8bc9); windows (2.3+): j in [i + sk - sq - left, i + sk - sq + right],
  -1 = unbounded, ``causal`` forces right = 0, a side >= sk counts as unbounded.
* ``softmax_lse``: float32 ``[b, h, sq]``, dense; a row that sees no key gets lse = +inf (not
  -inf: softmax.h's ``sum == 0 ? INFINITY``) and out 0. The backward reads ``softmax_lse`` as a
  dense ``[b, h, sq]`` float32 buffer from its data pointer (it checks neither shape nor strides),
  and treats lse = -inf as 0 (``scale_apply_exp2``'s ``max == -INFINITY ? 0``).
* precision: out, dq in the input dtype (one rounding of the fp32 accumulators); with GQA the
  backward writes dk/dv per query head in the input dtype and sums the group into ``dk``/``dv``
  with ``at::sum_out`` (so each head's share is rounded before the sum), as mha_bwd does. D (the
  backward's rowsum(dout * out)) comes from the ``out`` and ``dout`` it is given.
* checks that raise (as flash-attn's TORCH_CHECKs do): fp16/bf16 only, equal dtypes, last dim
  contiguous, shapes, heads divisible, head_dim <= 256 (forward pads to a multiple of 8 before
  2.7 and refuses otherwise from 2.7; the backward always needs a multiple of 8), return_softmax
  only with dropout, softcap without dropout, fp32 alibi slopes of shape (h) or (b, h).
* softcap (2.6+): score = softcap * tanh(scale * q.k / softcap); alibi (2.4+): + slope * j when
  the mask is causal, else - slope * |i + sk - sq - j| (added after the softcap).

Not modelled: dropout (its Philox stream; dropout_p > 0 raises NotImplementedError), the
varlen / kvcache entry points (ring_sp never calls them: packed documents reach the kernel as
dense blocks cut by the schedule), and the kernels' own bf16 rounding of P and dS inside
the GEMMs (the double is slightly more accurate than the real kernel, never less).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Optional

import torch

# release -> the first version with that signature; the value is what __version__ reports.
RELEASES = {"2.0": "2.0.9", "2.1": "2.2.5", "2.3": "2.3.6", "2.4.0": "2.4.0", "2.4.1": "2.5.9", "2.6": "2.6.3",
            "2.7": "2.8.3"}
_HALF = (torch.float16, torch.bfloat16)


def _check(condition: bool, message: str) -> None:
    """flash-attn's TORCH_CHECK (a RuntimeError)."""
    if not condition:
        raise RuntimeError(message)


def _maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    """flash_attn_interface.maybe_contiguous: copy only if the last dimension is strided."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _pad8(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % 8)) if x.shape[-1] % 8 else x


def _normalise(sq: int, sk: int, causal: bool, left: int, right: int, alibi: bool,
               top_left: bool) -> tuple[bool, int, int]:
    """mha_fwd/mha_bwd's window arithmetic -> (is_causal, left, right), -1 = unbounded."""
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    if sq == 1 and not alibi and not top_left:
        causal = False  # "causal=true is the same as causal=false in this case" (bottom-right only)
    if causal:
        right = 0
    return left < 0 and right == 0, left, right


def _visible(sq: int, sk: int, left: int, right: int, top_left: bool) -> torch.Tensor:
    """[sq, sk] True where query i may see key j."""
    i, j = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
    diag = i if top_left else i + sk - sq  # the key position query i sits at
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= j >= diag - left
    return visible


class _Problem:
    """The scores of one call in float32 ``[b, h, sq, sk]`` (GQA heads expanded), from the
    definition, plus what the backward needs."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, left: int,
                 right: int, softcap: float, alibi_slopes: torch.Tensor | None, top_left: bool) -> None:
        b, sq, h, _ = q.shape
        sk, h_kv = k.shape[1], k.shape[2]
        self.group = h // h_kv
        self.q, self.k, self.v = q.float(), k.float().repeat_interleave(self.group, 2), v.float().repeat_interleave(self.group, 2)
        is_causal, left, right = _normalise(sq, sk, causal, left, right, alibi_slopes is not None, top_left)
        raw = torch.einsum("bqhd,bkhd->bhqk", self.q, self.k) * scale
        self.tanh = torch.tanh(raw / softcap) if softcap > 0 else None
        s = softcap * self.tanh if self.tanh is not None else raw
        if alibi_slopes is not None:
            i, j = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
            bias = j.float().expand(sq, sk) if is_causal else -(i + sk - sq - j).abs().float()
            slopes = alibi_slopes.float().reshape(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1)
            s = s + slopes * bias
        self.scores = s.masked_fill(~_visible(sq, sk, left, right, top_left), -math.inf)
        self.scale = scale

    def forward(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(self.scores, dim=-1)
        empty = torch.isneginf(lse)
        p = torch.exp(self.scores - lse.masked_fill(empty, 0).unsqueeze(-1))
        out = torch.einsum("bhqk,bkhd->bqhd", p, self.v).to(dtype)
        return out, lse.masked_fill(empty, math.inf)  # softmax.h: a row with no key gets +inf

    def backward(self, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """fp32 (dq, dk, dv per query head, D) from the GIVEN out and lse ``[b, h, sq]``."""
        lse = lse.masked_fill(torch.isneginf(lse), 0)  # scale_apply_exp2: max == -inf -> 0
        p = torch.exp(self.scores - lse.unsqueeze(-1))
        do = dout.float()
        d = (do * out.float()).sum(-1).transpose(1, 2)  # [b, h, sq]
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        ds = p * (torch.einsum("bqhd,bkhd->bhqk", do, self.v) - d.unsqueeze(-1))
        if self.tanh is not None:
            ds = ds * (1 - self.tanh.square())
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, self.k) * self.scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, self.q) * self.scale
        return dq, dk, dv, d


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: str = "q k v") -> None:
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for name, x in zip(names.split(), (q, k, v)):
        _check(x.stride(-1) == 1, f"{name}: Input tensor must have contiguous last dimension")
    b, sq, h, d = q.shape
    _check(b > 0, "batch size must be positive")
    _check(d <= 256, "FlashAttention only supports head dimension at most 256")
    _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")
    _check(k.shape == (b, k.shape[1], k.shape[2], d) and v.shape == k.shape,
           f"k, v must have shape (batch_size, seqlen_k, num_heads_k, head_size); got {tuple(k.shape)}, {tuple(v.shape)}")


def _check_extras(q: torch.Tensor, dropout_p: float, softcap: float, alibi_slopes: torch.Tensor | None) -> None:
    if dropout_p > 0:
        raise NotImplementedError("the flash-attn double does not model dropout (its Philox random stream)")
    if alibi_slopes is not None:
        _check(alibi_slopes.dtype == torch.float32, "ALiBi slopes must have dtype fp32")
        _check(alibi_slopes.stride(-1) == 1, "ALiBi slopes tensor must have contiguous last dimension")
        _check(tuple(alibi_slopes.shape) in ((q.shape[2],), (q.shape[0], q.shape[2])),
               "ALiBi slopes must have shape (num_heads) or (batch_size, num_heads)")


def _forward(release: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
             causal: bool, window: tuple[int, int], softcap: float, alibi_slopes: torch.Tensor | None,
             return_softmax: bool) -> tuple[Any, ...]:
    """mha_fwd of ``release`` (after the Python wrapper's maybe_contiguous)."""
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    _check_inputs(q, k, v)
    _check_extras(q, dropout_p, softcap, alibi_slopes)
    _check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    if release == "2.7":
        _check(q.shape[3] % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    problem = _Problem(q, k, v, softmax_scale, causal, *window, softcap, alibi_slopes, top_left=release == "2.0")
    out, lse = problem.forward(q.dtype)
    rng_state = torch.zeros(2, dtype=torch.int64)
    if release == "2.7":
        return out, lse, torch.empty(0, dtype=q.dtype), rng_state
    # before 2.7 the C++ padded head_dim to a multiple of 8 itself and returned the padded tensors
    return out, _pad8(q), _pad8(k), _pad8(v), _pad8(out), lse, None, rng_state


def _grad_buffer(given: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    """mha_bwd's dq_/dk_/dv_: checked if given, else allocated like the input."""
    if given is None:
        return torch.empty_like(like)
    _check(given.dtype == like.dtype, f"{name} must have the same dtype as q")
    _check(given.stride(-1) == 1, f"{name} must have contiguous last dimension")
    _check(given.shape == like.shape, f"{name} must have shape {tuple(like.shape)}; got {tuple(given.shape)}")
    return given


def _dense_lse(softmax_lse: torch.Tensor, b: int, h: int, sq: int) -> torch.Tensor:
    """What the kernel reads: ``b*h*sq`` float32 values from the data pointer, row-major (it
    indexes ``(bidb * h + bidh) * seqlen_q + row``; neither shape nor strides are checked)."""
    _check(softmax_lse.dtype == torch.float32,
           f"softmax_lse is read as float32; got {softmax_lse.dtype} (flash-attn would misread the bytes)")
    return torch.as_strided(softmax_lse, (b, h, sq), (h * sq, sq, 1), softmax_lse.storage_offset())


def _backward(release: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              softmax_lse: torch.Tensor, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None,
              dropout_p: float, softmax_scale: float, causal: bool, window: tuple[int, int], softcap: float,
              alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """mha_bwd of ``release``: writes dq, dk, dv (in place when given); returns them and softmax_d."""
    dout, q, k, v, out = (_maybe_contiguous(x) for x in (dout, q, k, v, out))
    _check_inputs(q, k, v)
    _check(out.dtype == q.dtype, "query and out must have the same dtype")
    _check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    _check(q.shape[3] % 8 == 0, "head_size should be a multiple of 8")
    _check(out.shape == q.shape and dout.shape == q.shape,
           f"out and dout must have q's shape {tuple(q.shape)}; got {tuple(out.shape)}, {tuple(dout.shape)}")
    _check_extras(q, dropout_p, softcap, alibi_slopes)
    dq, dk, dv = (_grad_buffer(g, x, n) for g, x, n in ((dq, q, "dq"), (dk, k, "dk"), (dv, v, "dv")))
    b, sq, h, d = q.shape
    problem = _Problem(q, k, v, softmax_scale, causal, *window, softcap, alibi_slopes, top_left=release == "2.0")
    dq32, dk32, dv32, delta = problem.backward(dout, out, _dense_lse(softmax_lse, b, h, sq))
    dq.copy_(dq32)
    for buffer, grad in ((dk, dk32), (dv, dv32)):
        if problem.group == 1:
            buffer.copy_(grad)
        else:  # dk_expanded in the input dtype, then at::sum_out over each KV head's group
            expanded = grad.to(q.dtype).reshape(b, k.shape[1], k.shape[2], problem.group, d)
            torch.sum(expanded, dim=3, out=buffer)
    softmax_d = torch.zeros(b, h, -(-sq // 128) * 128)  # [b, h, seqlen_q_rounded]
    softmax_d[:, :, :sq] = delta
    return dq, dk, dv, softmax_d


# ---- the entry points, with each release's exact parameters ----------------------------------

def _v20(release: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """2.0-2.2: no window, alibi, softcap or deterministic."""

    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
        return _forward(release, q, k, v, dropout_p, softmax_scale, causal, (-1, -1), 0.0, None, return_softmax)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             rng_state=None):
        return _backward(release, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         (-1, -1), 0.0, None)

    return _flash_attn_forward, _flash_attn_backward


def _v23() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, return_softmax):
        return _forward("2.3", q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), 0.0, None, return_softmax)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, rng_state=None):
        return _backward("2.3", dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         tuple(window_size), 0.0, None)

    return _flash_attn_forward, _flash_attn_backward


def _v240() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        return _forward("2.4.0", q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), 0.0, alibi_slopes,
                        return_softmax)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, rng_state=None):
        return _backward("2.4.0", dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         tuple(window_size), 0.0, alibi_slopes)

    return _flash_attn_forward, _flash_attn_backward


def _v241() -> tuple[Callable[..., Any], Callable[..., Any]]:
    forward, _ = _v240()

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, rng_state=None):
        return _backward("2.4.1", dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         tuple(window_size), 0.0, alibi_slopes)

    return forward, _flash_attn_backward


def _v26() -> tuple[Callable[..., Any], Callable[..., Any]]:
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        return _forward("2.6", q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap, alibi_slopes,
                        return_softmax)

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        return _backward("2.6", dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         tuple(window_size), softcap, alibi_slopes)

    return _flash_attn_forward, _flash_attn_backward


# 2.7+: upstream wraps these in torch.library.custom_op on torch >= 2.4 (plain functions before);
# the custom ops are made on first use: their first call imports torch._dynamo (seconds), which
# the pool ranks skip by taking the plain form (custom_op=False).
def _fa27_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward("2.7", q, k, v, dropout_p, softmax_scale, causal, (window_size_left, window_size_right), softcap,
                    alibi_slopes, return_softmax)


def _fa27_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], dv: Optional[torch.Tensor],
    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
    softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool, rng_state: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return _backward("2.7", dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     (window_size_left, window_size_right), softcap, alibi_slopes)[3]


@functools.lru_cache(maxsize=None)
def _v27_custom_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The 2.7 entry points as torch.library.custom_op (device "cpu" here, "cuda" upstream), once per process."""
    forward = torch.library.custom_op("ring_sp_fa_double::_flash_attn_forward", mutates_args=(),
                                      device_types="cpu")(_fa27_forward)
    backward = torch.library.custom_op("ring_sp_fa_double::_flash_attn_backward", mutates_args=("dq", "dk", "dv"),
                                       device_types="cpu")(_fa27_backward)
    return forward, backward


_ENTRY_POINTS: dict[str, Callable[[], tuple[Callable[..., Any], Callable[..., Any]]]] = {
    "2.0": lambda: _v20("2.0"), "2.1": lambda: _v20("2.1"), "2.3": _v23, "2.4.0": _v240, "2.4.1": _v241, "2.6": _v26,
    "2.7": _v27_custom_ops,
}


def interface(release: str, custom_op: bool = True) -> ModuleType:
    """A ``flash_attn.flash_attn_interface`` module of ``release`` (a key of ``RELEASES``);
    ``custom_op=False``: 2.7's entry points as the plain functions (upstream on torch < 2.4)."""
    module = ModuleType("flash_attn.flash_attn_interface")
    plain = release == "2.7" and not custom_op
    entry_points = (_fa27_forward, _fa27_backward) if plain else _ENTRY_POINTS[release]()
    module._flash_attn_forward, module._flash_attn_backward = entry_points  # type: ignore[attr-defined]
    return module


def parameters(fn: Callable[..., Any]) -> list[str]:
    """The parameter names of an entry point (custom ops keep the function in ``_init_fn``)."""
    return list(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


@contextlib.contextmanager
def installed(release: str, custom_op: bool = True) -> Iterator[ModuleType]:
    """``flash_attn`` (version ``RELEASES[release]``) importable as the double, and ring_sp's
    hardware gate open for CPU tensors; everything restored on exit. Works in any process
    (the pool ranks install it in their own). ``custom_op``: see :func:`interface`."""
    from ring_sp.kernels import flash_attn as backend

    package = ModuleType("flash_attn")
    package.__path__ = []  # a package, as far as the import system cares
    package.__version__ = RELEASES[release]  # type: ignore[attr-defined]
    package.flash_attn_interface = interface(release, custom_op)  # type: ignore[attr-defined]
    names = {"flash_attn": package, "flash_attn.flash_attn_interface": package.flash_attn_interface}
    saved = {name: sys.modules.get(name) for name in names}
    gate = backend._device_reason
    sys.modules.update(names)
    backend._interface.cache_clear()
    backend._device_reason = lambda device: None  # the only thing faked: the GPU itself
    try:
        yield package.flash_attn_interface
    finally:
        backend._device_reason = gate
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        backend._interface.cache_clear()


def run_installed(release: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with the double of ``release`` installed (a pool case function;
    2.7 as plain functions: the custom ops' signature handling is tested in one process)."""
    with installed(release, custom_op=False):
        return fn(*args, **kwargs)
