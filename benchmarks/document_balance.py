"""Packed documents: padding overhead and per-rank causal work of every layout.

For three document-length mixes and several SP sizes ``P``, prints two markdown tables:

* padding overhead (padded tokens / real tokens): TransformerEngine's THD rule (every
  document padded to a multiple of ``2P``, which ``document_zigzag`` needed before issue
  14 and Megatron's THD RoPE still needs) against ring_sp's layouts, which pad only the
  END of the whole sequence to a multiple of the layout's unit (``layout_unit``: fewer
  than ``2P`` tokens for zigzag, ``P`` for the others);
* causal work max/mean over the ranks (1.00 = balanced): the (query, key) pairs a rank
  computes, i.e. for each of its tokens the keys of its document up to itself. This equals
  what the ring schedule computes (``tests/test_any_length.py`` checks it against
  ``ring_sp.schedule.causal_work_per_rank``) and costs O(N), so P = 256 is cheap. "before":
  ``document_zigzag`` on the per-document padded sequence (padding tokens computed like
  real ones); "after" and the plain layouts: the unpadded documents.

    python benchmarks/document_balance.py [--tokens-per-rank 4096 | --seq-len 65536] [--world-sizes 8 64 256]
"""

from __future__ import annotations

import argparse
import random

import torch

from ring_sp.data import document_positions
from ring_sp.layouts import layout_positions, padded_length

MIXES = ("short (64-512)", "lognormal (median ~1.1K, long tail)", "one half-length + short")
LAYOUTS = ("document_zigzag", "zigzag", "striped", "contiguous")


def draw(mix: str, rng: random.Random, seq_len: int, first: bool) -> int:
    """One document length of ``mix`` for a ``seq_len``-token packed sequence."""
    if mix == MIXES[0]:
        return rng.randint(64, 512)
    if mix == MIXES[1]:
        return int(rng.lognormvariate(7.0, 1.2)) + 1
    return seq_len // 2 if first else rng.randint(32, 1024)


def documents(mix: str, seq_len: int, seed: int = 0) -> list[int]:
    """Real document lengths drawn from ``mix`` while they fit in ``seq_len`` tokens (the
    total is then generally NOT a multiple of the SP size)."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while True:
        length = draw(mix, rng, seq_len, first=not lengths)
        if sum(lengths) + length > seq_len:
            return lengths or [seq_len]
        lengths.append(length)


def boundaries(lengths: list[int]) -> tuple[int, ...]:
    return (0, *torch.tensor(lengths).cumsum(0).tolist())


def per_document_padding(lengths: list[int], multiple: int) -> list[int]:
    """TransformerEngine's THD rule: every document rounded up to ``multiple`` tokens."""
    return [-(-n // multiple) * multiple for n in lengths]


def with_tail(lengths: list[int], layout: str, world_size: int) -> tuple[int, ...]:
    """The boundaries ``ring_sp.shard_batch`` shards: the padding as its own last document."""
    total = sum(lengths)
    pad = padded_length(total, layout, world_size) - total
    return boundaries(lengths + ([pad] if pad else []))


def balance(layout: str, world_size: int, cu: tuple[int, ...]) -> float:
    """max/mean over ranks of the causal (query, key) pairs inside documents."""
    keys_seen = document_positions(cu) + 1
    work = keys_seen[layout_positions(layout, world_size, cu[-1], cu)].sum(dim=1).double()
    return (work.max() / work.mean()).item()


def rows(mix: str, world_size: int, seq_len: int) -> tuple[str, str]:
    lengths = documents(mix, seq_len)
    real = sum(lengths)
    te = per_document_padding(lengths, 2 * world_size)
    overhead = [(sum(te) - real) / real] + [(padded_length(real, layout, world_size) - real) / real for layout in LAYOUTS]
    head = f"| {mix} | {world_size} | {len(lengths)} | {real} |"
    padding = head + " | ".join(f" {o:.2%}" for o in overhead) + " |"
    before = balance("document_zigzag", world_size, boundaries(te))
    after = [balance(layout, world_size, with_tail(lengths, layout, world_size)) for layout in LAYOUTS]
    work = head + " | ".join(f" {b:.4f}" for b in [before, *after]) + " |"
    return padding, work


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tokens-per-rank", type=int, default=4096, help="sequence length = this x P (default)")
    size.add_argument("--seq-len", type=int, help="one sequence length for every P instead")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256])
    args = p.parse_args()
    results = [(mix, world_size, rows(mix, world_size, args.seq_len or args.tokens_per_rank * world_size))
               for mix in MIXES for world_size in args.world_sizes]
    length = f"{args.seq_len} tokens" if args.seq_len else f"{args.tokens_per_rank} tokens per rank"
    columns = " | ".join(LAYOUTS)
    print(f"Padding overhead (padded / real tokens), {length}\n")
    print(f"| mix | P | docs | real tokens | TE per-document (2P) = document_zigzag before | {columns} |")
    print("|---|---|---|---|---|" + "---|" * len(LAYOUTS))
    print("\n".join(padding for _, _, (padding, _) in results))
    print(f"\nCausal work max/mean over ranks (1.00 = balanced), {length}\n")
    print(f"| mix | P | docs | real tokens | document_zigzag before (per-document padding) | {columns} |")
    print("|---|---|---|---|---|" + "---|" * len(LAYOUTS))
    print("\n".join(work for _, _, (_, work) in results))


if __name__ == "__main__":
    main()
