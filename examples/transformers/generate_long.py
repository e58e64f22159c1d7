"""Generate from a long prompt with a Hugging Face Llama trained under ring_sp: ``model.generate()`` over the grid.

The model of ``pretrain_llama.py`` trains ``--steps`` steps under SP (U2 x R2 by default; or
``--load DIR`` takes a ``save_pretrained`` checkpoint), then every rank calls
``model.generate(prompt, past_key_values=rsp_hf.RingSPCache(), ...)`` with the same held-out
prompt of ``--prompt-len`` tokens: the prompt is prefilled over the grid into a KV cache
sharded over the SP ranks (each holds 1/P of it), and each new token is decoded against it
(one all-gather of partial results per layer). Run it with the launcher::

    examples/transformers/generate_long.sh --cpu                        # 4 CPU ranks: train 20 steps, generate
    examples/transformers/generate_long.sh --cpu --prompt-len 16384 --steps 0 --sample

Rank 0 prints, side by side with the same weights generating on one rank with transformers'
sdpa attention (``--no-check`` skips it): the tokens (equal, or the run fails), prefill time,
decode ms per token and tokens/s, the share of a decode step spent in its all-gathers
(measured apart: the same messages, timed alone), and KV-cache bytes per rank against one
rank's. ``--log-json``: one JSON object with those figures on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for examples.*

import ring_sp.integrations.transformers as rsp_hf  # noqa: E402
from examples.common.data import corpus_tokens, split_corpus  # noqa: E402
from examples.transformers.pretrain_llama import parse_args as training_args, train  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    p.add_argument("--prompt-len", type=int, default=4096, help="tokens of held-out text in the prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens")
    p.add_argument("--sample", action="store_true", help="do_sample=True (seeded alike on every rank)")
    p.add_argument("--load", metavar="DIR", help="generate from this save_pretrained checkpoint instead of training")
    p.add_argument("--no-check", action="store_true", help="skip the one-rank generate() (and its timings)")
    ours, rest = p.parse_known_args(argv)
    args = training_args(rest + (["--steps", "20"] if "--steps" not in rest else []))
    return argparse.Namespace(**vars(args), **vars(ours))


def timed_generate(model: torch.nn.Module, prompt: torch.Tensor, options: dict, cache_factory) -> tuple:
    """(output, prefill s, decode s per token, cache): a prefill-only call (one new token), then the full one."""
    def run(new: int) -> tuple:
        torch.manual_seed(1234)  # sampling draws alike on every rank (and in the one-rank run)
        cache = cache_factory()
        start = time.perf_counter()
        out = model.generate(prompt, past_key_values=cache, **{**options, "max_new_tokens": new})
        return out, time.perf_counter() - start, cache

    _, prefill, _ = run(1)
    out, total, cache = run(options["max_new_tokens"])
    return out, prefill, (total - prefill) / max(options["max_new_tokens"] - 1, 1), cache


def head_dim(config: object) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def all_gather_seconds(model: torch.nn.Module, group: dist.ProcessGroup, rows: int, repeats: int = 50) -> float:
    """One decode step's all-gathers, timed alone: every layer's message (partial out + lse + stamps, fp32)."""
    config = model.config
    numel = rows * config.num_attention_heads * (head_dim(config) + 1) + rows + 2
    mine = torch.zeros(numel)
    out = torch.empty(numel * dist.get_world_size(group))
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather_into_tensor(out, mine, group=group)
    return (time.perf_counter() - start) / repeats * config.num_hidden_layers


def kv_bytes_per_token(model: torch.nn.Module, rows: int) -> int:
    """One rank's KV cache bytes per token (every layer's keys and values, the model's dtype)."""
    config = model.config
    element = next(model.parameters()).element_size()
    return rows * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim(config) * element


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.load:
        args.steps = 0
    engine, topology = train(args)  # with --steps 0: the engine and groups, no step
    if topology is None:
        raise SystemExit("generate_long.py shows generation over SP ranks: drop --no-ring-sp")
    model = engine.module.eval()
    if args.load:
        model.load_state_dict(AutoModelForCausalLM.from_pretrained(args.load).state_dict())
    model.generation_config.pad_token_id = 0  # byte 0 never occurs in the text
    # RoPE's default rotation runs at any position: generate past the training length without transformers' warning
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, args.prompt_len + args.new_tokens)
    model.generation_config.eos_token_id = None  # generate every token asked for
    held_out = split_corpus(corpus_tokens(args.corpus_bytes))[1]
    if held_out.numel() < args.prompt_len:
        raise SystemExit(f"--prompt-len {args.prompt_len} is longer than the held-out text ({held_out.numel()} bytes); "
                         f"raise --corpus-bytes")
    prompt = held_out[: args.prompt_len].unsqueeze(0)
    # use_cache: the training config says False (no cache while training)
    options = dict(max_new_tokens=args.new_tokens, do_sample=args.sample, top_k=None, top_p=None, use_cache=True)
    with torch.no_grad():
        out, prefill, per_token, cache = timed_generate(model, prompt, options, rsp_hf.RingSPCache)
        comm = all_gather_seconds(model, topology.sp_group, prompt.shape[0])
    row = {"grid": f"U{topology.ulysses_size}xR{topology.ring_size}", "prompt_tokens": args.prompt_len,
           "new_tokens": out.shape[1] - args.prompt_len, "prefill_s": round(prefill, 3),
           "decode_ms_per_token": round(per_token * 1e3, 2), "decode_tokens_per_s": round(1 / per_token, 1),
           "all_gather_share": round(comm / per_token, 3), "cache_bytes_this_rank": cache.nbytes,
           "cache_bytes_one_rank": kv_bytes_per_token(model, prompt.shape[0]) * (out.shape[1] - 1)}
    dist.barrier()
    if dist.get_rank() == 0 and not args.no_check:
        one = copy.deepcopy(model)
        one.set_attn_implementation("sdpa")  # the same weights on one rank, transformers' own attention
        with torch.no_grad():
            expected, one_prefill, one_token, _ = timed_generate(one, prompt, options, DynamicCache)
        row.update(tokens_equal_one_rank=bool(torch.equal(out, expected)), one_rank_prefill_s=round(one_prefill, 3),
                   one_rank_decode_ms_per_token=round(one_token * 1e3, 2))
    dist.barrier()
    if dist.get_rank() == 0:
        text = bytes(out[0, args.prompt_len:].tolist()).decode("utf-8", errors="replace")
        print(f"prompt ...{bytes(prompt[0, -60:].tolist()).decode('utf-8', errors='replace')!r}\n"
              f"generated {text!r}", file=sys.stderr)
        print(json.dumps(row) if args.log_json else "\n".join(f"{k}: {v}" for k, v in row.items()))
        if row.get("tokens_equal_one_rank") is False:
            raise SystemExit("the SP ranks generated other tokens than one rank: a bug, please report it")


if __name__ == "__main__":
    main()
