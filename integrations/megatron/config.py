"""``RingSPConfig``: what the ring_sp core attention needs to know, and its checks.

Megatron-core needs no import here, so argument parsing and validation stay cheap. Every
error names the Megatron-LM argument (``--ring-sp-ulysses-size``) and the config field
(``ulysses_size``) together, with the value and the fix (DESIGN.md section 9).
"""

from __future__ import annotations

from dataclasses import dataclass

from ring_sp.kernels import BACKENDS
from ring_sp.shapes import divisors
from ring_sp.topology import PLACEMENTS
from ring_sp.validation import KV_EXCHANGES

# document_zigzag is how Megatron shards packed (THD) batches; document_balanced keeps short
# documents whole (its RoPE then from ring_sp: install_layout_rope); auto picks between them per
# batch. A batch without documents is one document, for which all three are plain zigzag.
MEGATRON_LAYOUTS = ("zigzag", "contiguous", "striped", "document_zigzag", "document_balanced", "auto")
PACKED_LAYOUTS = ("document_zigzag", "document_balanced", "auto")  # the layouts of THD batches


def unpacked_layout(layout: str) -> str:
    """The layout of a batch without document boundaries: the document layouts (and ``auto``)
    of a single document are ``zigzag`` (what ``get_batch_on_this_cp_rank`` and Megatron's RoPE use)."""
    return "zigzag" if layout in PACKED_LAYOUTS else layout


@dataclass(frozen=True)
class RingSPConfig:
    """ring_sp settings of a Megatron model.

    ``ulysses_size`` is ``U``; the ring size is ``context_parallel_size / U``. ``layout``
    is how the sequence is split over the context-parallel ranks: ``zigzag`` is what
    Megatron's ``get_batch_on_this_cp_rank`` and its RoPE slicing produce, and
    ``document_zigzag`` what its packed-sequence (THD) sharding produces, the same as
    ``zigzag`` for batches without documents; ``document_balanced`` (short documents whole,
    only the KV that is read on the wire) and ``auto`` (per batch) shard THD batches with
    :func:`~.packed.thd_batch_on_this_cp_rank` and need ring_sp's RoPE (:func:`~.rope.install_layout_rope`). ``kv_exchange``: how a ring group exchanges
    KV (``ring``, ``all_gather`` or ``auto``; see :func:`ring_sp.ring_attention`).
    """

    ulysses_size: int = 1
    layout: str = "zigzag"
    placement: str = "ulysses_inner"
    backend: str = "auto"
    kv_exchange: str = "ring"

    def __post_init__(self) -> None:
        if isinstance(self.ulysses_size, bool) or not isinstance(self.ulysses_size, int) or self.ulysses_size < 1:
            raise ValueError(f"--ring-sp-ulysses-size (ulysses_size) must be an int >= 1; got {self.ulysses_size!r}")
        for flag, field, value, allowed in (
            ("--ring-sp-layout", "layout", self.layout, MEGATRON_LAYOUTS),
            ("--ring-sp-placement", "placement", self.placement, PLACEMENTS),
            ("--ring-sp-backend", "backend", self.backend, BACKENDS),
            ("--ring-sp-kv-exchange", "kv_exchange", self.kv_exchange, KV_EXCHANGES),
        ):
            if value not in allowed:
                raise ValueError(f"{flag} ({field})={value!r} is not one of {allowed}")

    def ring_size(self, context_parallel_size: int) -> int:
        """``R = context_parallel_size / U`` (call :meth:`check` first)."""
        return context_parallel_size // self.ulysses_size

    def check(
        self,
        *,
        context_parallel_size: int,
        num_attention_heads: int,
        num_query_groups: int | None,
        tensor_model_parallel_size: int,
    ) -> None:
        """Raise ``ValueError`` unless this config fits the model and its parallel sizes.

        Heads are split by tensor parallelism first, so Ulysses must split the heads of
        ONE tensor-parallel rank: ``num_attention_heads / TP`` query heads and
        ``max(1, num_query_groups / TP)`` key/value heads (Megatron's own rule).
        """
        u, cp, tp = self.ulysses_size, context_parallel_size, tensor_model_parallel_size
        if cp % u != 0:
            raise ValueError(
                f"--ring-sp-ulysses-size (ulysses_size)={u} must divide --context-parallel-size={cp}: "
                f"the ring size is context-parallel size / ulysses size. Choose one of {divisors(cp)}."
            )
        r = cp // u
        q_heads = num_attention_heads // tp
        kv_heads = max(1, (num_query_groups or num_attention_heads) // tp)
        if q_heads % u != 0:
            raise ValueError(
                f"--ring-sp-ulysses-size (ulysses_size)={u} must divide the attention heads of one "
                f"tensor-parallel rank (--num-attention-heads={num_attention_heads} / "
                f"--tensor-model-parallel-size={tp} = {q_heads}); choose one of "
                f"{[d for d in divisors(q_heads) if cp % d == 0]} and let the ring take the rest of "
                f"--context-parallel-size={cp}."
            )
        if kv_heads % u != 0 and u % kv_heads != 0:
            raise ValueError(
                f"--ring-sp-ulysses-size (ulysses_size)={u} and the key/value heads of one "
                f"tensor-parallel rank ({kv_heads}, from --num-query-groups / --tensor-model-parallel-size) "
                f"must divide one another; choose a ulysses size that divides or is a multiple of {kv_heads}."
            )
        if self.layout == "striped" and u > 1 and r > 1:
            raise ValueError(
                f"--ring-sp-layout (layout)='striped' cannot be combined with a {u} x {r} ulysses x ring "
                f"grid; use --ring-sp-layout zigzag, a pure ring (--ring-sp-ulysses-size 1) or pure "
                f"Ulysses (--ring-sp-ulysses-size {cp}, the --context-parallel-size)."
            )
        if self.placement == "ring_inner" and u > 1 and r > 1:
            raise ValueError(
                f"--ring-sp-placement (placement)='ring_inner' is not supported with a {u} x {r} "
                f"ulysses x ring grid under Megatron: Megatron shards each batch (get_batch_on_this_cp_rank) "
                f"and RoPE by context-parallel rank c, but with ring_inner CP rank c = ulysses_rank * {r} + "
                f"ring_rank holds ring_sp layout rank ring_rank * {u} + ulysses_rank, a different token "
                f"shard. Use --ring-sp-placement ulysses_inner (each Ulysses group on {u} neighbouring "
                f"CP ranks, the fast links) or a pure ring or pure Ulysses grid."
            )
