"""A CPU double of CUDA's ``aten::addmm.dtype_out``: fp16 / bf16 operands summed in fp32 into ``out``.

torch has no CPU kernel for ``addmm(..., out_dtype=)`` (2.13 included), so the path
``ring_sp.gemm.accumulate_matmul`` takes on CUDA never runs here. :func:`installed` registers
this double as that overload's CPU kernel for the duration of a ``with`` block (removed after).

What it reproduces, read from pytorch/pytorch ``aten/src/ATen/native/cuda/Blas.cpp``
(``_addmm_dtype_out_cuda``, after pytorch#167931, torch 2.10), the checks that raise: ``mat1``
and ``mat2`` of one dtype; ``out_dtype`` that dtype, or fp32 for fp16 / bf16 operands; ``out`` of
``out_dtype``; ``self`` of ``out_dtype`` or of the operands' dtype. The value: the exact products
(fp16 / bf16 products are exact in fp32) summed in fp32 with ``beta * self`` (cuBLAS's
``beta = 1`` epilogue), no rounding to the operands' dtype. Computed from the definition in
fp32, no ring_sp code. Every call is counted (``calls``: self dtype, operand dtype, whether
``out`` is ``self``) so a test can tell the path ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_LOW = (torch.float16, torch.bfloat16)


class AddmmOutDtypeDouble:
    """The kernel; ``calls`` lists ``(self dtype, operand dtype, out is self)`` per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, torch.dtype, bool]] = []

    def __call__(self, input: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, out_dtype: torch.dtype, *,
                 beta=1, alpha=1, out: torch.Tensor) -> torch.Tensor:
        if mat1.dtype != mat2.dtype:
            raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got {mat1.dtype} and {mat2.dtype}")
        if not (out_dtype == mat1.dtype or (out_dtype == torch.float32 and mat1.dtype in _LOW)):
            raise RuntimeError("out_dtype must be the same as input dtype or fp32 for fp16/bf16 inputs")
        if out.dtype != out_dtype:
            raise RuntimeError("out_dtype must be the same as the dtype of the provided out tensor")
        if input.dtype not in (out_dtype, mat1.dtype):
            raise RuntimeError("self dtype must match either out_dtype or mat1 dtype")
        self.calls.append((input.dtype, mat1.dtype, out is input))
        wide = torch.addmm(input.to(torch.float32), mat1.to(torch.float32), mat2.to(torch.float32), beta=beta,
                           alpha=alpha)
        out.copy_(wide)
        return out


@contextlib.contextmanager
def installed() -> Iterator[AddmmOutDtypeDouble]:
    """The double as ``aten::addmm.dtype_out``'s CPU kernel inside the block."""
    double = AddmmOutDtypeDouble()
    library = torch.library.Library("aten", "IMPL")
    library.impl("addmm.dtype_out", double, "CPU")
    try:
        yield double
    finally:
        library._destroy()
