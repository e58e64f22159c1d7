"""``model.generate()`` on a ``"ring_sp"`` model over the SP group: prefill over the grid, decode over a sharded cache.

Every rank of the SP group calls ``generate`` with the same prompt ``[b, n]`` and arguments
(and, to sample, the same seed). Then:

1. **Agreement** (:func:`generate_together`, before any other collective): what cannot be exact
   is refused by name on every rank (beam search, assisted/speculative decoding, contrastive
   search, DoLa, a mask that is not left padding, a cache that is not a
   :class:`.kv_cache.RingSPCache`); the prompt, the generation arguments, the cache's size and
   cached length, the padding mask and, when sampling, the random state are compared across
   ranks in one small all-gather. Prompts of different lengths (left padding) are prefilled row by
   row, each into a cache of its own, and decoded as one batch (:mod:`.padded_prompts`).
2. **Prefill** (:func:`cached_forward`, the first forward, cache empty): the prompt, right-padded
   to the layout's unit (causal attention never lets a prompt token see the padding), is cut
   into this rank's shard (:func:`ring_sp.shard_batch`, positions the attention checks) and runs through the model as in training:
   the grid attention (ring, Ulysses or both, any layout), with each layer's keys and values
   kept in the cache (1/P of them per rank, the padding dropped). Only the last prompt token's
   logits are computed, on the rank holding it, and broadcast to the group.
3. **Decode** (each later forward, one token): every rank runs the token through the model
   alike; each attention layer stores its key/value on one rank (the fewest cached) and attends
   over every rank's shard in one all-gather of partial results, merged in fp32
   (:func:`ring_sp.decode.decode_attention`), which also compares the step's token ids: ranks
   that sampled differently raise together. A forward of many tokens against the cache (the
   chunks of ``prefill_chunk_size`` after the first, a second turn's new tokens) runs the same
   way through :func:`ring_sp.chunk_attention` (pass-Q or pass-KV: the cache's ``chunk_exchange``).
4. The generated sequences are compared once more after the last token.

Every rank returns the same tokens, equal to one device's ``generate()`` (tested token for
token, with every step's logits).
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ring_sp.agreement import CallSignature, raise_together
from ring_sp.data import shard_batch, token_checksum
from ring_sp.chunk_prefill import chunk_attention, stored_attention
from ring_sp.decode import decode_attention, decode_rows, final_counts
from ring_sp.layouts import padded_length

from .features import UnsupportedFeatureError, latent_layers, layer_windows, model_name, ring_sp_call_options
from .kv_cache import PrefillShard, RingSPCache
from .padded_prompts import left_pads, padding_error, prompt_mask

# generate()'s arguments that would need other than one token per step on every rank alike: (test, what, fix)
_REFUSED: tuple[tuple[Callable[[Any], bool], str, str], ...] = (
    (lambda c: (c.num_beams or 1) > 1, "beam search (num_beams={0.num_beams})", "num_beams=1 (greedy or do_sample=True)"),
    (lambda c: getattr(c, "prompt_lookup_num_tokens", None) is not None, "prompt-lookup (speculative) decoding",
     "drop prompt_lookup_num_tokens"),
    (lambda c: getattr(c, "penalty_alpha", None) is not None, "contrastive search (penalty_alpha)", "drop penalty_alpha"),
    (lambda c: getattr(c, "dola_layers", None) is not None, "DoLa decoding (dola_layers)", "drop dola_layers"),
    (lambda c: bool(getattr(c, "output_attentions", False)), "output_attentions (ring attention keeps no weights)",
     "drop output_attentions"),
    (lambda c: bool(getattr(c, "output_hidden_states", False)),
     "output_hidden_states (the prefill's hidden states are sharded over the ranks)", "drop output_hidden_states"),
)
_SPECULATIVE = ("assistant_model", "assistant_tokenizer", "custom_generate", "inputs_embeds")


@dataclass(frozen=True)
class _Decoding:
    cache: RingSPCache
    tokens: torch.Tensor  # the step's token ids [b, c], compared across ranks in every layer's all-gather


_DECODING: ContextVar[_Decoding | None] = ContextVar("ring_sp_decoding", default=None)


def decoding() -> bool:
    """Whether a decode step's forward is running (the mask hook then builds no mask)."""
    return _DECODING.get() is not None


def _config(model: Any, kwargs: dict[str, Any]) -> Any:
    """generate()'s resolved GenerationConfig (the model's, or the one given, updated with the keyword arguments)."""
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
    return config


def _local_error(model: Any, prompt: Any, config: Any, kwargs: dict[str, Any]) -> Exception | None:
    """This rank's reason to refuse the call, found without communication (None: none)."""
    where = model_name(getattr(model, "config", None))
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.is_floating_point():
        return ValueError(f"{where}: generate() on SP ranks needs input_ids [batch, prompt] (token ids); got "
                          f"{type(prompt).__name__} {tuple(getattr(prompt, 'shape', ()))}")
    for name in _SPECULATIVE:
        if kwargs.get(name) is not None:
            return UnsupportedFeatureError(f"{where}: generate({name}=...) is not supported on SP ranks (ring_sp decodes "
                                           f"one token at a time from input_ids, on every rank alike); drop {name}")
    for refused, what, fix in _REFUSED:
        if refused(config):
            return UnsupportedFeatureError(f"{where}: {what.format(config)} cannot run exactly over a sharded KV cache "
                                           f"in ring_sp; {fix}")
    padding = padding_error(where, prompt_mask(prompt, kwargs.get("attention_mask"), config), config, kwargs,
                            bool(latent_layers(model)))
    if padding is not None:  # a mask given is each rank's own: agreed below when it is valid
        return padding
    cache = kwargs.get("past_key_values")
    if cache is not None and not isinstance(cache, RingSPCache):
        return TypeError(f"{where}: past_key_values must be a ring_sp RingSPCache on SP ranks (each rank holds its shard "
                         f"of the cache); got {type(cache).__name__}")
    if cache is not None and cache.get_seq_length() >= prompt.shape[1]:
        return ValueError(f"{where}: past_key_values holds {cache.get_seq_length()} tokens, the prompt {prompt.shape[1]}: "
                          f"a second turn passes the whole conversation (the cached tokens and the new ones)")
    if cache is not None and cache.get_seq_length() and prompt.shape[0] != cache.batch_size:
        return ValueError(f"{where}: past_key_values holds {cache.batch_size} rows, the prompt {prompt.shape[0]}")
    limit = None if cache is None else cache.limit
    wanted = prompt.shape[1] + (config.max_new_tokens if config.max_new_tokens is not None else
                                max(config.max_length - prompt.shape[1], 0))
    if limit is not None and wanted > limit:
        return ValueError(f"{where}: the prompt of {prompt.shape[1]} tokens and up to {wanted - prompt.shape[1]} new ones "
                          f"need {wanted} cached tokens, but RingSPCache(max_cache_len={limit}); size it for "
                          f"prompt + max_new_tokens")
    return None


def _padding_error(where: str, mask: Any) -> UnsupportedFeatureError | None:
    """The error of a prefill's attention_mask with zeros (None without one): made by ``generate()``
    from a ``pad_token_id`` inside a prompt the agreement let through (it strips left padding)."""
    if mask is None or bool(torch.as_tensor(mask).all()):
        return None
    return UnsupportedFeatureError(f"{where}: the prefill's attention_mask has zeros (pad_token_id inside the prompt, "
                                   f"which generate() masks out) and ring_sp does not mask keys; pad prompts on the "
                                   f"left only, with a pad_token_id the prompts do not contain")


def _arguments_code(config: Any, kwargs: dict[str, Any]) -> int:
    """A checksum of what decides the tokens besides the prompt: the resolved generation config and
    the other scalar arguments (crc32: the same in every process, unlike hash())."""
    scalars = sorted((k, repr(v)) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str, type(None))))
    return zlib.crc32(f"{config.to_json_string(use_diff=False)}{scalars}".encode())


def _random_code(device: torch.device) -> int:
    """A checksum of the random state sampling draws from on ``device``."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return zlib.crc32(state.numpy().tobytes())


def agree_to_generate(model: Any, topology: Any, args: tuple,
                      kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any, torch.Tensor | None]:
    """The agreement of ``generate(model, *args, **kwargs)`` on every rank of ``topology``'s SP group
    (what cannot be exact refused by name; prompt, arguments, cache size and length, padding mask and,
    to sample, the random state compared; one error on every rank), before any other collective.
    Returns the keyword arguments with the prompt as ``input_ids``, the resolved GenerationConfig and
    the prompt's padding mask (None: no padding)."""
    kwargs = dict(kwargs)
    if args:
        kwargs.setdefault("input_ids", args[0])
    prompt = kwargs.get("input_ids", kwargs.get("inputs"))
    config = _config(model, {k: v for k, v in kwargs.items() if k not in ("input_ids", "inputs")})
    error = _local_error(model, prompt, config, kwargs)
    valid = error is None
    dims = tuple(prompt.shape) if valid else (-1, -1)
    mask = prompt_mask(prompt, kwargs.get("attention_mask"), config) if valid else None
    values = (*dims, int(token_checksum(prompt)) if valid else -1, _arguments_code(config, kwargs),
              _random_code(prompt.device) if valid and config.do_sample else -1,
              -1 if kwargs.get("past_key_values") is None else (kwargs["past_key_values"].limit or 0),
              -1 if mask is None else int(token_checksum(mask)),
              -1 if kwargs.get("past_key_values") is None else kwargs["past_key_values"].get_seq_length())
    text = (f"generate(input_ids {dims}, prompt checksum {values[2]}, arguments checksum {values[3]}, random state "
            f"{values[4]} (seed every rank alike to sample), max_cache_len {values[5]}, padding mask checksum "
            f"{values[6]}, cached tokens {values[7]})")
    raise_together(topology.sp_group, CallSignature.named("generate", values, text), error, validate=True,
                   device=prompt.device if valid else torch.device("cpu"))
    return kwargs, config, mask


def generate_together(generate: Callable[..., Any], model: Any, topology: Any, args: tuple,
                      kwargs: dict[str, Any]) -> Any:
    """``generate(model, *args, **kwargs)`` on every rank of ``topology``'s SP group (see the module)."""
    kwargs, _, mask = agree_to_generate(model, topology, args, kwargs)
    if mask is not None:  # prompts of different lengths: each row prefilled alone, decoded as a batch (.padded_prompts)
        if kwargs.get("past_key_values") is None:  # (not `or`: an empty Cache has len() 0)
            kwargs["past_key_values"] = RingSPCache()
        kwargs["past_key_values"].pads = left_pads(mask)
    return _generate_on_sp_ranks(generate, model, topology, kwargs)


def _generate_on_sp_ranks(generate: Callable[..., Any], model: Any, topology: Any, kwargs: dict[str, Any]) -> Any:
    """``generate(model, **kwargs)`` (agreed, no padding) with the cache sharded over the SP ranks; the
    sequences compared across the ranks at the end."""
    kwargs = dict(kwargs)
    kwargs.setdefault("past_key_values", RingSPCache())
    kwargs["use_cache"] = True  # a model configured use_cache=False (training) would re-run the whole sequence
    out = generate(model, **kwargs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    mine = torch.stack([token_checksum(sequences), torch.tensor(sequences.shape[1], device=sequences.device)])
    every = [torch.empty_like(mine) for _ in range(topology.sp_size)]
    dist.all_gather(every, mine, group=topology.sp_group)
    if any(not torch.equal(e, every[0]) for e in every):
        raise RuntimeError(f"the SP ranks generated different sequences (checksum, length per rank: "
                           f"{[e.tolist() for e in every]}); seed every rank alike and pass the same arguments")
    return out


@contextmanager
def _prefilling(cache: RingSPCache, prefill: PrefillShard) -> Iterator[None]:
    cache.prefill = prefill
    try:
        yield
    finally:
        cache.prefill = None


def _prefill_shard(cache: RingSPCache, topology: Any, n: int, positions: torch.Tensor, windows: list[int | None],
                   latent: frozenset[int], row: int | None) -> tuple[PrefillShard, int]:
    """What this rank keeps of a prompt of ``n`` tokens whose shard holds ``positions`` (global, host or
    device; the padding's >= n), and the SP group rank holding the prompt's last token; ``windows``: each
    layer's sliding window (its cache keeps what the window can see); ``latent``: the MLA layers. One
    all-gather of two numbers per rank (any layout, ``auto`` included, without recomputing the cut)."""
    group = topology.sp_group
    positions = positions.cpu()
    keep = (positions < n).nonzero().flatten()
    mine = torch.tensor([keep.numel(), int(bool((positions == n - 1).any()))])
    every = torch.empty(topology.sp_size * 2, dtype=torch.int64)
    dist.all_gather_into_tensor(every, mine, group=group)
    counts, holds_last = every.view(-1, 2).T.tolist()
    if cache.limit is None:
        capacities, grow_by = counts, cache.block
    else:
        capacities, grow_by = final_counts(counts, cache.limit), 0
    return (PrefillShard(keep, positions[keep], dist.get_rank(group), counts, capacities, grow_by, tuple(windows),
                         latent, row), holds_last.index(1))


def cached_forward(call: Callable[..., Any], model: Any, registration: Any, kwargs: dict[str, Any]) -> Any:
    """One forward of ``generate()`` on a :class:`RingSPCache`: the prefill over the grid, or a decode step."""
    cache: RingSPCache = kwargs["past_key_values"]
    ids = kwargs.get("input_ids")
    where = model_name(getattr(model, "config", None))
    if ids is None:
        raise UnsupportedFeatureError(f"{where}: a forward on a RingSPCache needs input_ids (inputs_embeds are not cut)")
    if cache.get_seq_length():  # a decode step, or a chunk (prefill_chunk_size, a second turn) against the cache
        token = _DECODING.set(_Decoding(cache, ids))
        try:
            return call(**kwargs)
        finally:
            _DECODING.reset(token)
    mask = kwargs.get("attention_mask")
    if cache.pads is not None:  # a padded batch (agreed: left padding): each row prefilled alone, its own cache
        if mask is None or left_pads(torch.as_tensor(mask)) != cache.pads:
            raise UnsupportedFeatureError(f"{where}: the prefill's attention_mask is not the padding generate() agreed "
                                          f"on ({cache.pads} per row)")
        layers = (layer_windows(model.config), latent_layers(model))  # read once for every row
        outs = [_prefill(call, registration, kwargs, ids[row:row + 1, pad:], cache, layers, row)
                for row, pad in enumerate(cache.pads)]
        outs[-1].logits = torch.cat([out.logits for out in outs])
        return outs[-1]
    padding = _padding_error(where, mask)  # generate()'s mask: from the agreed prompt
    if padding is not None:
        raise padding
    return _prefill(call, registration, kwargs, ids, cache, (layer_windows(model.config), latent_layers(model)))


def _prefill(call: Callable[..., Any], registration: Any, kwargs: dict[str, Any], ids: torch.Tensor,
             cache: RingSPCache, layers: tuple[list[int | None], frozenset[int]], row: int | None = None) -> Any:
    """The prompt ``ids`` ``[b, n]`` (no padding) through the grid into ``cache`` (``layers``: each layer's window
    and the MLA layers; ``row``: of a padded batch); the output with the last token's logits ``[b, 1, vocab]``
    on every rank."""
    topology, layout = registration.topology, registration.layout
    b, n = ids.shape
    padded = padded_length(n, "zigzag" if layout in ("auto", "document_zigzag") else layout, topology.sp_size)
    full = torch.cat([ids, ids.new_zeros(b, padded - n)], dim=1)  # never seen by the prompt's tokens (causal)
    # the prompt's shard as the attention takes it (checked there: exactly the layout's positions for this rank)
    shard = shard_batch({"input_ids": full}, rank=topology.sp_rank, world_size=topology.sp_size, layout=layout,
                        shift=False)
    shard.pop("labels")
    positions = shard["position_ids"][0]
    prefill, owner = _prefill_shard(cache, topology, n, positions, *layers, row)
    last = (positions == n - 1).nonzero().flatten()  # the prompt's last token, on the owner
    index = torch.tensor([int(last[0]) if last.numel() else 0], device=ids.device)
    rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "position_ids", "cache_position",
                                                         "logits_to_keep")}
    with _prefilling(cache, prefill):
        out = call(**rest, **shard, **({"logits_to_keep": index} if "logits_to_keep" in kwargs else {}))
    logits = (out.logits if "logits_to_keep" in kwargs else out.logits[:, index]).contiguous()
    dist.broadcast(logits, src=dist.get_global_rank(topology.sp_group, owner), group=topology.sp_group)
    out.logits = logits
    out.past_key_values = cache
    return out


def decode_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kwargs: dict[str, Any], registration: Any) -> torch.Tensor:
    """A decode step's attention layer: the new token (or a chunk's ``c``) against every rank's shard
    -> ``[b, c, h, d_v]`` (:func:`ring_sp.decode_attention`, :func:`ring_sp.chunk_attention`)."""
    state = _DECODING.get()
    # (keys passed as the queries: the options' length check is the training forward's; here an MLA layer's keys
    # are this rank's whole shard, checked by stored_attention)
    options = ring_sp_call_options(module, query, query, None, kwargs, layout=registration.layout,
                                   backend=registration.backend)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # HF [b, h, c, d] -> ring_sp [b, c, h, d]
    layer = state.cache.layers[module.layer_idx]
    if layer.rows:  # a padded batch: each row against its own cache, one all-gather for the batch
        if q.shape[1] != 1:
            raise UnsupportedFeatureError(f"{model_name(module.config)}: {q.shape[1]} new tokens per row against a "
                                          f"padded batch's cache (a second turn, prefill_chunk_size); one per step")
        return decode_rows(q, k, v, layer.rows, group=registration.topology.sp_group, scale=options["softmax_scale"],
                           window=options["sliding_window"], sinks=options["sinks"], backend=registration.backend,
                           agree=state.tokens)
    if layer.latent:  # MLA: k/v are this rank's whole shard, expanded from the latents update() stored
        if options["sliding_window"] is not None or (q.shape[1] > 1 and state.cache.chunk_exchange == "pass_kv"):
            raise UnsupportedFeatureError(
                f"{model_name(module.config)}: an MLA layer's cache (compressed latents) attends by pass-Q without a "
                f"window; got window={options['sliding_window']}, chunk_exchange={state.cache.chunk_exchange!r} "
                f"(use RingSPCache(chunk_exchange='auto') or 'pass_q')")
        return stored_attention(q, k, v, layer.shard, layer.piece, group=registration.topology.sp_group,
                                scale=options["softmax_scale"], sinks=options["sinks"], backend=registration.backend,
                                agree=state.tokens)
    attend = decode_attention if q.shape[1] == 1 else partial(chunk_attention, exchange=state.cache.chunk_exchange)
    return attend(q, k, v, state.cache.shard(module.layer_idx), group=registration.topology.sp_group,
                  scale=options["softmax_scale"], window=options["sliding_window"], sinks=options["sinks"],
                  backend=registration.backend, agree=state.tokens)


__all__ = ["agree_to_generate", "cached_forward", "decode_call", "decoding", "generate_together"]
