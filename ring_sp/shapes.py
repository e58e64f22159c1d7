"""Shape and dtype arithmetic that the runtime and the planner must agree on.

Pure: no process groups, no kernels, so the cost model (:mod:`ring_sp.plan`) can sit below
the runtime and still count exactly what the runtime allocates and sends:

* how Ulysses splits query and KV heads (:func:`check_ulysses_heads`,
  :func:`kv_heads_per_rank`);
* the dtype of the softmax statistics and the gradient accumulators
  (:func:`softmax_stat_dtype`);
* the bytes a recompute entry keeps besides out and lse (:data:`FINGERPRINT_BYTES`);
* the tokens per tile of a tiled MLP or loss when the library sizes them
  (:func:`auto_tile_tokens`);
* the pinned host blocks of an offloaded checkpoint (:func:`pinned_piece_sizes`);
* whether an offloaded checkpoint is prefetched a layer ahead (:func:`prefetch_checkpoint`);
* the ``head_chunks="auto"`` value (:data:`HEAD_CHUNKS_AUTO`) and the valid counts
  (:func:`head_chunk_options`, from :func:`divisors`).
"""

from __future__ import annotations

import torch

FINGERPRINT_BYTES = 3 * 2 * 8  # what a recompute entry keeps besides out and lse: two float64 per q, k, v


def check_ulysses_heads(heads: int, kv_heads: int, ulysses_size: int) -> None:
    """Ulysses splits query heads evenly and needs a simple KV-head mapping."""
    if heads % ulysses_size != 0:
        raise ValueError(
            f"q heads ({heads}) must be divisible by ulysses_size ({ulysses_size}); choose a "
            f"ulysses_size that divides {heads} and put the rest of the SP degree on the ring"
        )
    if kv_heads % ulysses_size != 0 and ulysses_size % kv_heads != 0:
        raise ValueError(
            f"k/v heads ({kv_heads}) and ulysses_size ({ulysses_size}) must divide one another "
            f"(h_kv % U == 0 sends KV heads, U % h_kv == 0 replicates them); choose a ulysses_size "
            f"that divides or is a multiple of {kv_heads}"
        )


def kv_heads_per_rank(kv_heads: int, ulysses_size: int) -> int:
    """KV heads each Ulysses rank receives: ``h_kv / U`` when U divides h_kv, else 1."""
    return kv_heads // ulysses_size if kv_heads % ulysses_size == 0 else 1


def softmax_stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of lse and of the fp32 accumulators: float64 stays float64, all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


TILE_FLOOR_TOKENS = 128
"""The fewest tokens :func:`auto_tile_tokens` gives a tile: a matmul of fewer rows runs well
below the hardware's rate (a tensor-core tile is 128 rows; CPU GEMMs alike), and the tile's
bytes are then small next to the step's other buffers anyway."""


GATED_MLP_TILE_TENSORS = 6
"""``[t, ffn]`` tensors a gated-MLP tile holds at its backward's peak: gate, up, act(gate),
their product (recomputed) and the two gradients flowing back to gate and up."""

LOSS_TILE_TENSORS = 2
"""``[t, vocab]`` fp32 tensors a loss tile holds: its logits and their gradient."""


def auto_tile_tokens(tokens: int, *, kept_width: int, kept_bytes: int, tile_width: int, tile_bytes: int,
                     floor: int = TILE_FLOOR_TOKENS) -> int:
    """Tokens per tile so that a tile is never the step's peak: one tile's working set,
    ``tile_width`` elements of ``tile_bytes`` per token (e.g. ``LOSS_TILE_TENSORS * vocab``
    fp32, ``GATED_MLP_TILE_TENSORS * ffn`` in the model's dtype), is no larger than the
    shard's ``[tokens, kept_width]`` hidden state (``kept_bytes`` per element), which the step
    holds anyway; at least ``floor`` tokens (:data:`TILE_FLOOR_TOKENS`), at most ``tokens``.
    Pure arithmetic, so the planner counts the same tiles the runtime cuts."""
    if tokens <= 0:
        return 1
    fitting = (tokens * kept_width * kept_bytes) // max(1, tile_width * tile_bytes)
    return max(1, min(tokens, max(floor, fitting)))


PIECE_GRANULE = 2 * 2**20
"""The smallest pinned piece of an offloaded checkpoint (bytes, a power of two)."""


def pinned_piece_sizes(nbytes: int, granule: int = PIECE_GRANULE) -> list[int]:
    """The pinned host blocks one offloaded copy of ``nbytes`` takes (:class:`ring_sp.offload.CudaMover`):
    powers of two, largest first, summing to ``nbytes`` rounded up to ``granule``.

    torch's caching host allocator rounds every pinned block up to the next power of two
    (``CachingHostAllocator.h``, unless ``pinned_max_round_threshold_mb`` is set), so one block
    per checkpoint of a 4.1 GiB layer input would take 8 GiB of the node's RAM; blocks that
    ARE powers of two are taken as they are, and are reused from the allocator's cache by
    the next step's checkpoints of the same size.
    """
    total = -(-nbytes // granule) * granule
    return [1 << bit for bit in range(total.bit_length() - 1, -1, -1) if total >> bit & 1]


PREFETCH_SHARE = 64
"""An offloaded checkpoint is prefetched a layer ahead while it is at most ``1 / PREFETCH_SHARE``
of the device's memory (1.25 GiB of an 80 GiB H100: about 160K tokens per GPU at hidden 4096 bf16)."""


def prefetch_checkpoint(checkpoint_bytes: float, device_bytes: float | None) -> bool:
    """Whether to copy the previous layer's offloaded checkpoint back while this layer's backward
    runs (two checkpoints on the device) rather than when its own backward starts (one).

    The copy is ``n x H`` bytes, the layer's backward grows with ``n x N`` (attention), so above
    :data:`PREFETCH_SHARE`'s share the copy is a tiny share of the backward's time (0.2 s next to
    minutes at 790K tokens per GPU) while the second buffer is a large share of memory: not worth
    it. ``device_bytes`` None (unknown, or not a GPU): prefetch. The runtime
    (:class:`ring_sp.offload.OffloadedCheckpoint`) and the planner both decide here."""
    return device_bytes is None or checkpoint_bytes * PREFETCH_SHARE <= device_bytes


HEAD_CHUNKS_AUTO = "auto"
"""``head_chunks="auto"``: :func:`ring_sp.plan.head_chunk_choice.choose_head_chunks` picks the
count, for the runtime (:mod:`ring_sp.attention`) and the planner alike."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, increasing (valid sizes that split ``n`` evenly)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def head_chunk_options(kv_heads: int, ulysses_size: int) -> list[int]:
    """Every valid ``head_chunks``: the divisors of the KV heads a rank holds (:func:`kv_heads_per_rank`;
    only 1 when they are replicated, ``ulysses_size > kv_heads``): a chunk holds whole GQA groups."""
    if kv_heads % ulysses_size != 0:
        return [1]
    return divisors(kv_heads_per_rank(kv_heads, ulysses_size))
