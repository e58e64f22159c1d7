"""Kernels that index with 32-bit integers, and whether a plan's tensors cross 2^31 elements.

A kernel that computes element offsets in int32 reads out of bounds (an illegal memory access,
or silently wrong values) once one of its tensors holds 2^31 elements or more. At long context
the per-token tensors reach that on one rank: ``[n, hidden]`` at hidden 4096 from n = 524,288.
Known cases (the sources):

* flash-attention 2 (CUDA): 32-bit offsets in places (Dao-AILab/flash-attention#1311: "We use
  32bit indexing so when tensors get larger than 2GB or 4GB the indexing might be wrong";
  #767: numel > 2^31 fails in FA2, solved by FA3; #1500 widened one backward offset). ALST runs
  it on head-layout q of ``n x heads x head_dim`` elements; ring_sp's ``flash_attn`` backend on
  one head chunk's q, ``n x heads x head_dim / chunks``.
* Liger's Triton RMSNorm and RoPE (linkedin/Liger-Kernel#803: RMSNorm crashes on
  ``[1, 500_000, 4096]``; fixed by casting ``tl.program_id`` to int64 in #804, so releases
  before it), on ``n x hidden`` and ``n x heads x head_dim`` elements.

ring_sp's lean layers, tiles and loss are PyTorch ops, which switch to 64-bit indexing by
themselves (ATen's ``canUse32BitIndexMath``), so they are not flagged.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layer_memory import head_chunk_count
from .training import Training
from .transformer import Transformer

INT32_LIMIT = 2**31


@dataclass(frozen=True)
class Int32Risk:
    """The largest tensor (elements) a 32-bit-indexing kernel of the plan sees, and those kernels
    whose tensors reach :data:`INT32_LIMIT` (empty: none)."""

    elements: int
    kernels: tuple[str, ...]

    @property
    def flagged(self) -> bool:
        return bool(self.kernels)

    def note(self) -> str:
        """The table cell: "-" when nothing crosses, else the elements and the kernels."""
        if not self.kernels:
            return "-"
        return f"{self.elements:.3g} elements >= 2^31: {', '.join(self.kernels)}"


def int32_risk(model: Transformer, training: Training, *, n: int, ulysses: int) -> Int32Risk:
    """The int32-index check of one rank holding ``n`` tokens (see the module docstring)."""
    rows = [n * model.hidden, n * model.q_width]  # the norms' [n, hidden]; RoPE's q
    attention = n * model.q_width // head_chunk_count(model, training, ulysses)  # one kernel call's q
    over = []
    if attention >= INT32_LIMIT:
        over.append("flash-attn 2 (ALST's attention)" if training.library == "alst"
                    else "flash-attn 2 (ring_sp's flash_attn backend)")
    if training.kernels == "fused" and max(rows) >= INT32_LIMIT:
        over.append("Liger RMSNorm/RoPE before Liger-Kernel#804")
    return Int32Risk(max([attention] + (rows if training.kernels == "fused" else [])), tuple(over))


__all__ = ["INT32_LIMIT", "Int32Risk", "int32_risk"]
