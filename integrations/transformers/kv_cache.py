"""``RingSPCache``: transformers' ``Cache`` holding a KV cache sharded over the SP group.

Each attention layer's entry is a :class:`ring_sp.decode.ShardedKVCache`: this rank's keys and
values ``[b, capacity, h_kv, d]`` (ring_sp's layout) at their global positions, 1/P of one
device's cache. transformers' attention layers call :meth:`RingSPCache.update` with their
new keys and values before attending:

* in the prefill (:mod:`.generation` cut the prompt into this rank's shard), ``update`` keeps the
  shard's keys and values (not the padding the cut added) and hands them back unchanged to the
  grid attention, which runs as in training;
* in a decode step ``update`` hands the new token back unchanged: the attention stores it on one
  rank and attends over every shard (:func:`ring_sp.decode.decode_attention`).

Lengths are global: :meth:`get_seq_length` is the number of tokens cached over all ranks, the
position of the next token, as transformers' ``generate()`` expects. Without ``max_cache_len``
each rank's storage grows by ``block`` tokens when a token is assigned to it full (one copy per
``block`` tokens it receives): a rank holds at most its share plus one block. A sliding-window
layer's entry keeps only the keys a later token can see (its share of the window, about; transformers'
``DynamicCache`` keeps the window's last tokens alike), read from the config as transformers does
(:func:`.features.layer_windows`); the attention's window must then be that one (else an error).

MLA layers (DeepSeek-V2/V3, Kimi, GLM-4-MoE-lite...) hand ``update`` their compressed latents
(``kv_nope`` ``[b, 1, c, kv_lora_rank]``, ``k_rot`` ``[b, 1, c, rope]``) and expand whatever it returns
into keys and values. The shards keep the latents (1/P of one rank's compressed cache); in a decode
step or chunk ``update`` stores the new latents on their owners and returns this rank's whole shard,
so each rank expands 1/P of the cache (transformers' ``DynamicCache`` expands all of it on one device)
and :func:`ring_sp.stored_attention` merges the ranks' partials (pass-Q).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ring_sp.chunk_prefill import EXCHANGES
from ring_sp.decode import ShardedKVCache

from .features import UnsupportedFeatureError


@dataclass(frozen=True)
class PrefillShard:
    """What this rank holds of a prompt being prefilled: ``keep`` (indices into its shard of the tokens
    that are the prompt's, not the cut's padding), their global ``positions`` (host), every SP group
    rank's cached ``counts`` and ``capacities`` afterwards (the same lists on every rank), and each
    layer's sliding ``windows`` (None: full attention; a sliding layer keeps only what its window sees)."""

    keep: torch.Tensor
    positions: torch.Tensor
    rank: int
    counts: list[int]
    capacities: list[int]
    grow_by: int
    windows: tuple[int | None, ...] = ()
    latent: frozenset[int] = frozenset()  # layers that cache MLA's compressed latents (see RingSPCache)
    row: int | None = None  # a padded batch: the row prefilled (each alone, into a cache of its own)

    def window(self, layer_idx: int) -> int | None:
        return self.windows[layer_idx] if layer_idx < len(self.windows) else None


class ShardedLayer(CacheLayerMixin):
    """One attention layer's entry of :class:`RingSPCache` (``shard``: None until the prefill)."""

    is_compileable = False  # a collective per call: never under generate()'s auto-compile

    def __init__(self) -> None:
        super().__init__()
        self.shard: ShardedKVCache | None = None
        self.latent = False  # MLA: the shard holds compressed latents, which the module expands (RingSPCache)
        self.piece = (0, 0)  # a latent layer: this rank's part of the newest tokens, stored by update()
        self.rows: list[ShardedKVCache] = []  # a padded batch: a cache per row, each prefilled alone
        self.offset = 0  # a padded batch: the first row's left padding (generate() counts it as cached)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def fill(self, key_states: torch.Tensor, value_states: torch.Tensor, prefill: PrefillShard,
             window: int | None = None, latent: bool = False) -> None:
        """Keep the prompt's keys/values ``[b, h_kv, n_shard, d]`` (transformers' layout) of this rank's shard
        (with a sliding ``window``, those a later token can see; ``latent``: MLA's latents in their place)."""
        k, v = (t.transpose(1, 2)[:, prefill.keep] for t in (key_states, value_states))  # -> [b, kept, h_kv, d]
        shard = ShardedKVCache.holding(k, v, prefill.positions, rank=prefill.rank, counts=prefill.counts,
                                       capacities=prefill.capacities, grow_by=prefill.grow_by, window=window)
        if prefill.row is None:
            self.shard = shard
        elif prefill.row == len(self.rows):
            self.rows.append(shard)
        else:
            raise RuntimeError(f"row {prefill.row} of a padded batch prefilled after {len(self.rows)} rows")
        self.latent = latent
        self.is_initialized = True

    def store(self, latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A latent layer's newest tokens (``[b, 1, c, r]`` each, transformers' layout) stored as the owner rule
        places them; returns this rank's whole shard ``[b, 1, held, r]``, which the module expands into its
        keys and values for the attention (:func:`ring_sp.stored_attention`)."""
        if self.shard is None:  # (the agreement refuses MLA with a padded batch: rows are not returned whole)
            raise UnsupportedFeatureError("an MLA layer's cache holds no single shard (a padded batch's rows)")
        shard, k, v = self.shard, latent.transpose(1, 2), rope.transpose(1, 2)
        if k.shape[1] == 1:
            owner = shard.next_owner()
            shard.append(k, v)
            self.piece = (0, int(owner == shard.rank))
        else:
            bounds = shard.append_chunk(k, v)
            self.piece = (bounds[shard.rank], bounds[shard.rank + 1])
        return shard.k[:, : shard.length].transpose(1, 2), shard.v[:, : shard.length].transpose(1, 2)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states

    def get_seq_length(self) -> int:
        """Tokens cached, as generate() counts them (a padded batch: the first row's, its padding included)."""
        if self.rows:
            return self.rows[0].total + self.offset
        return 0 if self.shard is None else self.shard.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        first = self.rows[0] if self.rows else self.shard
        return -1 if first is None or first.grow_by else sum(first.capacities) + self.offset

    @property
    def nbytes(self) -> int:
        return sum(shard.nbytes for shard in ([self.shard] if self.shard is not None else []) + self.rows)


class RingSPCache(Cache):
    """A KV cache sharded over the SP group of a ``"ring_sp"`` model, for ``model.generate``.

    ``model.generate(input_ids, past_key_values=RingSPCache(), ...)`` (or no ``past_key_values``:
    ``generate`` then makes one) on every rank of the SP group with the same prompt and
    arguments. ``max_cache_len``: the tokens the cache holds in all (prompt + new; a generation
    that would exceed it raises on every rank before the prefill); None: each rank grows by
    ``block`` tokens as needed. A second turn passes the cache of the first with the whole
    conversation: its new tokens attend to the cache by ``chunk_exchange`` (``"auto"``, ``"pass_q"``,
    ``"pass_kv"``: :func:`ring_sp.chunk_attention`), as do the chunks of ``prefill_chunk_size``.
    """

    is_ring_sp = True  # what the forward guard looks for (attention.py imports nothing of transformers)

    def __init__(self, max_cache_len: int | None = None, *, block: int = 256, chunk_exchange: str = "auto") -> None:
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len={max_cache_len!r} must be a positive int (tokens in all) or None (grow)")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block={block!r} must be a positive int (tokens a full rank grows by)")
        if chunk_exchange not in EXCHANGES:
            raise ValueError(f"chunk_exchange={chunk_exchange!r} must be one of {EXCHANGES}")
        super().__init__(layers=[])
        self.limit = max_cache_len  # (Cache has a read-only max_cache_len)
        self.block = block
        self.chunk_exchange = chunk_exchange  # many new tokens against the cache: ring_sp.chunk_attention's exchange
        self.prefill: PrefillShard | None = None  # set by .generation around the prefill's forward
        self.pads: list[int] | None = None  # a padded batch's left padding per row (set by .generation)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            self.layers.append(ShardedLayer())
        layer = self.layers[layer_idx]
        if self.prefill is not None:
            layer.fill(key_states, value_states, self.prefill, self.prefill.window(layer_idx),
                       layer_idx in self.prefill.latent)
            layer.offset = self.pads[0] if self.pads else 0
        elif layer.latent:  # MLA: the latents stored here, the shard's returned for the module to expand
            return layer.store(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # a prefill (a padded batch's second row, ...) sees no earlier token: its rows are cached apart
        return 0 if self.prefill is not None else super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return (query_length, 0) if self.prefill is not None else super().get_mask_sizes(query_length, layer_idx)

    def shard(self, layer_idx: int) -> ShardedKVCache:
        """Layer ``layer_idx``'s :class:`ring_sp.decode.ShardedKVCache` (after the prefill)."""
        shard = self.layers[layer_idx].shard if layer_idx < len(self.layers) else None
        if shard is None:
            raise RuntimeError(f"layer {layer_idx} of the RingSPCache holds no prefill: generate() fills it")
        return shard

    @property
    def batch_size(self) -> int:
        """Rows the cache holds (0 before the prefill)."""
        if not self.layers:
            return 0
        first = self.layers[0]
        if first.rows:
            return len(first.rows)
        return 0 if first.shard is None else first.shard.k.shape[0]

    @property
    def nbytes(self) -> int:
        """This rank's cache storage in bytes, every layer."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def is_compileable(self) -> bool:
        return False

    def _refuse(self, what: str) -> UnsupportedFeatureError:
        return UnsupportedFeatureError(f"RingSPCache cannot {what}: ring_sp generates with greedy or sampled decoding "
                                       f"(num_beams=1, no assistant model), one token per step")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise self._refuse("reorder its rows (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:  # DeferredStopCheck crops nothing (0) after a step
            raise self._refuse("crop tokens (assisted / speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise self._refuse("repeat its rows after the prefill")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise self._refuse("select rows (contrastive search)")


__all__ = ["PrefillShard", "RingSPCache", "ShardedLayer"]
