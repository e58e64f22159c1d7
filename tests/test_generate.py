"""``model.generate()`` on a ``"ring_sp"`` model over 4 SP ranks (issue 46): the prompt prefilled over the
grid into a KV cache sharded 1/P per rank, each token decoded against it.

The oracle is the same model (same weights) generating on one rank with transformers' own attention
(sdpa; eager for gpt-oss's sinks): every rank's tokens equal it, and every step's logits are within
1e-5 relative (fp32). Grids U2xR2, U1xR4 and R4 (U1xR4) with windows and sinks; greedy and seeded
sampling; the cache gathered over the ranks equals one rank's DynamicCache, each rank holding its
share. Bad input (another prompt, other arguments or seed on one rank, a cache too small, beam
search) is one clear error on every rank, before the prefill.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'ring-sp[transformers]')")

LOGITS_RTOL = 1e-5  # fp32, relative to the largest logit of the step


def _models(arch: str, **overrides: Any):
    from test_transformers import _models as models

    reference, model = models(arch, torch.float32, "from_config", max_position_embeddings=8192, **overrides)
    return reference.eval(), model.eval()


def _compare(expected: Any, got: Any) -> dict[str, Any]:
    """Tokens equal, and the worst step's logits error relative to that step's largest logit."""
    errors = [((a - b).abs().max() / a.abs().max()).item() for a, b in zip(expected.logits, got.logits)]
    return {"tokens_equal": torch.equal(expected.sequences, got.sequences), "steps": len(got.logits),
            "logits_rel": max(errors)}


def generate_case(arch: str, u: int, r: int, layout: str, prompt_len: int, new: int, sample: bool = False,
                  rows: int = 1, **overrides: Any) -> dict[str, Any]:
    """One grid's generate() against one rank's, the cache's bytes per rank and its gathered contents."""
    import torch.distributed as dist

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from transformers import DynamicCache, set_seed

    topo = dist_cases.topology(u, r)
    rsp_hf.register(topo, layout=layout)
    reference, model = _models(arch, **overrides)
    for m in (reference, model):
        m.generation_config.eos_token_id = None  # every step generated (a random model may emit eos early)
    # no pad token (0) inside the prompt: generate() would mask it as padding
    prompt = torch.randint(1, model.config.vocab_size, (rows, prompt_len), generator=torch.Generator().manual_seed(11))
    options = dict(max_new_tokens=new, do_sample=sample, output_logits=True, return_dict_in_generate=True,
                   pad_token_id=0, top_k=None, top_p=None)
    set_seed(5)
    ref_cache = DynamicCache(config=reference.config)
    expected = reference.generate(prompt, past_key_values=ref_cache, **options)
    set_seed(5)
    cache = rsp_hf.RingSPCache()
    got = model.generate(prompt, past_key_values=cache, **options)
    out = _compare(expected, got)
    out["cache_bytes"] = cache.nbytes
    total = prompt_len + new - 1  # cached tokens: the last generated one is never run through the model
    # one rank's DynamicCache: every token of a full layer, a sliding layer's last window - 1 (fp32)
    out["one_rank_bytes"] = sum((layer.keys.numel() + layer.values.numel()) * 4 for layer in ref_cache.layers)
    out["token_bytes"] = sum((cache.shard(i).k[:, 0].numel() + cache.shard(i).v[:, 0].numel()) * 4 + 8
                             for i in range(len(ref_cache.layers)))  # a token's keys, values and position, every layer
    # the shards gathered over the SP group hold one rank's cache (every layer, key and value, in position order;
    # a sliding layer's shards may hold more than its window, never less)
    worst = 0.0
    for i, layer in enumerate(ref_cache.layers):
        shard = cache.shard(i)
        mine = (shard.positions[: shard.length], shard.k[:, : shard.length], shard.v[:, : shard.length])
        every: list[Any] = [None] * topo.sp_size
        dist.all_gather_object(every, mine, group=topo.sp_group)
        positions = torch.cat([e[0] for e in every])
        order = positions.argsort()
        k = torch.cat([e[1] for e in every], dim=1)[:, order]
        v = torch.cat([e[2] for e in every], dim=1)[:, order]
        kept = layer.keys.shape[2]  # one rank's cache: every cached token, or a sliding layer's last ones
        held = positions[order]
        assert held.unique().numel() == len(held) and held[-1] == total - 1, held
        assert torch.equal(held[-kept:], torch.arange(total - kept, total)), (kept, held)
        worst = max(worst, (k[:, -kept:] - layer.keys.transpose(1, 2)).abs().max().item(),
                    (v[:, -kept:] - layer.values.transpose(1, 2)).abs().max().item())
    out["cache_error"] = worst
    out["counts"] = cache.shard(0).counts
    out["layers"] = len(ref_cache.layers)
    return out


def _check(results: list[dict[str, Any]], prompt_len: int, new: int, ranks: int = 4) -> None:
    for rank, res in enumerate(results):
        assert res["tokens_equal"], f"rank {rank}: {res}"
        assert res["steps"] == new and res["logits_rel"] < LOGITS_RTOL, f"rank {rank}: {res}"
        assert res["cache_error"] < 1e-5, f"rank {rank}: {res}"
        total = prompt_len + new - 1
        assert sum(res["counts"]) == total and max(res["counts"]) - min(res["counts"]) <= 2, res["counts"]
        # 1/P of one rank's cache + one growth block (256 tokens) + positions (int64 per slot, none on one rank)
        slots = total / ranks + 256
        assert res["cache_bytes"] <= res["one_rank_bytes"] / ranks + 256 * res["token_bytes"] \
            + slots * 8 * res["layers"], res
    alike = [{k: v for k, v in r.items() if k != "cache_bytes"} for r in results]  # (a window's shares differ)
    assert all(r == alike[0] for r in alike), results  # every rank alike


@pytest.mark.parametrize("u,r,layout", [(2, 2, "zigzag"), (1, 4, "contiguous")], ids=["U2xR2-zigzag", "U1xR4-contiguous"])
def test_greedy_generation_equals_one_rank(pools, u: int, r: int, layout: str) -> None:
    _check(pools.get(4).run(generate_case, "llama", u, r, layout, 4096, 64, timeout=300), 4096, 64)


@pytest.mark.parametrize("arch,u,r,layout,sample", [
    ("mistral", 1, 4, "zigzag", False),   # R4 with a sliding window across the shards
    ("gpt_oss", 2, 2, "zigzag", True),    # sinks, a sliding then a full layer; seeded sampling
    ("deepseek_v3", 2, 2, "zigzag", False),  # MLA: the shards keep the compressed latents
], ids=["mistral-window-U1xR4-greedy", "gpt_oss-sinks-window-U2xR2-sampled", "deepseek_v3-mla-U2xR2-greedy"])
def test_windows_sinks_and_sampling_equal_one_rank(pools, arch: str, u: int, r: int, layout: str, sample: bool) -> None:
    """The issue's size for R4 with windows (Mistral): a 4,096-token prompt, 64 new tokens, a window of 300 that
    the cache keeps per rank instead of the sequence; the others 1,000 + 24."""
    prompt, new = (4096, 64) if arch == "mistral" else (1000, 24)
    overrides = {"sliding_window": 300} if arch == "mistral" else {}
    _check(pools.get(4).run(generate_case, arch, u, r, layout, prompt, new, sample, 2, timeout=300, **overrides),
           prompt, new)


def padded_case(u: int, r: int, arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """Three prompts of 64, 37 and 20 tokens, left-padded into one batch: generate() over the grid equals one
    rank's batched generate(): greedy (the mask given, and inferred from pad_token_id), eos stopping one row,
    and seeded sampling with every step's logits."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from transformers import set_seed

    rsp_hf.register(dist_cases.topology(u, r))
    reference, model = _models(arch, **overrides)
    prompt = torch.randint(1, model.config.vocab_size, (3, 64), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    for row, length in ((1, 37), (2, 20)):
        prompt[row, : 64 - length], mask[row, : 64 - length] = 0, 0
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    for m in (reference, model):
        m.generation_config.eos_token_id = None
    expected = reference.generate(prompt, attention_mask=mask, **options)
    eos = int(expected[1, 64 + 2])  # row 1's third token: that row stops there, the others go on (unless they emit it)
    stopped = reference.generate(prompt, attention_mask=mask, eos_token_id=eos, **options)
    sampled = dict(max_new_tokens=8, do_sample=True, top_k=None, top_p=None, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
    set_seed(3)
    want = reference.generate(prompt, attention_mask=mask, **sampled)
    set_seed(3)
    got = model.generate(prompt, attention_mask=mask, **sampled)
    cache = rsp_hf.RingSPCache()  # given: the rows go into it (3 caches of their own per layer)
    equal = torch.equal(model.generate(prompt, attention_mask=mask, past_key_values=cache, **options), expected)
    return {"equal": equal and cache.batch_size == 3 and cache.nbytes > 0,
            "inferred_equal": torch.equal(model.generate(prompt, **options), expected),
            "eos_equal": torch.equal(model.generate(prompt, attention_mask=mask, eos_token_id=eos, **options), stopped),
            "eos_padded": bool((stopped[1, 64 + 3:] == 0).all()) and stopped.shape[1] > 64 + 3,
            "sampled": _compare(want, got)}


@pytest.mark.parametrize("u,r,arch", [(2, 2, "llama"), (1, 4, "gpt_oss")], ids=["U2xR2", "gpt_oss-sinks-window-U1xR4"])
def test_prompts_of_different_lengths_equal_one_rank(pools, u: int, r: int, arch: str) -> None:
    """Each row prefilled alone, the batch decoded as one (one all-gather per layer for every row)."""
    for rank, res in enumerate(pools.get(4).run(padded_case, u, r, arch, timeout=300)):
        sampled = res.pop("sampled")
        assert res == {"equal": True, "inferred_equal": True, "eos_equal": True, "eos_padded": True}, (rank, res)
        assert sampled["tokens_equal"] and sampled["logits_rel"] < LOGITS_RTOL, (rank, sampled)


def second_turn_case(exchange: str, arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """U2xR2: a 300-token prompt prefilled in chunks of 128 (prefill_chunk_size), 8 tokens generated, then a
    second turn (the conversation + 40 new tokens) against the same cache, 8 more: against one rank's
    DynamicCache prefilling the prompt at once, then the same second turn, tokens equal and every step's
    logits within 1e-5."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from transformers import DynamicCache

    rsp_hf.register(dist_cases.topology(2, 2))
    reference, model = _models(arch, **overrides)
    for m in (reference, model):
        m.generation_config.eos_token_id = None
    prompt = torch.randint(1, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(8))
    turn = torch.randint(1, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(9))
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    results = {}
    for name, m, cache, chunks in (("reference", reference, DynamicCache(config=reference.config), {}),
                                   ("sp", model, rsp_hf.RingSPCache(chunk_exchange=exchange), {"prefill_chunk_size": 128})):
        first = m.generate(prompt, past_key_values=cache, **chunks, **options)
        second = m.generate(torch.cat([first.sequences, turn], dim=1), past_key_values=cache, **options)
        results[name] = (first, second, cache.get_seq_length())
    (ref_first, ref_second, ref_len), (first, second, length) = results["reference"], results["sp"]
    return {"first": _compare(ref_first, first), "second": _compare(ref_second, second), "cached": (length, ref_len)}


@pytest.mark.parametrize("exchange,arch,overrides", [
    ("pass_q", "llama", {}),
    ("pass_kv", "llama", {}),
    ("auto", "mistral", {"sliding_window": 100}),  # the window's edge inside the zigzag shards: pass-Q by bands
    ("auto", "deepseek_v3", {}),  # MLA's latents: each rank expands its shard, stored_attention
], ids=["pass_q", "pass_kv", "mistral-window-auto", "deepseek_v3-mla-auto"])
def test_chunked_prefill_and_a_second_turn_equal_one_rank(pools, exchange: str, arch: str, overrides: dict) -> None:
    for rank, res in enumerate(pools.get(4).run(second_turn_case, exchange, arch, timeout=300, **overrides)):
        for turn in ("first", "second"):
            assert res[turn]["tokens_equal"] and res[turn]["logits_rel"] < LOGITS_RTOL, (rank, turn, res)
        assert res["cached"][0] == res["cached"][1] == 300 + 8 + 40 + 7, (rank, res["cached"])


def other_cache_case() -> str:
    """A second turn where rank 3 passes a fresh RingSPCache instead of the first turn's: the error every rank raises."""
    import torch.distributed as dist

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    rsp_hf.register(dist_cases.topology(2, 2))
    _, model = _models("llama")
    prompt = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = rsp_hf.RingSPCache()
    first = model.generate(prompt, max_new_tokens=4, pad_token_id=0, past_key_values=cache)
    if dist.get_rank() == 3:
        cache = rsp_hf.RingSPCache()
    try:
        model.generate(torch.cat([first, prompt[:, :5]], dim=1), max_new_tokens=2, pad_token_id=0, past_key_values=cache)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_second_turn_with_another_cache_on_one_rank_is_one_error(pools) -> None:
    for rank, error in enumerate(pools.get(4).run(other_cache_case, timeout=120)):
        assert re.search(r"rank\(s\) \[3\].*cached tokens", error, re.S), f"rank {rank}: {error}"


def mla_pass_kv_case() -> str:
    """A chunk against an MLA model's cache with chunk_exchange="pass_kv": the error every rank raises."""
    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf

    rsp_hf.register(dist_cases.topology(2, 2))
    _, model = _models("deepseek_v3")
    prompt = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    try:
        model.generate(prompt, max_new_tokens=2, pad_token_id=0, prefill_chunk_size=16,
                       past_key_values=rsp_hf.RingSPCache(chunk_exchange="pass_kv"))
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_pass_kv_on_an_mla_cache_is_one_error(pools) -> None:
    for rank, error in enumerate(pools.get(4).run(mla_pass_kv_case, timeout=120)):
        assert "an MLA layer's cache (compressed latents) attends by pass-Q" in error \
            and "chunk_exchange='pass_kv'" in error, f"rank {rank}: {error}"


def test_malformed_padding_masks_and_callback_arguments_are_named() -> None:
    """What a user builds by hand, checked without ranks: masks that are not left padding (a hole, a row of
    padding only, padding on the right) and GenerationCallback's prompts and interval."""
    from ring_sp.integrations.transformers.generation_callback import GenerationCallback
    from ring_sp.integrations.transformers.padded_prompts import left_pads

    assert left_pads(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])) == [2, 1]
    for bad in ([[1, 0, 1, 1]], [[0, 0, 0, 0], [1, 1, 1, 1]], [[1, 1, 1, 0]]):
        assert left_pads(torch.tensor(bad)) is None, bad
    with pytest.raises(ValueError, match=r"prompts must be token ids \[batch, prompt\]; got Tensor \(2, 3\)"):
        GenerationCallback(torch.zeros(2, 3), every=1)
    with pytest.raises(ValueError, match="every=0 must be a positive int"):
        GenerationCallback(torch.ones(2, 3, dtype=torch.long), every=0)


def bad_generation_case(what: str) -> str:
    """One bad input on one rank or every rank: the error every rank raises (or "no error")."""
    import torch.distributed as dist

    import dist_cases
    import ring_sp.integrations.transformers as rsp_hf
    from transformers import set_seed

    topo = dist_cases.topology(2, 2)
    rsp_hf.register(topo)
    _, model = _models("llama")
    rank = dist.get_rank()
    prompt = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    options: dict[str, Any] = dict(max_new_tokens=4, pad_token_id=0)
    set_seed(1)
    if what == "prompt" and rank == 2:
        prompt = prompt.flip(1)
    if what == "arguments" and rank == 1:
        options["max_new_tokens"] = 5
    if what == "seed":
        options["do_sample"] = True
        set_seed(rank)
    if what in ("small_cache", "exact_cache"):  # the prompt's 40 tokens and 4 new ones (the last one not cached)
        options["past_key_values"] = rsp_hf.RingSPCache(max_cache_len=43 if what == "small_cache" else 44)
    if what == "beams":
        options["num_beams"] = 2
    if what == "pad_in_prompt":
        prompt[0, 7] = 0
    if what == "mask_one_rank" and rank == 3:  # a padding mask given on one rank only
        options["attention_mask"] = torch.ones_like(prompt).index_fill_(1, torch.tensor([0]), 0)
    if what in ("right_padding", "chunked_padding"):
        options["attention_mask"] = torch.ones_like(prompt).index_fill_(1, torch.tensor([39 if what == "right_padding" else 0]), 0)
    if what == "chunked_padding":
        options["prefill_chunk_size"] = 16
    if what == "hidden_states":
        options.update(output_hidden_states=True, return_dict_in_generate=True)
    try:
        model.generate(prompt, **options)
    except (ValueError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("what,pattern", [
    ("prompt", r"rank\(s\) \[2\].*generate\(input_ids \(1, 40\), prompt checksum"),
    ("arguments", r"rank\(s\) \[1\].*arguments checksum"),
    ("seed", r"random state .*seed every rank alike"),
    ("small_cache", r"need 44 cached tokens, but RingSPCache\(max_cache_len=43\)"),
    ("exact_cache", r"^no error$"),  # fixed capacities (where the owner rule puts every token) hold it exactly
    ("beams", r"beam search \(num_beams=2\) cannot run exactly.*num_beams=1"),
    ("mask_one_rank", r"rank\(s\) \[3\].*padding mask checksum"),
    ("pad_in_prompt", r"attention_mask \(1, 40\) is not left padding .*pad_token_id inside the prompt"),
    ("right_padding", r"attention_mask \(1, 40\) is not left padding"),
    ("chunked_padding", r"left padding\) on SP ranks cannot run prefill_chunk_size"),
    ("hidden_states", r"output_hidden_states \(the prefill's hidden states are sharded"),
])
def test_bad_generation_input_is_one_error_on_every_rank(pools, what: str, pattern: str) -> None:
    for rank, error in enumerate(pools.get(4).run(bad_generation_case, what, timeout=120)):
        assert re.search(pattern, error, re.S), f"rank {rank}: {error}"
