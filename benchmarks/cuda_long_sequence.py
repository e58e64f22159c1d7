"""The long-sequence step's pieces on one CUDA GPU (issue 20): memory, time, and exactness.

A Llama-3-8B-sized stack (hidden 4096, ffn 14336, 32 q / 8 kv heads of 128, vocab 128,256,
bf16; ``--layers`` decoder layers, attention by ``sdpa``) trains one step on one sequence
of ``--tokens`` tokens, five ways:

* ``untiled``: the plain MLP and the full ``[tokens, vocab]`` fp32 logits and loss;
* ``tiled``: the MLP through :func:`ring_sp.tiling.tiled_map`, the head and loss through
  :func:`ring_sp.tiling.tiled_linear_cross_entropy`;
* ``untiled+ckpt`` / ``tiled+ckpt``: the same with every layer checkpointed
  (``torch.utils.checkpoint``, what ``gradient_checkpointing_enable`` does);
* ``tiled+offload``: ``tiled+ckpt`` whose checkpoints live in pinned host memory
  (:class:`ring_sp.offload.OffloadedCheckpoint` with its CUDA mover).

It prints the peak memory each step adds (``max_memory_allocated`` above the parameters),
the median step time of interleaved rounds, each mode's loss and gradient error against
``untiled`` (bf16: tiling changes the order of the sums), and whether ``tiled+offload``
equals ``tiled+ckpt`` bitwise (it must: the same tensors come back). That last check needs
deterministic kernels: sdpa's flash backward adds ``dq`` with atomics (two identical steps
differ by ~1e-3), so run it with ``--attention math`` at a length where that fits. No
attention is sequence-parallel here: one GPU, so these are the per-token parts that
ring_sp tiles.

    python -m benchmarks.cuda_long_sequence --tokens 32768 --layers 2
    python -m benchmarks.cuda_long_sequence --tokens 4096 --attention math --modes tiled+ckpt tiled+offload
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from ring_sp.offload import OffloadedCheckpoint
from ring_sp.tiling import tile_linear, tiled_linear_cross_entropy, tiled_map

MODES = ("untiled", "tiled", "untiled+ckpt", "tiled+ckpt", "tiled+offload")


class Layer(nn.Module):
    """A Llama decoder layer: RMSNorm, GQA causal attention (sdpa), RMSNorm, gated MLP."""

    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.tile_tokens: int | None = None

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv(x).view(n, -1, d).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        group = self.heads // self.kv_heads  # KV repeated per query head: sdpa's flash kernel takes no GQA
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True)
        return self.o(out[0].transpose(0, 1).reshape(n, -1))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        def gated(t, g, u, dn):  # tile_linear: inside tiled_map each weight's gradient goes into its fp32 sum
            return tile_linear(F.silu(tile_linear(t, g)) * tile_linear(t, u), dn)

        params = [self.gate.weight, self.up.weight, self.down.weight]
        if self.tile_tokens is None:
            return gated(x, *params)
        return tiled_map(gated, x, params, tile_tokens=self.tile_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, ffn, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def loss(self, ids: torch.Tensor, labels: torch.Tensor, mode: str, tile_tokens: int,
             offloader: OffloadedCheckpoint | None) -> torch.Tensor:
        tiled = mode.startswith("tiled")
        for layer in self.layers:
            layer.tile_tokens = tile_tokens if tiled else None
        x = self.embed(ids)
        for layer in self.layers:
            if mode.endswith("+offload"):
                x = offloader(layer, x)
            elif mode.endswith("+ckpt"):
                x = checkpoint(layer, x, use_reentrant=True)
            else:
                x = layer(x)
        x = self.norm(x)
        valid = (labels != -100).sum()
        if tiled:
            return tiled_linear_cross_entropy(x, self.head.weight, labels, tile_tokens=tile_tokens) / valid
        return F.cross_entropy(self.head(x).float(), labels, reduction="sum") / valid


def one_step(model: Model, ids, labels, mode: str, tile_tokens: int) -> tuple[float, float, int, list]:
    """(loss, seconds, peak bytes added, gradients) of one forward + backward."""
    cuda = ids.is_cuda  # CPU: a smoke run of the logic (--cpu-smoke), no memory figures
    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    offloader = OffloadedCheckpoint() if mode.endswith("+offload") else None
    start = time.perf_counter()
    loss = model.loss(ids, labels, mode, tile_tokens, offloader)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return loss.item(), seconds, peak, [p.grad.detach().cpu() for p in model.parameters()]


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(((g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-30)).item() for g, w in zip(got, want))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tile-tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--attention", choices=("default", "math"), default="default",
                        help="sdpa's backend: 'math' is deterministic (for the bitwise offload check)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks the logic only")
    args = parser.parse_args(argv)
    device, dtype = "cuda", torch.bfloat16
    if args.cpu_smoke:
        device, dtype = "cpu", torch.float32
        args.tokens, args.tile_tokens, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab = (
            96, 40, 64, 128, 4, 2, 300)
    elif not torch.cuda.is_available():
        raise SystemExit("benchmarks.cuda_long_sequence needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.manual_seed(0)
    model = Model(args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab).to(device, dtype)
    ids = torch.randint(0, args.vocab, (args.tokens,), device=device)
    labels = torch.roll(ids, -1)
    labels[-1] = -100
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU smoke run"
    print(f"{name}, torch {torch.__version__}; N={args.tokens}, layers={args.layers}, "
          f"tile_tokens={args.tile_tokens}, attention {args.attention}, params {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B ({dtype})",
          flush=True)

    backend = sdpa_kernel(SDPBackend.MATH) if args.attention == "math" else contextlib.nullcontext()
    results: dict[str, dict] = {}
    with backend:
        for mode in args.modes:  # the first step of each mode: warm-up, results and grads
            loss, _, peak, grads = one_step(model, ids, labels, mode, args.tile_tokens)
            results[mode] = {"loss": loss, "peak": peak, "grads": grads, "times": []}
            print(f"  {mode:14s} loss {loss:.6f}  peak {peak / 2**30:7.2f} GiB", flush=True)
        for _ in range(args.rounds):  # interleaved rounds: each mode once per round
            for mode in args.modes:
                results[mode]["times"].append(one_step(model, ids, labels, mode, args.tile_tokens)[1])

    ref = results.get("untiled")
    print(f"\n| mode | peak added GiB | step s (median of {args.rounds}) | time / untiled | loss err | grad rel err |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        t = statistics.median(r["times"])
        ratio = t / statistics.median(ref["times"]) if ref else float("nan")
        loss_err = abs(r["loss"] - ref["loss"]) / abs(ref["loss"]) if ref else float("nan")
        grad_err = rel_error(r["grads"], ref["grads"]) if ref else float("nan")
        print(f"| {mode} | {r['peak'] / 2**30:.2f} | {t:.3f} | {ratio:.3f} | {loss_err:.1e} | {grad_err:.1e} |")
    if "tiled+offload" in results and "tiled+ckpt" in results:
        a, b = results["tiled+offload"], results["tiled+ckpt"]
        same = a["loss"] == b["loss"] and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
        print(f"\ntiled+offload equals tiled+ckpt bitwise: {same}")


if __name__ == "__main__":
    main()
