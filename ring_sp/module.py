"""``SequenceParallelAttention``: the one module the DeepSpeed and Megatron glue wraps."""

from __future__ import annotations

import torch
from torch import nn

from .attention import hybrid_attention
from .chunk_prefill import chunk_attention
from .decode import ShardedKVCache, decode_attention
from .layouts import rank_positions
from .topology import SequenceParallelTopology
from .validation import check_head_chunks, check_kv_exchange, check_options, check_sliding_window


class SequenceParallelAttention(nn.Module):
    """Core attention (no projections) over a ``U x R`` sequence-parallel grid.

    ``forward(q, k, v)`` takes q ``[b, n, h, d]`` and k/v ``[b, n, h_kv, d]`` (this
    rank's shard, in ``layout`` over ``topology.sp_rank``) and returns ``[b, n, h, d]``.
    Holds no parameters, so checkpoints do not depend on the grid shape. ``validate`` and
    ``reuse_on_recompute`` (activation checkpointing's re-run reuses the first run's
    output instead of running the ring again): see :func:`ring_sp.ring_attention`.
    ``sliding_window``: the default window of :meth:`forward` (see
    :func:`ring_sp.ring_attention`; needs ``causal=True``). ``kv_exchange``: how each ring
    group exchanges KV, ``"ring"``, ``"all_gather"`` or ``"auto"`` (see :func:`ring_sp.ring_attention`).
    ``head_chunks``: run the heads in that many chunks of whole GQA groups, or ``"auto"`` (None:
    unchunked; see :func:`ring_sp.ring_attention`); checked against the heads at each call.
    """

    def __init__(
        self,
        topology: SequenceParallelTopology,
        *,
        causal: bool = True,
        layout: str = "zigzag",
        backend: str = "auto",
        softmax_scale: float | None = None,
        validate: bool | None = None,
        sliding_window: int | None = None,
        reuse_on_recompute: bool | None = None,
        kv_exchange: str = "ring",
        head_chunks: int | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(topology, SequenceParallelTopology):
            raise TypeError(f"topology must be a SequenceParallelTopology; got {type(topology).__name__}")
        check_options(causal=causal, layout=layout, softmax_scale=softmax_scale, backend=backend)
        check_sliding_window(sliding_window, causal)
        check_kv_exchange(kv_exchange)
        check_head_chunks(head_chunks)
        self.kv_exchange = kv_exchange
        self.head_chunks = head_chunks
        self.sliding_window = sliding_window
        self.topology = topology
        self.causal = causal
        self.layout = layout
        self.backend = backend
        self.softmax_scale = softmax_scale
        self.validate = validate
        self.reuse_on_recompute = reuse_on_recompute

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens: torch.Tensor | list[int] | None = None,
                sliding_window: int | None = None, *,
                sinks: torch.Tensor | None = None,
                spans: torch.Tensor | list[tuple[int, int]] | None = None) -> torch.Tensor:
        """q ``[b, n, h, d]``, k ``[b, n, h_kv, d]``, v ``[b, n, h_kv, d_v]`` -> ``[b, n, h, d_v]``;
        ``cu_seqlens``: the packed documents' boundaries in the global sequence; ``spans``: the
        bidirectional spans inside them, ``[num_spans, 2]`` global (start, stop) pairs (see
        :func:`ring_sp.ring_attention`);
        ``sliding_window``: this call's window (None: the module's ``sliding_window``); ``sinks``:
        one logit per query head ``[h]``, the caller's parameter (see :func:`ring_sp.ring_attention`)."""
        window = self.sliding_window if sliding_window is None else sliding_window
        return hybrid_attention(
            q, k, v, topology=self.topology, causal=self.causal, layout=self.layout,
            softmax_scale=self.softmax_scale, backend=self.backend, validate=self.validate, cu_seqlens=cu_seqlens,
            sinks=sinks, sliding_window=window, reuse_on_recompute=self.reuse_on_recompute,
            kv_exchange=self.kv_exchange, head_chunks=self.head_chunks, spans=spans,
        )

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, capacity: int,
                sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, ShardedKVCache]:
        """A prompt's attention and this rank's KV cache (issue 46's core entry): :meth:`forward` on this
        rank's shard (q ``[b, n, h, d]``, k/v ``[b, n, h_kv, d]`` of a prompt of ``n * sp_size`` tokens
        in ``layout``; no documents), and a :class:`ring_sp.decode.ShardedKVCache` of the shard's keys
        and values at their global positions, over the SP group, with room for ``capacity`` tokens on
        this rank (its share of the prompt plus of the tokens to generate). With a sliding window (this
        call's, else the module's) the cache keeps only what the window can see (``ShardedKVCache.window``).
        Collectives: the forward's, then one all-gather of the shard sizes. Needs ``causal=True``."""
        if not self.causal:
            raise ValueError("prefill needs causal=True (a prompt decoded token by token is causal)")
        window = self.sliding_window if sliding_window is None else sliding_window
        out = self.forward(q, k, v, sliding_window=window, sinks=sinks)
        t = self.topology
        positions = rank_positions(self.layout, t.sp_size, q.shape[1] * t.sp_size, t.sp_rank)
        return out, ShardedKVCache.from_prefill(k, v, positions, capacity=capacity, group=t.sp_group, window=window)

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache, *,
               sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One new token (q ``[b, 1, h, d]``, k ``[b, 1, h_kv, d]``, v ``[b, 1, h_kv, d_v]``, the same on every
        rank of the SP group) against ``cache`` (:meth:`prefill`'s), after storing its key and value on one
        rank -> ``[b, 1, h, d_v]``, equal on every rank (:func:`ring_sp.decode.decode_attention`: one
        all-gather over the SP group). ``sliding_window``: None takes the module's."""
        window = self.sliding_window if sliding_window is None else sliding_window
        return decode_attention(q, k, v, cache, group=self.topology.sp_group, scale=self.softmax_scale, window=window,
                                sinks=sinks, backend=self.backend)

    def chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: ShardedKVCache, *,
              exchange: str = "auto", sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``c`` new tokens (q ``[b, c, h, d]``, k/v ``[b, c, h_kv, d]``, the same on every rank of the SP group)
        after ``cache`` and causally among themselves, their keys and values stored first: a prompt's next
        chunk or a second turn -> ``[b, c, h, d_v]``, equal on every rank (:func:`ring_sp.chunk_attention`;
        ``exchange``: ``"auto"``, ``"pass_q"`` or ``"pass_kv"``; with the module's sliding window: pass-Q)."""
        return chunk_attention(q, k, v, cache, group=self.topology.sp_group, scale=self.softmax_scale,
                               window=self.sliding_window, sinks=sinks, backend=self.backend, exchange=exchange)

    def extra_repr(self) -> str:
        t = self.topology
        window = f", sliding_window={self.sliding_window}" if self.sliding_window is not None else ""
        window += f", head_chunks={self.head_chunks!r}" if self.head_chunks is not None else ""
        return (f"ulysses={t.ulysses_size}, ring={t.ring_size}, causal={self.causal}, layout={self.layout!r}, "
                f"backend={self.backend!r}, kv_exchange={self.kv_exchange!r}{window}")
