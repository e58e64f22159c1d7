"""Which matmuls a step ran, on which operand dtypes: the check that a bf16 step has no upcast GEMM.

A bf16 / fp16 model's matmuls belong on its own dtype (tensor cores on a GPU, fp32 accumulation
inside the GEMM); the same matmul on operands upcast to fp32 runs on the GPU's SIMT units, an
order of magnitude slower (the tiled loss's head gradient once took 54% of a step that way).
A CPU run cannot show the time, but it shows the dtypes: :class:`GemmAudit` records every
matmul-family ATen op that runs inside it (after autograd's and the composite ops'
decompositions: ``linear``, ``matmul`` and ``einsum`` arrive as the ``mm`` / ``addmm`` / ``bmm``
they run) with its shapes and operand dtypes::

    with GemmAudit() as audit:
        loss = step(model, batch)
        loss.backward()
    audit.check()  # raises, naming each fp32 GEMM of >= 2**20 multiply-adds

Attention kernels (``_scaled_dot_product_*``, flash-attn) are not matmuls here: they are
recorded by nobody. ``self`` / ``input`` of ``addmm``-style ops is the accumulator, not an
operand: an fp32 accumulator fed by bf16 operands is the point, not a defect. A product over
``k = 1`` (an outer product written as a matmul, as transformers' RoPE makes its fp32 angles
``inv_freq @ positions``) sums nothing and has nothing to lose on tensor cores: recorded, never
refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

UPCAST_MIN_MULTIPLY_ADDS = 2**20
"""The smallest fp32 GEMM :meth:`GemmAudit.check` refuses: smaller ones (a norm's reduction, a
rotary table) cost nothing next to the step's real GEMMs."""

WIDE_DTYPES = (torch.float32, torch.float64)
"""Operand dtypes that, in a bf16 / fp16 step, mean a GEMM off the tensor cores."""


def _matrix_operands(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The two multiplied tensors of a matmul-family op's positional args."""
    return args[0], args[1]


def _accumulating_operands(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``addmm(self, mat1, mat2)``-style ops: ``self`` is the accumulator, the operands come after."""
    return args[1], args[2]


# op packet -> how to find its two operands; a packet holds every overload (default, out, dtype, dtype_out),
# the in-place variants are packets of their own
_OPERANDS = {
    aten.mm: _matrix_operands, aten.bmm: _matrix_operands, aten.mv: _matrix_operands, aten.dot: _matrix_operands,
    aten.vdot: _matrix_operands, aten._scaled_mm: _matrix_operands, aten._int_mm: _matrix_operands,
    aten.addmm: _accumulating_operands, aten.baddbmm: _accumulating_operands, aten.addbmm: _accumulating_operands,
    aten._addmm_activation: _accumulating_operands, aten.addmv: _accumulating_operands,
    aten.addmm_: _accumulating_operands, aten.baddbmm_: _accumulating_operands, aten.addbmm_: _accumulating_operands,
    aten.addmv_: _accumulating_operands,
}
for _name in ("_grouped_mm", "_scaled_grouped_mm"):  # newer torch releases only
    if hasattr(aten, _name):
        _OPERANDS[getattr(aten, _name)] = _matrix_operands


@dataclass(frozen=True)
class GemmCall:
    """One matmul-family op: its name, operand shapes and dtypes, its multiply-adds
    (``batch * m * n * k``; a matrix-vector product has ``n = 1``, a dot product ``m = n = 1``)
    and ``k``, the length of each sum."""

    op: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    dtypes: tuple[torch.dtype, torch.dtype]
    multiply_adds: int
    k: int

    @property
    def wide(self) -> bool:
        """Whether an operand is fp32 / fp64 (see :data:`WIDE_DTYPES`)."""
        return any(d in WIDE_DTYPES for d in self.dtypes)

    def __str__(self) -> str:
        dtypes = " x ".join(str(d).removeprefix("torch.") for d in self.dtypes)
        return f"{self.op} {list(self.shapes[0])} x {list(self.shapes[1])} ({dtypes}, {self.multiply_adds:,} multiply-adds)"


def _multiply_adds(a: torch.Tensor, b: torch.Tensor) -> int:
    """``batch * m * k * n`` of ``a`` ``[..., m, k]`` (or ``[k]``) times ``b`` ``[..., k, n]`` (or ``[k]``)."""
    return math.prod(a.shape) * (b.shape[-1] if b.dim() >= 2 else 1)


class GemmAudit(TorchDispatchMode):
    """Records every matmul-family op run inside it as a :class:`GemmCall` (``calls``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[GemmCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        operands = _OPERANDS.get(func.overloadpacket)
        if operands is not None:
            a, b = operands(args)
            self.calls.append(GemmCall(func.overloadpacket.__name__, (tuple(a.shape), tuple(b.shape)),
                                       (a.dtype, b.dtype), _multiply_adds(a, b), a.shape[-1]))
        return func(*args, **(kwargs or {}))

    def upcast(self, min_multiply_adds: int = UPCAST_MIN_MULTIPLY_ADDS) -> list[GemmCall]:
        """The recorded GEMMs on fp32 / fp64 operands of at least ``min_multiply_adds`` multiply-adds
        (outer products, ``k = 1``, left out)."""
        return [c for c in self.calls if c.wide and c.k > 1 and c.multiply_adds >= min_multiply_adds]

    def largest(self) -> GemmCall | None:
        """The recorded GEMM with the most multiply-adds (None if none ran)."""
        return max(self.calls, key=lambda c: c.multiply_adds, default=None)

    def check(self, min_multiply_adds: int = UPCAST_MIN_MULTIPLY_ADDS) -> None:
        """Raise naming every GEMM on fp32 / fp64 operands of at least ``min_multiply_adds``
        multiply-adds (run on a bf16 / fp16 model's step: each is an upcast off the tensor cores)."""
        found = self.upcast(min_multiply_adds)
        if found:
            listed = "\n  ".join(str(c) for c in found)
            raise AssertionError(f"{len(found)} matmul(s) of >= {min_multiply_adds:,} multiply-adds ran on fp32/fp64 "
                                 f"operands (off the tensor cores in a bf16/fp16 step):\n  {listed}")


__all__ = ["GemmAudit", "GemmCall", "UPCAST_MIN_MULTIPLY_ADDS", "WIDE_DTYPES"]
