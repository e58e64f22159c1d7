"""``ring-sp plan`` / ``python -m ring_sp.plan``: pick the ``U x R`` grid, placement and layout.

    ring-sp plan --world-size 32 --gpus-per-node 8 --heads 32 --kv-heads 8 --hidden 4096 \\
        --layers 32 --seq-len 131072 --gpu h100 --inter ib400

prints the recommended split and, for every candidate, the modelled bytes per layer,
activation memory per GPU, whether the ring hides its transfers (DESIGN.md section 8) and
the attention time per layer; ``--json`` prints the same as JSON. An impossible request
exits with status 2 and the reason. The model is :mod:`ring_sp.plan.search`.

The whole training step (:mod:`ring_sp.plan.step_memory`): ``--model`` (a preset or an HF
``config.json``) adds the vocabulary and MLP, and with the training options (ZeRO stage,
checkpointing and offload, tiling, ``--alst``) the peak memory per GPU of one step with its
breakdown; ``--max-seq-len`` prints the longest sequence that fits per grid, the GPU's memory
and the node's host memory (``--host-memory-gib``) alike, naming the limit that binds, with
the int32-index check (``--json`` prints the same rows as JSON; :mod:`ring_sp.plan.longest`):

    ring-sp plan --model llama-3-8b --world-size 64 --max-seq-len --zero-stage 3 \
        --offload-optimizer --checkpointing --offload-checkpoints --tiled
    ring-sp plan --model llama-3-8b --world-size 8 --max-seq-len --alst
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace

from ..grid import PLACEMENTS
from ..shapes import check_ulysses_heads
from ..validation import KV_EXCHANGES
from . import longest
from . import step_memory as sm
from .layer_time import Candidate
from .presets import DEFAULT_EFFICIENCY, DEFAULT_LATENCY_US, GPUS, LINKS
from .request import DTYPES, Cluster, ModelShape, PlanError, Workload
from .search import RINGS, Plan, plan
from .training import HEAD_CHUNKS_AUTO

HOST_GIB_PER_GPU = 1900 / 8  # ALST's nodes: 1.9 TB of RAM for 8 H100s (issue 30)
PREFETCH_CHOICES = {"auto": None, "on": True, "off": False}  # --prefetch-checkpoints -> Training.prefetch_checkpoints


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
    model.add_argument("--model", metavar="PRESET|config.json",
                       help=f"the whole model: a preset ({', '.join(sm.PRESETS)}) or an HF config.json; fills "
                            "--heads/--kv-heads/--hidden/--head-dim/--layers and enables the whole-step memory")
    model.add_argument("--heads", type=int, help="query heads")
    model.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--head-dim", type=int, help="default: hidden / heads")
    model.add_argument("--value-head-dim", type=int, help="value head size d_v (default: --head-dim; MLA differs)")
    model.add_argument("--layers", type=int)
    model.add_argument("--seq-len", type=int, help="tokens per sample (the global sequence); not with --max-seq-len")
    model.add_argument("--batch", type=int, default=1, help="samples per SP group per step")
    model.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    model.add_argument("--non-causal", action="store_true")
    model.add_argument("--sliding-window", type=int, metavar="W",
                       help="causal sliding-window attention over W keys: the ring exchanges only the halo")
    pin = p.add_argument_group("pin a choice (default: consider all)")
    pin.add_argument("--ulysses", type=int, help="Ulysses size U (ring size = SP / U)")
    pin.add_argument("--placement", choices=PLACEMENTS)
    pin.add_argument("--layout", choices=("auto", "zigzag", "striped", "contiguous"), default="auto")
    pin.add_argument("--kv-exchange", choices=KV_EXCHANGES[:3], default="auto",
                     help="the ring group's KV exchange: ring, all_gather, or auto (model both; default)")
    pin.add_argument("--ring", choices=RINGS, default="auto",
                     help="a ring spanning nodes: plain (one flat ring), double (an inner ring per node, "
                          "kv_exchange='double_ring'), or auto (model both; default)")
    step = p.add_argument_group("the whole training step (with --model)")
    step.add_argument("--max-seq-len", action="store_true",
                      help="print the longest sequence whose step fits in --gpu-memory-gib, per U x R, with the breakdown")
    step.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    step.add_argument("--offload-optimizer", action="store_true", help="Adam states and fp32 gradients on the host")
    step.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every layer")
    step.add_argument("--offload-checkpoints", action="store_true", help="checkpointed activations in host memory")
    step.add_argument("--tiled", action="store_true", help="tiled MLP and tiled logits+loss (enable_long_sequence)")
    step.add_argument("--tile-tokens", type=int, help="tokens per tile (default: sized by ring_sp, ring_sp.shapes.auto_tile_tokens)")
    step.add_argument("--alst", action="store_true",
                      help="configure as DeepSpeed ALST's published recipe: Ulysses only, bf16, ZeRO-3 with the "
                           "optimizer offloaded, checkpoints offloaded, TiledMLP, Liger's kernels and fused linear "
                           "cross entropy; beside it ring_sp's rows with enable_long_sequence's defaults")
    step.add_argument("--reserved-gib", type=float, default=1.0,
                      help="per-GPU memory that is not tensors: CUDA context, NCCL buffers (default 1.0)")
    step.add_argument("--lean-layers", action=argparse.BooleanOptionalAction, default=None,
                      help="ring_sp's lean RMSNorm / RoPE / gated MLP (default: on with --tiled and for ring_sp's "
                           "rows under --alst, as enable_long_sequence)")
    step.add_argument("--head-chunks", type=_head_chunks, metavar="N|auto",
                      help="ring_sp's attention in chunks of heads (default: auto with --tiled and under --alst, "
                           "as enable_long_sequence; else 1)")
    step.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter shards on the host")
    step.add_argument("--pinned-rounding", action=argparse.BooleanOptionalAction, default=None,
                      help="model each offloaded checkpoint as ONE pinned host block rounded up to a power of two "
                           "(torch's caching host allocator; default no: ring_sp's CudaMover copies into power-of-two "
                           "pieces, ALST into pageable memory)")
    step.add_argument("--prefetch-checkpoints", choices=tuple(PREFETCH_CHOICES), default="auto",
                      help="ring_sp's offloaded checkpoints: bring the previous layer's back during a layer's backward "
                           "(on: two on the GPU), each at its own layer's backward (off: one), or auto (default, as "
                           "OffloadedCheckpoint: on while a checkpoint is at most 1/64 of the GPU's memory)")
    step.add_argument("--host-memory-gib", type=float,
                      help=f"host RAM per node of --gpus-per-node GPUs (default {HOST_GIB_PER_GPU * 8:g} GiB per 8 "
                           "GPUs, as on ALST's nodes): offloaded checkpoints, optimizer and parameters must fit")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def _model(args: argparse.Namespace) -> sm.Transformer | None:
    """The --model's shape, which fills the attention flags left out (an explicit flag wins)."""
    if args.model is None:
        missing = [f"--{k.replace('_', '-')}" for k in ("heads", "hidden", "layers") if getattr(args, k) is None]
        if missing:
            raise PlanError(f"{', '.join(missing)} required (or --model PRESET|config.json)")
        return None
    model = sm.model_from(args.model)
    for key, value in (("heads", model.heads), ("kv_heads", model.kv_heads), ("hidden", model.hidden),
                       ("head_dim", model.head_dim), ("layers", model.layers)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    return model


def _head_chunks(text: str) -> int | str:
    """--head-chunks: a positive integer or "auto"."""
    if text == HEAD_CHUNKS_AUTO:
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"head-chunks={text!r} must be a positive integer or 'auto'")
    return value


def _training(args: argparse.Namespace) -> sm.Training:
    if args.alst:
        return sm.alst()
    lean = args.tiled if args.lean_layers is None else args.lean_layers  # enable_long_sequence: lean with tiling
    chunks = args.head_chunks if args.head_chunks is not None else HEAD_CHUNKS_AUTO if args.tiled else None
    return sm.Training(dtype=args.dtype, zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer,
                       checkpointing=args.checkpointing, offload_checkpoints=args.offload_checkpoints,
                       tiled_mlp=args.tiled, tiled_loss=args.tiled, mlp_tile_tokens=args.tile_tokens,
                       loss_tile_tokens=args.tile_tokens, reserved_bytes=args.reserved_gib * 2**30,
                       lean_layers=lean, head_chunks=chunks, offload_params=args.offload_params,
                       pinned_rounding=args.pinned_rounding,
                       prefetch_checkpoints=PREFETCH_CHOICES[args.prefetch_checkpoints])


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


def _training_for(args: argparse.Namespace, ulysses: int, ring: int) -> sm.Training:
    training = _training(args)
    if args.alst and ring != 1:
        raise PlanError(f"--alst is Ulysses only (ring 1); U={ulysses} x R={ring} has a ring: pin --ulysses to the SP "
                        f"degree, or drop --alst")
    return training


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def _render_step(step: sm.StepMemory, memory: float) -> str:
    """The whole step's peak per GPU and its breakdown."""
    parts = ", ".join(f"{name} {_gib(value)}" for name, value in step.breakdown().items() if value)
    verdict = "fits" if step.total <= memory else "does NOT fit"
    host = step.host
    on_host = "" if not host.total else (
        f"\n  host memory per GPU: {_gib(host.total)} GiB (checkpoints {_gib(host.checkpoints)}, optimizer "
        f"{_gib(host.optimizer)}, parameters {_gib(host.params)}; --max-seq-len checks it against --host-memory-gib)")
    return (f"whole step at {step.seq_len} tokens ({step.tokens_per_rank} per GPU): peak {_gib(step.total)} GiB per GPU, "
            f"{verdict} in {memory / 2**30:.0f} GiB\n  {parts} (GiB){on_host}")


def max_seq_len_request(args: argparse.Namespace, model: sm.Transformer) -> longest.Request:
    """The --max-seq-len question: --world-size GPUs of --gpu-memory-gib, --host-memory-gib per node,
    every Ulysses size the heads allow (--ulysses pins one) and, with --alst, ALST's published
    recipe next to ring_sp's own pieces (enable_long_sequence's defaults) under the same ZeRO-3
    and offload settings."""
    gpu = GPUS[args.gpu]
    memory = (args.gpu_memory_gib if args.gpu_memory_gib is not None else gpu.memory_gib) * 2**30
    host = (args.host_memory_gib if args.host_memory_gib is not None else HOST_GIB_PER_GPU * args.gpus_per_node) * 2**30
    if host <= 0:
        raise PlanError(f"host-memory-gib={host / 2**30:g} must be positive (GiB of RAM per node)")
    reserved = args.reserved_gib * 2**30
    if args.alst:  # the reserved memory is the GPU's, whoever trains
        ours = sm.long_sequence(reserved, lean_layers=True if args.lean_layers is None else args.lean_layers,
                                head_chunks=HEAD_CHUNKS_AUTO if args.head_chunks is None else args.head_chunks,
                                pinned_rounding=args.pinned_rounding,
                                prefetch_checkpoints=PREFETCH_CHOICES[args.prefetch_checkpoints])
        recipes = (("ALST", replace(sm.alst(), reserved_bytes=reserved), True), ("ring_sp", ours, False))
    else:
        training = _training(args)
        recipes = ((training.library, training, False),)
    return longest.Request(model, args.world_size, args.gpus_per_node, args.sp_size or args.world_size, memory, host,
                           recipes, args.ulysses)


def _as_json(result: Plan, step: sm.StepMemory | None = None) -> str:
    def candidate(c: Candidate) -> dict:
        return {**asdict(c), "layer_s": c.layer_s, "total_bytes": c.total_bytes,
                "memory_bytes": c.memory_bytes}

    return json.dumps({
        "cluster": asdict(result.cluster), "model": asdict(result.model),
        "workload": asdict(result.workload), "sp_size": result.sp_size,
        "recommended": candidate(result.recommended), "candidates": [candidate(c) for c in result.candidates],
        "warnings": list(result.warnings),
        **({} if step is None else {"step_memory": {**asdict(step), "total": step.total}}),
    }, indent=1, default=str)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ring-sp plan`` (a leading ``plan`` word is accepted) and ``python -m ring_sp.plan``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        argv = argv[1:]
    args = _parser().parse_args(argv)
    try:
        whole = _model(args)
        if args.max_seq_len:
            if whole is None:
                raise PlanError("--max-seq-len needs --model (the vocabulary and MLP size the step's memory depends on)")
            if args.seq_len is not None:
                raise PlanError("--max-seq-len searches the length: drop --seq-len")
            req = max_seq_len_request(args, whole)
            table = longest.rows(req)
            print(longest.as_json(req, table) if args.json else longest.render(req, table))
            return 0
        if args.seq_len is None:
            raise PlanError("--seq-len is required (or --max-seq-len with --model)")
        cluster, model, work = _request(args)
        result = plan(cluster, model, work, ulysses=args.ulysses, placement=args.placement, layout=args.layout,
                      kv_exchange=args.kv_exchange, ring=args.ring)
        step = None
        if whole is not None:
            best = result.recommended
            step = sm.step_memory(whole, _training_for(args, best.ulysses, best.ring), seq_len=work.seq_len,
                                  ulysses=best.ulysses, ring=best.ring, memory_bytes=cluster.memory_bytes)
            # the whole step's verdict replaces the attention-only memory warning
            result = replace(result, warnings=tuple(w for w in result.warnings if "weights and optimizer" not in w))
    except PlanError as exc:
        print(f"ring-sp plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(_as_json(result, step))
    else:
        print(render(result, args) + ("" if step is None else "\n\n" + _render_step(step, result.cluster.memory_bytes)))
    return 0
