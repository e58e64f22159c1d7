"""``ring-sp plan`` / ``python -m ring_sp.plan``: pick the ``U x R`` grid, placement and layout.

    ring-sp plan --world-size 32 --gpus-per-node 8 --heads 32 --kv-heads 8 --hidden 4096 \\
        --layers 32 --seq-len 131072 --gpu h100 --inter ib400

prints the recommended split and, for every candidate, the modelled bytes per layer,
activation memory per GPU, whether the ring hides its transfers (DESIGN.md section 8) and
the attention time per layer; ``--json`` prints the same as JSON. An impossible request
exits with status 2 and the reason. The model is :mod:`ring_sp.planner`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from .planner import DTYPES, Candidate, Cluster, ModelShape, Plan, PlanError, Workload, plan
from .topology import PLACEMENTS
from .validation import KV_EXCHANGES


@dataclass(frozen=True)
class GPU:
    """Dense bf16/fp16 tensor-core peak (no sparsity), memory, and the node's GPU-to-GPU link."""

    name: str
    tflops: float
    memory_gib: float
    intra_link: str


# NVIDIA datasheets: A100 SXM 312 TFLOP/s, NVLink3; H100 SXM and H200 SXM 989 TFLOP/s, NVLink4;
# HGX B200 36 PFLOP/s sparse per 8 GPUs = 2.25 PFLOP/s dense per GPU, NVLink5.
GPUS = {
    "a100": GPU("A100 SXM 80GB", 312.0, 80.0, "nvlink3"),
    "h100": GPU("H100 SXM", 989.0, 80.0, "nvlink4"),
    "h200": GPU("H200 SXM", 989.0, 141.0, "nvlink4"),
    "b200": GPU("B200", 2250.0, 180.0, "nvlink5"),
}

# Bytes/s per GPU per direction. NVLink totals are bidirectional: NVLink3 600 GB/s, NVLink4
# 900 GB/s, NVLink5 1.8 TB/s per GPU. PCIe x16: gen4 32 GB/s, gen5 64 GB/s per direction.
# InfiniBand, one NIC per GPU (DGX/HGX): HDR 200 Gb/s, NDR 400 Gb/s, XDR 800 Gb/s.
LINKS = {
    "nvlink3": 300e9, "nvlink4": 450e9, "nvlink5": 900e9,
    "pcie4": 32e9, "pcie5": 64e9,
    "ib200": 25e9, "ib400": 50e9, "ib800": 100e9,
}

# Achieved share of the dense peak in attention: FlashAttention-2 reaches 50-73% on A100,
# FlashAttention-3 up to 75% on H100; we take the low end.
DEFAULT_EFFICIENCY = 0.5

# A fixed cost per synchronising exchange (a ring step, a collective): NCCL's small-message
# latency on NVLink is a few microseconds, plus the step's wait on its slowest peer; nominal.
DEFAULT_LATENCY_US = 10.0


def nominal_cluster(world_size: int) -> Cluster:
    """One node of ``world_size`` H100s at the CLI's defaults: what ``kv_exchange="auto"`` plans with."""
    gpu = GPUS["h100"]
    return Cluster(world_size, world_size, gpu.tflops * 1e12 * DEFAULT_EFFICIENCY, LINKS[gpu.intra_link],
                   LINKS["ib400"], gpu.memory_gib * 2**30, DEFAULT_LATENCY_US * 1e-6)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ring-sp plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    job = p.add_argument_group("cluster")
    job.add_argument("--world-size", type=int, required=True, help="GPUs in the job")
    job.add_argument("--gpus-per-node", type=int, default=8)
    job.add_argument("--sp-size", type=int, help="sequence-parallel degree U x R (default: the world size)")
    job.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="compute and memory defaults (default h100)")
    job.add_argument("--tflops", type=float, help="dense bf16 peak TFLOP/s per GPU (default: the --gpu datasheet)")
    job.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY,
                     help=f"achieved share of the peak in attention (default {DEFAULT_EFFICIENCY})")
    job.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: the --gpu datasheet)")
    job.add_argument("--intra", choices=sorted(LINKS), help="intra-node link (default: the --gpu's NVLink)")
    job.add_argument("--inter", choices=sorted(LINKS), default="ib400", help="inter-node link per GPU (default ib400)")
    job.add_argument("--intra-gbps", type=float, help="intra-node GB/s per GPU per direction (overrides --intra)")
    job.add_argument("--inter-gbps", type=float, help="inter-node GB/s per GPU per direction (overrides --inter)")
    job.add_argument("--latency-us", type=float, default=DEFAULT_LATENCY_US,
                     help=f"fixed cost of each synchronising exchange, a ring step or a collective, in microseconds "
                          f"(default {DEFAULT_LATENCY_US:g}; 0 = bandwidth only)")
    model = p.add_argument_group("model and sequence")
    model.add_argument("--heads", type=int, required=True, help="query heads")
    model.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    model.add_argument("--hidden", type=int, required=True, help="hidden size")
    model.add_argument("--head-dim", type=int, help="default: hidden / heads")
    model.add_argument("--value-head-dim", type=int, help="value head size d_v (default: --head-dim; MLA differs)")
    model.add_argument("--layers", type=int, required=True)
    model.add_argument("--seq-len", type=int, required=True, help="tokens per sample (the global sequence)")
    model.add_argument("--batch", type=int, default=1, help="samples per SP group per step")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    model.add_argument("--non-causal", action="store_true")
    model.add_argument("--sliding-window", type=int, metavar="W",
                       help="causal sliding-window attention over W keys: the ring exchanges only the halo")
    pin = p.add_argument_group("pin a choice (default: consider all)")
    pin.add_argument("--ulysses", type=int, help="Ulysses size U (ring size = SP / U)")
    pin.add_argument("--placement", choices=PLACEMENTS)
    pin.add_argument("--layout", choices=("auto", "zigzag", "striped", "contiguous"), default="auto")
    pin.add_argument("--kv-exchange", choices=KV_EXCHANGES, default="auto",
                     help="the ring group's KV exchange: ring, all_gather, or auto (model both; default)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _request(args: argparse.Namespace) -> tuple[Cluster, ModelShape, Workload]:
    gpu = GPUS[args.gpu]
    tflops = args.tflops if args.tflops is not None else gpu.tflops
    intra = args.intra_gbps * 1e9 if args.intra_gbps else LINKS[args.intra or gpu.intra_link]
    inter = args.inter_gbps * 1e9 if args.inter_gbps else LINKS[args.inter]
    memory = (args.gpu_memory_gib if args.gpu_memory_gib is not None else gpu.memory_gib) * 2**30
    head_dim = args.head_dim if args.head_dim is not None else args.hidden // args.heads if args.heads > 0 else 0
    cluster = Cluster(args.world_size, args.gpus_per_node, tflops * 1e12 * args.efficiency, intra, inter, memory,
                      args.latency_us * 1e-6)
    model = ModelShape(args.heads, args.kv_heads if args.kv_heads is not None else args.heads, head_dim,
                       args.hidden, args.layers, args.value_head_dim)
    work = Workload(args.seq_len, args.batch, args.dtype, not args.non_causal, args.sp_size, args.sliding_window)
    return cluster, model, work


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _hides(c: Candidate) -> str:
    if c.ring == 1:
        return "no ring"
    return (f"{'yes' if c.hides_fwd else 'NO'}/{'yes' if c.hides_bwd else 'NO'} "
            f"(>= {c.min_chunk_fwd}/{c.min_chunk_bwd})")


def render(result: Plan, args: argparse.Namespace) -> str:
    """The human-readable plan: the request, the recommendation, every candidate, warnings."""
    cl, m, w = result.cluster, result.model, result.workload
    nodes = max(1, cl.world_size // cl.gpus_per_node)
    best = result.recommended
    lines = [
        f"ring-sp plan: {w.seq_len} tokens x batch {w.batch}, {w.dtype}, {'causal' if w.causal else 'non-causal'}"
        f"{'' if w.sliding_window is None else f' sliding window {w.sliding_window}'}, "
        f"SP degree {result.sp_size} of {cl.world_size} GPUs ({nodes} node(s) x {cl.gpus_per_node})",
        f"  model    {m.heads} q / {m.kv_heads} kv heads x head_dim {m.head_dim}, hidden {m.hidden}, {m.layers} layers",
        f"  compute  {GPUS[args.gpu].name if args.tflops is None else 'custom'}: "
        f"{cl.flops / 1e12:.1f} TFLOP/s achieved per GPU, {cl.memory_bytes / 2**30:.0f} GiB",
        f"  links    intra-node {cl.intra_bw / 1e9:.0f} GB/s, inter-node {cl.inter_bw / 1e9:.0f} GB/s "
        "(per GPU, per direction)",
        "",
        f"recommended: {best.label}, placement {best.placement}, layout {best.layout}, kv exchange {best.kv_exchange}",
        f"  all-to-all on {best.ulysses_link} links, ring on {best.ring_link} links; ring hides its transfers "
        f"(fwd/bwd): {_hides(best)}; {best.ring_chunk} tokens per ring rank",
        f"  modelled attention time {best.layer_s * 1e3:.2f} ms per layer (fwd+bwd), "
        f"{best.layer_s * m.layers * 1e3:.1f} ms per step; {best.memory_bytes / 2**30:.2f} GiB activations per GPU",
        "",
        "| U x R | placement | layout | kv exchange | all-to-all | ring | tokens/ring rank "
        "| ring hides fwd/bwd (min tokens) | MiB sent/layer fwd | bwd | activations GiB/GPU | attention buffers MiB "
        "| ms/layer fwd+bwd | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result.candidates:
        mark = " <-" if c is best else ""
        lines.append(
            f"| {c.ulysses} x {c.ring}{mark} | {c.placement} | {c.layout} | {c.kv_exchange} | {c.ulysses_link} "
            f"| {c.ring_link} "
            f"| {c.ring_chunk} | {_hides(c)} | {_mib(sum(c.bytes_fwd.values()))} | {_mib(sum(c.bytes_bwd.values()))} "
            f"| {c.activation_bytes / 2**30:.2f} | {_mib(c.working_bytes)} | {c.layer_s * 1e3:.3f} "
            f"| {'; '.join(c.notes)} |"
        )
    lines += [f"warning: {text}" for text in result.warnings]
    return "\n".join(lines)


def _as_json(result: Plan) -> str:
    def candidate(c: Candidate) -> dict:
        return {**asdict(c), "layer_s": c.layer_s, "total_bytes": c.total_bytes,
                "memory_bytes": c.memory_bytes}

    return json.dumps({
        "cluster": asdict(result.cluster), "model": asdict(result.model),
        "workload": asdict(result.workload), "sp_size": result.sp_size,
        "recommended": candidate(result.recommended), "candidates": [candidate(c) for c in result.candidates],
        "warnings": list(result.warnings),
    }, indent=1, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ring-sp plan`` (a leading ``plan`` word is accepted) and ``python -m ring_sp.plan``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        argv = argv[1:]
    args = _parser().parse_args(argv)
    try:
        cluster, model, work = _request(args)
        result = plan(cluster, model, work, ulysses=args.ulysses, placement=args.placement, layout=args.layout,
                      kv_exchange=args.kv_exchange)
    except PlanError as exc:
        print(f"ring-sp plan: error: {exc}", file=sys.stderr)
        return 2
    print(_as_json(result) if args.json else render(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
