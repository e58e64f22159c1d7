"""Quickstart: exact ring attention over a long sequence on CPU ranks.

Starts ``--world-size`` gloo ranks on this machine. Each rank holds 1/P of a causal
sequence (zigzag layout), runs ring attention forward and backward, and the gathered
result is compared with PyTorch's own single-process attention on the full sequence.
Prints the max errors and each rank's peak memory growth during the call, then the same
for one rank doing the whole sequence, so you can see memory per rank fall as 1/P.

    python examples/quickstart.py                      # 4 ranks, 8192 tokens
    python examples/quickstart.py --world-size 2 --seq-len 4096 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import ring_sp


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--layout", choices=list(ring_sp.LAYOUT_CHOICES), default="zigzag")
    return p.parse_args()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def global_inputs(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The same global q, k, v, dout on every rank (one seed)."""
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    b, n, h, hkv, d = 1, args.seq_len, args.heads, args.kv_heads, args.head_dim
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return {"q": make(b, n, h, d), "k": make(b, n, hkv, d), "v": make(b, n, hkv, d), "dout": make(b, n, h, d)}


def single_rank_attention(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PyTorch's SDPA on the whole sequence: the independent single-device reference."""
    q, k, v = (x[n].transpose(1, 2).detach().requires_grad_() for n in ("q", "k", "v"))  # [b, h, n, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(x["dout"].transpose(1, 2))
    return {"out": out.detach().transpose(1, 2), "dq": q.grad.transpose(1, 2), "dk": k.grad.transpose(1, 2), "dv": v.grad.transpose(1, 2)}


def warm_up(args: argparse.Namespace, group_size: int) -> None:
    """One tiny call first, so thread pools and buffers of the libraries are not counted."""
    x = torch.randn(1, 4 * group_size, args.heads, args.head_dim)
    kv = torch.randn(1, 4 * group_size, args.kv_heads, args.head_dim)
    shard = lambda t: ring_sp.shard_sequence(t, rank=dist.get_rank(), world_size=group_size, layout=args.layout)  # noqa: E731
    q, k = shard(x).requires_grad_(), shard(kv).requires_grad_()
    ring_sp.ring_attention(q, k, k, causal=True, layout=args.layout).sum().backward()


def rank_main(rank: int, args: argparse.Namespace, world_size: int, workdir: str, results: dict) -> None:
    """One rank of a ``world_size``-rank run (world_size 1 = the whole sequence on one rank)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"file://{workdir}/pg{world_size}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    warm_up(args, world_size)
    x = global_inputs(args)
    shard = lambda t: ring_sp.shard_sequence(t, rank=rank, world_size=world_size, layout=args.layout)  # noqa: E731
    q, k, v = (shard(x[n]).requires_grad_() for n in ("q", "k", "v"))
    dout = shard(x["dout"])
    del x  # each rank keeps only its shard, as in training
    dist.barrier()

    before = peak_rss_mib()
    start = time.perf_counter()
    out = ring_sp.ring_attention(q, k, v, causal=True, layout=args.layout)
    out.backward(dout)
    results[(world_size, rank)] = {"seconds": time.perf_counter() - start, "peak_growth_mib": peak_rss_mib() - before}

    gather = lambda t: ring_sp.gather_sequence(t.detach(), layout=args.layout)  # noqa: E731
    gathered = {"out": gather(out), "dq": gather(q.grad), "dk": gather(k.grad), "dv": gather(v.grad)}
    if rank == 0 and world_size > 1:
        reference = single_rank_attention(global_inputs(args))
        results["errors"] = {name: (gathered[name].float() - reference[name].float()).abs().max().item() for name in gathered}
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    multiple = 2 * args.world_size if args.layout == "zigzag" else args.world_size
    if args.seq_len % multiple:
        raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of {multiple} for layout={args.layout}")
    print(f"ring attention: {args.seq_len} tokens, {args.heads} q / {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"{args.dtype}, causal, layout={args.layout}, {args.world_size} CPU ranks (gloo)")
    with mp.Manager() as manager, tempfile.TemporaryDirectory(prefix="ring_sp_quickstart_") as workdir:
        results = manager.dict()
        for world_size in (args.world_size, 1):  # fresh processes each, so peak memory is per run
            mp.spawn(rank_main, args=(args, world_size, workdir, results), nprocs=world_size)
        results = dict(results)
    tolerance = 2e-2 if args.dtype == "bfloat16" else 2e-4
    print(f"\n{'rank':>6} {'fwd+bwd s':>10} {'peak memory growth':>20}")
    for rank in range(args.world_size):
        r = results[(args.world_size, rank)]
        print(f"{rank:>6} {r['seconds']:>10.2f} {r['peak_growth_mib']:>16.1f} MiB")
    single = results[(1, 0)]
    print(f"{'1 rank':>6} {single['seconds']:>10.2f} {single['peak_growth_mib']:>16.1f} MiB  (the whole sequence on one rank)")
    print("\nmax |ring - single-rank| over the gathered sequence:")
    for name, err in results["errors"].items():
        print(f"  {name:>4}: {err:.2e}")
    worst = max(results["errors"].values())
    verdict = "EQUAL" if worst <= tolerance else "DIFFERENT"
    print(f"\n{verdict} to single-rank attention within {tolerance:g} ({args.dtype})")
    if verdict != "EQUAL":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
