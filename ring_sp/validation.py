"""Argument checks every public entry point runs on every rank BEFORE its first collective.

Each check raises ``TypeError``/``ValueError`` naming the argument, its value and the fix
(never ``assert``, which ``python -O`` strips). A check here needs no communication: it
looks only at this rank's arguments (cross-rank agreement is a separate, collective step).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .layouts import LAYOUT_CHOICES
from .shapes import HEAD_CHUNKS_AUTO, divisors, kv_heads_per_rank

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# The local attention backends a call may name (ring_sp.kernels runs them).
BACKENDS = ("auto", "torch", "flash_attn", "reference", "cudnn")
# How the ring group exchanges KV: rotate it (the ring), gather it once, or the planner's choice.
# "double_ring": the ring over nodes as an inner ring per node and one inter-node message per outer
# step (ring_sp.schedule.ring_order); appended, so the agreement's codes of the others stay
KV_EXCHANGES = ("ring", "all_gather", "auto", "double_ring")


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return f"{type(x).__name__} {x!r}"


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q ``[b, s, h, d]``, k ``[b, s, h_kv, d]``, v ``[b, s, h_kv, d_v]``, same dtype and device,
    h % h_kv == 0. The value head size ``d_v`` may differ from ``d`` (MLA)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [batch, seq_local, heads, head_dim]; got {_describe(t)}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, seq_local, heads, head_dim]; got shape {tuple(t.shape)}. "
                f"Megatron's [seq, batch, heads, head_dim] must be transposed first."
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}.dtype={t.dtype} is not supported; use one of {_FLOAT_DTYPES}")
        if 0 in t.shape:
            raise ValueError(f"{name} has an empty dimension: shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}. Cast them first.")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q {q.device}, k {k.device}, v {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree on [batch, seq_local, kv_heads] (only the head size may differ); "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size; got q.shape[0]={q.shape[0]}, k.shape[0]={k.shape[0]}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k must have the same local sequence length (self-attention shards); "
            f"got q.shape[1]={q.shape[1]}, k.shape[1]={k.shape[1]}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim; got q.shape[3]={q.shape[3]}, k.shape[3]={k.shape[3]}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(
            f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]}) for GQA/MQA; "
            f"got q.shape[2]={q.shape[2]}, k.shape[2]={k.shape[2]}"
        )


def check_sinks(sinks: object, q: torch.Tensor) -> None:
    """``sinks`` is None or a 1-D float tensor of one logit per GLOBAL query head, on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor [heads] (one logit per query head) or None; got {_describe(sinks)}")
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[2]:
        raise ValueError(
            f"sinks must be 1-D with one logit per query head, shape ({q.shape[2]},) for q heads={q.shape[2]}; "
            f"got {_describe(sinks)}. Pass this rank's (tensor-parallel) query heads, all of them."
        )
    if sinks.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sinks.dtype={sinks.dtype} is not supported; use one of {_FLOAT_DTYPES}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}; got sinks on {sinks.device}")


def check_options(*, causal: object, layout: object, softmax_scale: object, backend: object) -> None:
    """The non-tensor options shared by every attention entry point."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {_describe(causal)}")
    if layout not in LAYOUT_CHOICES:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUT_CHOICES}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None; got {_describe(softmax_scale)}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale={softmax_scale} must be finite and > 0 (None means 1/sqrt(head_dim))")


def resolve_scale(softmax_scale: float | None, head_dim: int) -> float:
    return float(softmax_scale) if softmax_scale is not None else head_dim ** -0.5


def check_group(group: object, name: str = "group") -> None:
    """``group`` is a ProcessGroup or None, and torch.distributed is initialised."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None; got {_describe(group)}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is not initialized ({name}={group!r}); call "
            f"torch.distributed.init_process_group(...) first (a single process may use world_size=1)"
        )


def check_cu_seqlens(cu_seqlens: object) -> None:
    """``cu_seqlens`` is None or a 1-D integer tensor/sequence of document boundaries."""
    if cu_seqlens is None:
        return
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"cu_seqlens must be a 1-D int32/int64 tensor [num_docs + 1]; got {_describe(cu_seqlens)}"
            )
    elif not isinstance(cu_seqlens, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in cu_seqlens):
        raise TypeError(f"cu_seqlens must be a 1-D int tensor or a list of ints [num_docs + 1]; got {_describe(cu_seqlens)}")


def check_local_length(layout: str, local_len: int, sp_size: int, *, name: str = "q.shape[1]") -> None:
    """zigzag splits every shard into two equal chunks (on more than one rank), so the
    local length must be even."""
    if layout == "zigzag" and sp_size > 1 and local_len % 2 != 0:
        raise ValueError(
            f"{name}={local_len} must be even for layout='zigzag' (each shard is two equal chunks, "
            f"so the global length must be a multiple of 2 x the sequence-parallel size); shard with "
            f"ring_sp.shard_batch, which pads any length at its end, or use layout='contiguous'"
        )


def check_sliding_window(sliding_window: object, causal: object) -> None:
    """``sliding_window`` is None or an int >= 1 (keys per query, itself included), and needs
    ``causal=True`` (query i sees keys ``i - sliding_window < j <= i``)."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window must be an int >= 1 or None; got {_describe(sliding_window)}")
    if sliding_window < 1:
        raise ValueError(
            f"sliding_window={sliding_window} must be >= 1 (the number of keys each query sees, itself "
            f"included) or None for no window"
        )
    if causal is not True:
        raise ValueError(
            f"sliding_window={sliding_window} needs causal=True (query i sees keys i - sliding_window < j <= i); "
            f"got causal={causal!r}. Pass causal=True, or sliding_window=None"
        )


def check_kv_exchange(kv_exchange: object) -> None:
    """``kv_exchange`` is one of :data:`KV_EXCHANGES`."""
    if not isinstance(kv_exchange, str) or kv_exchange not in KV_EXCHANGES:
        raise ValueError(
            f"kv_exchange={kv_exchange!r} is not one of {KV_EXCHANGES}: 'ring' rotates KV shards around the ring "
            f"group (the default), 'all_gather' gathers every KV shard once and reduce-scatters dK/dV, 'auto' lets "
            f"the planner (ring_sp.planner.choose_kv_exchange) pick, 'double_ring' runs a ring that spans nodes as "
            f"an inner ring in each node and one inter-node message per shard and node (needs the node size)"
        )


def check_head_chunks(head_chunks: object) -> None:
    """``head_chunks`` is None (unchunked), a positive int (that many chunks of heads) or "auto"."""
    if head_chunks is None or (isinstance(head_chunks, str) and head_chunks == HEAD_CHUNKS_AUTO):
        return
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int):
        raise TypeError(f"head_chunks must be a positive int, 'auto' or None (unchunked); got {_describe(head_chunks)}")
    if head_chunks < 1:
        raise ValueError(f"head_chunks={head_chunks} must be >= 1 (the number of chunks of heads; 1 or None: "
                         f"unchunked) or 'auto'")


def check_head_chunk_split(chunks: int, heads: int, kv_heads: int, ulysses_size: int) -> None:
    """``chunks`` splits this rank's heads into equal chunks of whole GQA groups: each chunk holds
    ``m / chunks`` of the ``m`` KV heads a rank holds after the all-to-all
    (:func:`ring_sp.shapes.kv_heads_per_rank`) and the query heads that read them. Run after
    :func:`ring_sp.shapes.check_ulysses_heads`."""
    if chunks == 1:
        return
    m = kv_heads_per_rank(kv_heads, ulysses_size)
    where = f"k/v heads={kv_heads}" + (f" over ulysses_size={ulysses_size}" if ulysses_size > 1 else "")
    if kv_heads % ulysses_size != 0:
        raise ValueError(
            f"head_chunks={chunks} needs whole KV heads per chunk, but ulysses_size={ulysses_size} > {kv_heads} k/v "
            f"heads replicates each KV head to {ulysses_size // kv_heads} ranks: a rank holds ONE KV head, read by "
            f"all its {heads // ulysses_size} query heads, so its heads cannot be split without sending that KV head "
            f"again per chunk. Use head_chunks=1 (or 'auto', which picks 1 here)"
        )
    if chunks > m:
        raise ValueError(
            f"head_chunks={chunks} is more than the {m} KV head(s) a rank holds ({where}): a chunk holds whole "
            f"GQA groups (its KV heads and the query heads that read them). Use at most {m}, or 'auto'"
        )
    if m % chunks != 0:
        raise ValueError(
            f"head_chunks={chunks} does not split the {m} KV heads a rank holds ({where}) into equal chunks of whole "
            f"GQA groups (KV heads and the query heads that read them); use one of {divisors(m)}, or 'auto'"
        )
