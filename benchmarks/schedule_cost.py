"""The packed (``document_zigzag``) schedule's build cost against one layer's attention.

A :class:`ring_sp.ring.RingSpec` is built once per distinct ``cu_seqlens`` and reused by
every layer and by the backward (:mod:`ring_sp.schedule_cache`); this measures what that
one build costs on ring rank 0 (``exchange_plan`` and the spec around it, a new document
mix each time so no cache helps) against one layer's attention on the same rank: the ring
forward, and forward + backward, with the real kernel and schedule, the exchanges replaced
by gpu_check's loopback (:class:`.gpu_check.loopback.Loopback`: a local copy of the rows a KV
receive writes, a zero fill of a dK/dV receive; so: a lower bound of the layer's time, and the
ratio an upper bound). Build and layer alternate, repeat by repeat, in one process.

    python -m benchmarks.schedule_cost [--world-size 8] [--tokens-per-rank 8192] [--documents 1000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from ring_sp.kernels import get_kernel
from ring_sp.ring import RingSpec, ring_backward, ring_forward

from .gpu_check.loopback import Loopback


def random_boundaries(seq_len: int, documents: int, seed: int) -> tuple[int, ...]:
    """``documents`` documents of random lengths (uniform cut points) over ``seq_len`` tokens."""
    cuts = sorted(random.Random(seed).sample(range(1, seq_len), documents - 1))
    return (0, *cuts, seq_len)


def measure(world_size: int = 8, tokens_per_rank: int = 8192, documents: int = 1000, heads: int = 8,
            kv_heads: int = 4, head_dim: int = 64, repeats: int = 5, dtype: str = "float32") -> dict[str, Any]:
    """Median seconds of one spec build and of one layer's forward / forward+backward on rank 0."""
    torch_dtype = getattr(torch, dtype)
    kernel = get_kernel("auto", torch.device("cpu"), torch_dtype, head_dim)
    scale, seq_len = head_dim ** -0.5, world_size * tokens_per_rank
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, tokens_per_rank, heads, head_dim, generator=g, dtype=torch_dtype) for _ in range(2))
    k, v = (torch.randn(1, tokens_per_rank, kv_heads, head_dim, generator=g, dtype=torch_dtype) for _ in range(2))

    def spec(seed: int) -> RingSpec:  # every rank's shard stands in by rank 0's (the receives' bytes are the same)
        comm = Loopback(0, [k] * world_size, [v] * world_size)
        built = RingSpec(comm, "document_zigzag", True, kernel, scale, tokens_per_rank,  # type: ignore[arg-type]
                         random_boundaries(seq_len, documents, seed))
        comm.recv_rows = built.recv_rows
        return built

    layer = spec(0)
    times: dict[str, list[float]] = {"build_s": [], "fwd_s": [], "fwd_bwd_s": []}
    for i in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        spec(i + 1)
        built = time.perf_counter()
        out, lse = ring_forward(q, k, v, layer)
        forward = time.perf_counter()
        ring_backward(dout, q, k, v, out, lse, layer, torch_dtype)
        done = time.perf_counter()
        if i:
            times["build_s"].append(built - start)
            times["fwd_s"].append(forward - built)
            times["fwd_bwd_s"].append(done - built)
    result: dict[str, Any] = {name: statistics.median(t) for name, t in times.items()}
    result.update(world_size=world_size, tokens_per_rank=tokens_per_rank, documents=documents,
                  blocks=sum(len(t) for t in layer.schedule), repeats_s=times,
                  build_over_fwd=result["build_s"] / result["fwd_s"],
                  build_over_fwd_bwd=result["build_s"] / result["fwd_bwd_s"])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=8192)
    p.add_argument("--documents", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)  # as one rank of the benchmark's gloo pool
    r = measure(args.world_size, args.tokens_per_rank, args.documents, repeats=args.repeats)
    print(f"P={r['world_size']}, {r['tokens_per_rank']} tokens per rank, {r['documents']} documents, "
          f"{r['blocks']} blocks on rank 0: build {r['build_s'] * 1e3:.1f} ms, layer fwd {r['fwd_s'] * 1e3:.0f} ms, "
          f"fwd+bwd {r['fwd_bwd_s'] * 1e3:.0f} ms; build / fwd {r['build_over_fwd']:.2%}, "
          f"build / fwd+bwd {r['build_over_fwd_bwd']:.2%}")


if __name__ == "__main__":
    main()
