"""Rank-side cases of tests/test_recompute.py (C22): a small attention block run plainly
and under each activation-checkpointing wrapper, with its ring exchanges and kernel calls
counted and its gradients returned for a bitwise comparison."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import ring_sp
from ring_sp import recompute
from ring_sp.kernels import get_kernel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, N_LOCAL = 32, 4, 2, 8, 8


class Block(nn.Module):
    """x ``[b, n, HIDDEN]`` -> projections -> ring_sp attention -> projection (+ x)."""

    def __init__(self, attend: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=torch.float64)
        self.proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, dtype=torch.float64)
        self.attend = attend
        self.scale = 1.0  # a test may change it between the first run and the re-run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (self.qkv(x) * self.scale).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        out = self.attend(q.reshape(b, n, HEADS, HEAD_DIM), k.reshape(b, n, KV_HEADS, HEAD_DIM),
                          v.reshape(b, n, KV_HEADS, HEAD_DIM))
        return x + self.proj(out.reshape(b, n, -1))


def attend_for(mode: str, **options) -> Callable[..., torch.Tensor]:
    """``ring`` over the world, ``ulysses`` over the world, ``hybrid`` U=2 x R=world/2."""
    if mode == "ring":
        return functools.partial(ring_sp.ring_attention, causal=True, **options)
    if mode == "ulysses":
        return functools.partial(ring_sp.ulysses_attention, causal=True, **options)
    topo = ring_sp.init_sequence_parallel(2, dist.get_world_size() // 2)
    return functools.partial(ring_sp.hybrid_attention, topology=topo, causal=True, **options)


def _deepspeed_checkpoint(fn, x):
    import deepspeed
    import deepspeed.comm

    from ring_sp.integrations.deepspeed import skip_cpu_inference_comm_build

    if not deepspeed.comm.is_initialized():
        skip_cpu_inference_comm_build()  # the comm would JIT-compile a C++ op on CPU
        deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
    deepspeed.checkpointing.configure(None)
    return deepspeed.checkpointing.checkpoint(fn, x)


def _deepspeed_non_reentrant(fn, x):
    from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

    _deepspeed_checkpoint(lambda t: t, x)  # configure once
    return non_reentrant_checkpoint(fn, x)


WRAPPERS: dict[str, Callable[[Callable, torch.Tensor], torch.Tensor]] = {
    "none": lambda fn, x: fn(x),
    "reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=True),
    "non_reentrant": lambda fn, x: checkpoint(fn, x, use_reentrant=False),
    "deepspeed": _deepspeed_checkpoint,
    "deepspeed_non_reentrant": _deepspeed_non_reentrant,
}


@contextlib.contextmanager
def count_kernel_calls() -> Iterator[dict[str, int]]:
    """Calls of the local kernel's forward and backward inside the block."""
    kernel_class = type(get_kernel("auto", torch.device("cpu"), torch.float64, HEAD_DIM))
    tally = {"forward": 0, "backward": 0}
    originals = {name: getattr(kernel_class, name) for name in tally}

    def counting(name):
        def call(self, *args, **kwargs):
            tally[name] += 1
            return originals[name](self, *args, **kwargs)
        return call

    for name in tally:
        setattr(kernel_class, name, counting(name))
    try:
        yield tally
    finally:
        for name, original in originals.items():
            setattr(kernel_class, name, original)


def _inputs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + dist.get_rank())
    return torch.randn(1, N_LOCAL, HIDDEN, dtype=torch.float64, generator=g).requires_grad_()


def micro_batches_case(mode: str, wrapper: str, seeds: list[int], order: str = "pipeline",
                       reuse: bool | None = None) -> dict[str, object]:
    """Forward every micro-batch (``seeds``; equal seeds = identical micro-batches) through
    two checkpointed blocks, then backward them (``pipeline``: all forwards first, backwards
    in reverse; ``accumulate``: forward/backward one at a time). Returns exchanges and
    kernel calls per kind, gradients, and the entries alive at the points that matter."""
    options = {} if reuse is None else {"reuse_on_recompute": reuse}
    blocks = nn.ModuleList([Block(attend_for(mode, **options)) for _ in range(2)])
    wrap = WRAPPERS[wrapper]

    def step(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = wrap(block, x)
        return (x * x).sum()

    xs = [_inputs(seed) for seed in seeds]
    alive_after_forward = []
    with ring_sp.count_communication() as comm, count_kernel_calls() as calls:
        if order == "pipeline":
            losses = [step(x) for x in xs]
            alive_after_forward.append(recompute.live_entries())
            for loss in reversed(losses):
                loss.backward()
            del losses
        else:
            for x in xs:
                loss = step(x)
                alive_after_forward.append(recompute.live_entries())
                loss.backward()
                del loss
    return {
        "calls": dict(comm.calls), "bytes": dict(comm.bytes_sent), "kernel": dict(calls),
        "grads": [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone() for x in xs],
        "alive_after_forward": alive_after_forward, "alive_after_backward": recompute.live_entries(),
    }


def changed_inputs_case(mode: str) -> dict[str, object]:
    """The re-run sees other q/k/v (the block's scale changes between forward and backward):
    it must compute afresh; its gradients equal a plain run at the new scale."""
    results = {}
    for wrapper in ("reentrant", "plain_at_new_scale"):
        block = Block(attend_for(mode))
        x = _inputs(0)
        with ring_sp.count_communication() as comm, count_kernel_calls() as calls:
            if wrapper == "reentrant":
                loss = checkpoint(block, x, use_reentrant=True).sum()
                block.scale = 0.5
            else:
                block.scale = 0.5
                loss = block(x).sum()
            loss.backward()
        results[wrapper] = {"calls": dict(comm.calls), "kernel": dict(calls), "alive": recompute.live_entries(),
                            "grads": [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]}
    return results


def soak_case(mode: str, steps: int) -> list[int]:
    """Training steps under both checkpointing kinds, eval steps (no_grad, and grad on with
    the graph dropped), and abandoned checkpointed forwards: live entries after each."""
    block = Block(attend_for(mode))
    alive = []
    for i in range(steps):
        x = _inputs(i)
        checkpoint(block, x, use_reentrant=bool(i % 2)).sum().backward()
        alive.append(recompute.live_entries())
        with torch.no_grad():
            checkpoint(block, x, use_reentrant=True).sum()
            block(x).sum()
        alive.append(recompute.live_entries())
        loss = checkpoint(block, x, use_reentrant=bool(i % 2)).sum()  # never backwarded
        del loss
        alive.append(recompute.live_entries())
    return alive


def megatron_case(granularity: str | None, cp: int = 2, ulysses: int = 1) -> dict[str, object]:
    """A megatron-core GPTModel (2 layers, ring_sp core attention at CP = ``cp``) with
    ``recompute_granularity`` None, ``full`` (uniform, 1 layer per checkpoint) or
    ``selective`` (``recompute_modules=["core_attn"]``): one forward + backward, its ring
    exchanges, kernel calls and gradients. Megatron's checkpoint saves CUDA RNG states;
    CPU-only torch has none, so those two calls are stubbed (the CPU state is kept)."""
    import dataclasses

    import test_megatron as tm
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.utils import get_batch_on_this_cp_rank

    import ring_sp.integrations.megatron as rsm

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.zeros(1)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    parallel_state.initialize_model_parallel(context_parallel_size=cp, create_gloo_process_groups=False)
    try:
        config = tm._config(1, cp)
        if granularity == "full":
            config = dataclasses.replace(config, recompute_granularity="full", recompute_method="uniform",
                                         recompute_num_layers=1)
        elif granularity == "selective":
            config = dataclasses.replace(config, recompute_granularity="selective", recompute_modules=["core_attn"])
        spec = rsm.get_gpt_layer_ring_sp_spec(rsm.RingSPConfig(ulysses_size=ulysses), normalization="RMSNorm")
        torch.manual_seed(0)
        model = GPTModel(config, spec, vocab_size=tm.VOCAB, max_sequence_length=tm.SEQ, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        rsm.install_layout_rope(model)
        shard = get_batch_on_this_cp_rank(tm._batch())
        with ring_sp.count_communication() as comm, count_kernel_calls() as calls:
            losses = model(shard["tokens"], shard["position_ids"], None, labels=shard["labels"])
            alive = recompute.live_entries()
            (losses * shard["loss_mask"]).sum().backward()
            del losses
        return {"calls": dict(comm.calls), "kernel": dict(calls), "alive_after_forward": alive,
                "alive_after_backward": recompute.live_entries(),
                "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}
    finally:
        parallel_state.destroy_model_parallel()


def transformers_case(checkpointing: str) -> dict[str, object]:
    """A tiny transformers Llama (GQA 4/2) with ``attn_implementation="ring_sp"`` on a ring of
    all ranks (float64), one training step, without checkpointing (``"none"``) or with
    ``model.gradient_checkpointing_enable`` (``"reentrant"`` / ``"non_reentrant"``)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import ring_sp.integrations.transformers as rsp_hf

    topo = ring_sp.init_sequence_parallel(1, dist.get_world_size())
    rsp_hf.register(topo)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="ring_sp").to(torch.float64).train()
    if checkpointing != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
    ids = torch.randint(0, 64, (1, 8 * dist.get_world_size()), generator=torch.Generator().manual_seed(3))
    shard = rsp_hf.shard_batch({"input_ids": ids}, topo)
    with ring_sp.count_communication() as comm, count_kernel_calls() as calls:
        logits = model(**shard, use_cache=False).logits
        alive_after_forward = recompute.live_entries()
        rsp_hf.causal_lm_loss(logits, shard["shift_labels"], topology=topo, gradients_averaged_over_sp=False).backward()
    return {
        "calls": dict(comm.calls), "kernel": dict(calls), "grads": [p.grad.clone() for p in model.parameters()],
        "alive_after_forward": alive_after_forward, "alive_after_backward": recompute.live_entries(),
    }
