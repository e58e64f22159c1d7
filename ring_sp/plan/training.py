"""How a training step runs (:class:`Training`), and the two recipes the CLI compares.

:func:`alst` is DeepSpeed ALST's published recipe, each modelled piece with its source;
:func:`long_sequence` is ring_sp's ``enable_long_sequence`` defaults (tiles sized by the
library, lean layers, head chunks "auto") under the same ZeRO-3 and offload settings, so
the two rows of ``ring-sp plan --max-seq-len --alst`` differ only in what each library
brings.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shapes import HEAD_CHUNKS_AUTO, prefetch_checkpoint
from .request import PlanError, dtype_bytes


ATTENTION_KERNELS = ("flash", "cpu")


@dataclass(frozen=True)
class Training:
    """How the step runs. ``zero_stage`` shards over ``zero_ranks`` (None: the SP degree);
    ``master_weights`` (None: when ``dtype`` is not fp32) keeps fp32 copies for Adam;
    ``offload_optimizer``: moments, master weights and fp32 gradients live on the host
    (DeepSpeed ``offload_optimizer``); ``offload_params``: ZeRO-3's parameter shards too
    (``offload_param``); ``kernels``: "hf" (transformers' modules) or "fused" (Liger's
    RMSNorm / SwiGLU / RoPE; with ``library="alst"`` also Liger's fused linear cross entropy,
    as ArcticTraining's trainer uses it); ``library``: "ring_sp" (its attention,
    :func:`ring_sp.plan.layer_cost.attention_memory`, and tiles, :mod:`ring_sp.tiling`) or
    "alst" (DeepSpeed's Ulysses around flash-attention 2 and its ``TiledMLP`` /
    ``TiledFusedLogitsLoss``); tile sizes in tokens (None: the library default: ring_sp's
    ``auto_tile_tokens``; ALST's MLP ``ceil(n / hidden)`` tiles, its loss 1 GiB of fp32 logits
    per tile).

    ring_sp only: ``lean_layers`` (``enable_long_sequence(lean_layers=True)``: RMSNorm keeps its
    input and one fp32 rstd per row, RoPE nothing, an untiled gated MLP its gate and up);
    ``head_chunks`` (None or 1: unchunked; an int; "auto": the most the GQA groups allow):
    the attention's head-layout buffers, ring rotation and fp32 accumulators exist for one
    chunk of heads at a time. ``pinned_rounding`` (None/False: the libraries as they are): True
    models offloaded checkpoints in ONE pinned host block each, rounded up to a power of two by
    torch's caching host allocator (what ring_sp's ``CudaMover`` did before it copied into
    power-of-two pieces, :func:`ring_sp.shapes.pinned_piece_sizes`); ALST copies them to
    pageable memory of their exact size. ``prefetch_checkpoints`` (``OffloadedCheckpoint(prefetch=...)``):
    True brings the previous layer's offloaded checkpoint back during a layer's backward (two on
    the device), False each at its own layer's backward (one), None the runtime's auto rule
    (:func:`ring_sp.shapes.prefetch_checkpoint`: prefetch while a checkpoint is at most 1/64 of
    the GPU's memory). ``attention_kernel``: whose backward the attention runs, for the workspace
    it allocates beyond its gradients (:func:`ring_sp.plan.layer_memory.kernel_workspace`):
    "flash" (flash-attention 2's backward: ring_sp's ``torch`` backend on CUDA, which calls
    aten's port of it, its ``flash_attn`` backend, and ALST's attention; the default, a GPU
    plan) or "cpu" (torch's CPU flash op: fp32 gradients, no per-token workspace; the CPU
    calibrations). ``reuse_on_recompute`` (ring_sp with checkpointing; None: the runtime's
    default, on unless ``enable_long_sequence`` offloads the checkpoints, which turns it off):
    the first run of each checkpointed attention keeps its out + lse on the device until that
    layer's backward re-runs it (:mod:`ring_sp.recompute`).
    """

    dtype: str = "bf16"
    zero_stage: int = 0
    zero_ranks: int | None = None
    master_weights: bool | None = None
    offload_optimizer: bool = False
    checkpointing: bool = False
    offload_checkpoints: bool = False
    tiled_mlp: bool = False
    tiled_loss: bool = False
    mlp_tile_tokens: int | None = None
    loss_tile_tokens: int | None = None
    kernels: str = "hf"
    library: str = "ring_sp"
    reduce_bucket: int = 500_000_000  # DeepSpeed's reduce_bucket_size (elements), ZeRO >= 1
    reserved_bytes: float = 0.0  # CUDA context, NCCL, ... (not tensors)
    fragmentation: float = 0.0  # share of the transient memory lost to the allocator
    lean_layers: bool = False
    head_chunks: int | str | None = None
    offload_params: bool = False
    pinned_rounding: bool | None = None
    prefetch_checkpoints: bool | None = None
    attention_kernel: str = "flash"
    reuse_on_recompute: bool | None = None

    def check(self) -> None:
        """Raise :class:`PlanError` naming the first option that cannot be planned, and the fix."""
        dtype_bytes(self.dtype)
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero-stage={self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.kernels not in ("hf", "fused"):
            raise PlanError(f"kernels={self.kernels!r} must be 'hf' or 'fused'")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise PlanError(f"attention-kernel={self.attention_kernel!r} must be one of {ATTENTION_KERNELS}")
        if self.library not in ("ring_sp", "alst"):
            raise PlanError(f"library={self.library!r} must be 'ring_sp' or 'alst'")
        if self.offload_checkpoints and not self.checkpointing:
            raise PlanError("offload-checkpoints needs activation checkpointing: add --checkpointing")
        if self.offload_params and self.zero_stage != 3:
            raise PlanError(f"offload-params needs ZeRO stage 3 (parameters are sharded only there); "
                            f"zero-stage={self.zero_stage}: add --zero-stage 3 or drop --offload-params")
        for name in ("mlp_tile_tokens", "loss_tile_tokens", "zero_ranks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise PlanError(f"{name.replace('_', '-')}={value!r} must be a positive integer")
        chunks = self.head_chunks
        if chunks is not None and chunks != HEAD_CHUNKS_AUTO and (
                isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
            raise PlanError(f"head-chunks={chunks!r} must be a positive integer or 'auto'")
        if self.library == "alst" and (self.lean_layers or chunks not in (None, 1)):
            raise PlanError(f"lean-layers={self.lean_layers} / head-chunks={chunks!r} are ring_sp's pieces; ALST "
                            f"(library='alst') has neither: drop them or use library='ring_sp'")
        prefetch = self.prefetch_checkpoints
        if prefetch is not None and not isinstance(prefetch, bool):
            raise PlanError(f"prefetch-checkpoints={prefetch!r} must be True, False or None (the runtime's auto rule)")
        if self.library == "alst" and prefetch is not None:
            raise PlanError(f"prefetch-checkpoints={prefetch} is ring_sp's choice; ALST (library='alst') always "
                            f"brings one checkpoint back at a time: drop it or use library='ring_sp'")
        if self.reuse_on_recompute is not None and not isinstance(self.reuse_on_recompute, bool):
            raise PlanError(f"reuse-on-recompute={self.reuse_on_recompute!r} must be True, False or None "
                            f"(the runtime's)")
        if self.pinned_rounding is not None and not isinstance(self.pinned_rounding, bool):
            raise PlanError(f"pinned-rounding={self.pinned_rounding!r} must be True, False or None (the library's)")

    @property
    def keeps_recompute_entries(self) -> bool:
        """Whether every checkpointed ring_sp attention keeps its out + lse on the device until its backward."""
        reuse = self.reuse_on_recompute if self.reuse_on_recompute is not None else not self.offload_checkpoints
        return self.library == "ring_sp" and self.checkpointing and reuse

    @property
    def liger_loss(self) -> bool:
        """ALST with Liger on: Liger's fused linear cross entropy computes the loss, not ALST's
        tiled loss (ArcticTraining ``sft_trainer.py``: ``if self.config.model.type == "liger"``)."""
        return self.library == "alst" and self.kernels == "fused"

    def device_checkpoint_layers(self, checkpoint_bytes: float, memory_bytes: float | None) -> int:
        """Offloaded checkpoints of ``checkpoint_bytes`` each on a GPU of ``memory_bytes`` (None:
        unknown) during the backward: ring_sp's ``OffloadedCheckpoint`` has two when it prefetches
        one layer ahead (``prefetch_checkpoints``, None: :func:`ring_sp.shapes.prefetch_checkpoint`),
        else one; ALST copies each back synchronously when its layer's backward starts (one:
        ArcticTraining ``monkey_patches.py``, ``CheckpointFunctionWithCPUOffload``)."""
        if self.library != "ring_sp":
            return 1
        prefetch = self.prefetch_checkpoints
        if prefetch is None:
            prefetch = prefetch_checkpoint(checkpoint_bytes, memory_bytes)
        return 2 if prefetch else 1

    @property
    def rounds_pinned(self) -> bool:
        """Whether each offloaded checkpoint takes a power-of-two pinned host block (see the class)."""
        return bool(self.pinned_rounding)


def alst(zero_ranks: int | None = None) -> Training:
    """ALST's published recipe (arXiv 2506.13996; ArcticTraining ``projects/sequence-parallelism/
    run-h100-sp8-llama-8b.yml`` and ``-sp32-``): Ulysses only, bf16, ZeRO-3 with the optimizer on
    the host (``offload_optimizer: cpu``, ``cpu_adam``), activation checkpointing with the
    checkpoints offloaded (``activation_checkpoint_cpu_offload: true``: each layer's input
    copied to pageable host memory, brought back synchronously), ``tiled_mlp_compute: true``
    (TiledMLP, ``ceil(n / hidden)`` tiles) and ``model: type: "liger"``: Liger's RMSNorm, RoPE
    and SwiGLU, and Liger's fused linear cross entropy for the loss (ArcticTraining
    ``sft_trainer.py`` uses ALST's ``TiledFusedLogitsLoss`` only when Liger is off);
    ``expandable_segments`` against fragmentation."""
    return Training(dtype="bf16", zero_stage=3, zero_ranks=zero_ranks, offload_optimizer=True, checkpointing=True,
                    offload_checkpoints=True, tiled_mlp=True, tiled_loss=True, kernels="fused",
                    library="alst")


def long_sequence(reserved_bytes: float = 0.0, *, lean_layers: bool = True,
                  head_chunks: int | str | None = HEAD_CHUNKS_AUTO, pinned_rounding: bool | None = None,
                  prefetch_checkpoints: bool | None = None) -> Training:
    """ring_sp under ALST's ZeRO-3 / offload recipe with ``enable_long_sequence``'s defaults:
    tiled MLP and loss with tiles sized by the library, lean layers on, head chunks "auto",
    offloaded checkpoints prefetched by the runtime's auto rule (``prefetch_checkpoints=None``)."""
    return Training(dtype="bf16", zero_stage=3, offload_optimizer=True, checkpointing=True, offload_checkpoints=True,
                    tiled_mlp=True, tiled_loss=True, reserved_bytes=reserved_bytes, lean_layers=lean_layers,
                    head_chunks=head_chunks, pinned_rounding=pinned_rounding,
                    prefetch_checkpoints=prefetch_checkpoints)


__all__ = ["ATTENTION_KERNELS", "HEAD_CHUNKS_AUTO", "Training", "alst", "long_sequence"]
