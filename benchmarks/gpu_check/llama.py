"""The model gpu_check trains, and ring_sp's long-sequence recipe on it (one GPU).

* The model: transformers' ``LlamaForCausalLM`` with a :class:`ring_sp.plan.step_memory.Transformer`
  shape (:func:`llama_config`; Llama-3-8B's with a few layers on the GPU, a tiny one in the dry
  run), random weights from a config (nothing is downloaded), in the seam's dtype, every
  gradient allocated before the step (steady state: zeros, as after any first step).
* :class:`Step`: one library's training step on that model, ``step.train(ids)`` one forward +
  backward of the mean next-token loss of ``ids`` ``[1, n]`` inside what the library patches;
  ``step.pieces`` names what ran.
* :func:`ring_sp_step`: README's longest-sequence recipe as a user writes it: ``register`` on a
  one-rank topology, ``attn_implementation="ring_sp"``, activation checkpointing on, then
  ``enable_long_sequence(model, offload_checkpoints=True)`` with its defaults (tiled MLP and
  loss with tiles sized by ring_sp, lean layers, head chunks "auto"), the loss from
  ``model_loss``. :class:`RingSpRecipe` switches pieces off (the ``step`` section's modes:
  no checkpointing, checkpoints on the device, untiled).
* :func:`share_parameters`: one set of weights and gradients for several libraries' models
  (the ``step`` section's modes train one, so their losses agree).

ALST's recipe on the same model is :mod:`.alst`. Importing this module imports no
transformers (the GPU run may bring its wheel first: :mod:`.wheels`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ring_sp
import ring_sp.integrations.transformers as rsp_hf
from ring_sp.kernels import get_kernel
from ring_sp.plan.step_memory import PRESETS, Transformer

TINY = Transformer(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=300, name="tiny (dry)")


def llama_3_8b(layers: int) -> Transformer:
    """Llama-3-8B's shape (``PRESETS["llama-3-8b"]``) with ``layers`` decoder layers."""
    return dataclasses.replace(PRESETS["llama-3-8b"], layers=layers, name=f"Llama-3-8B-sized, {layers} layers")


def llama_config(shape: Transformer) -> Any:
    """transformers' ``LlamaConfig`` of ``shape``: RoPE of Llama-3 (theta 500,000, no scaling),
    positions up to 2^21, no dropout, untied head unless ``shape.tied``."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=1 << 21,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5,
                       attention_dropout=0.0, tie_word_embeddings=shape.tied)


def build_model(shape: Transformer, device: torch.device, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """``LlamaForCausalLM`` of ``shape`` on ``device`` in ``dtype`` (seed 0, so every library
    trains the same weights), in training mode, every gradient allocated (zeros)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(llama_config(shape), attn_implementation=attn_implementation,
                                              dtype=dtype)
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def tokens(n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``[1, n]`` random token ids (seeded by ``n``); their next-token labels are the ids shifted."""
    generator = torch.Generator(device=device).manual_seed(n)
    return torch.randint(0, vocab, (1, n), device=device, generator=generator)


def one_rank_topology() -> ring_sp.SequenceParallelTopology:
    """ring_sp's ``1 x 1`` grid, over a one-rank gloo group started here if none is (one rank
    exchanges nothing; the group carries ring_sp's checks)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return ring_sp.init_sequence_parallel(1, 1)


@dataclass
class Step:
    """One library's step on one model: ``loss_fn(ids)`` (``ids`` ``[1, n]``; the mean next-token
    loss, 0-d fp32), run with its backward by :meth:`train` inside ``context()`` (what the library
    patches only while its step runs: activation checkpointing runs its forward again in the
    backward, which must see the same kernels); ``pieces`` names what ran, for the records."""

    name: str
    model: nn.Module
    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    pieces: dict[str, str]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def train(self, ids: torch.Tensor) -> float:
        """One forward + backward on ``ids``; the loss's value (read after the backward)."""
        with self.context():
            loss = self.loss_fn(ids)
            loss.backward()
        return loss.item()

    def resident_bytes(self) -> int:
        """Parameters and their gradients, as allocated."""
        return sum(2 * p.numel() * p.element_size() for p in self.model.parameters())


@dataclass(frozen=True)
class RingSpRecipe:
    """Which of ``enable_long_sequence``'s pieces run (all, by default: README's recipe for the
    longest sequence). ``tiled=False``: no ``enable_long_sequence`` (untiled: full logits,
    transformers' modules); ``checkpointing``: activation checkpointing per decoder layer;
    ``offload``: its checkpoints in host memory (``offload_checkpoints=True``; on the CPU a
    tensor already lives there and stays, but the attention's re-run still computes again
    rather than keeping each layer's output, as on the GPU)."""

    tiled: bool = True
    checkpointing: bool = True
    offload: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # more enable_long_sequence keywords

    @property
    def name(self) -> str:
        name = "ring_sp " + ("defaults" if self.tiled else "untiled")
        return name + ("+offload" if self.offload else "+ckpt" if self.checkpointing else "")


def ring_sp_step(shape: Transformer, device: torch.device, dtype: torch.dtype,
                 recipe: RingSpRecipe = RingSpRecipe()) -> Step:
    """ring_sp's step on ``LlamaForCausalLM`` of ``shape`` (module docstring)."""
    topology = one_rank_topology()
    rsp_hf.register(topology, layout="zigzag")
    model = build_model(shape, device, dtype, rsp_hf.ATTN_IMPLEMENTATION)
    offload = recipe.offload
    if recipe.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if recipe.tiled:
        rsp_hf.enable_long_sequence(model, offload_checkpoints=offload, **recipe.extra)
    elif recipe.offload:
        raise ValueError("RingSpRecipe(tiled=False, offload=True): offloaded checkpoints come with "
                         "enable_long_sequence; use checkpointing=True, offload=False for the untiled baseline")

    def loss(ids: torch.Tensor) -> torch.Tensor:  # one rank: the plain mean (no topology, no reduction)
        shard = rsp_hf.shard_batch({"input_ids": ids}, topology)
        if recipe.tiled:
            return rsp_hf.model_loss(model, shard)
        logits = model(**{k: v for k, v in shard.items() if k != "shift_labels"}, use_cache=False).logits
        return rsp_hf.causal_lm_loss(logits, shard["shift_labels"])

    config = rsp_hf.long_sequence_config(model)
    kernel = get_kernel("auto", device, dtype, shape.head_dim).name
    pieces = {"attention": f"ring_sp, backend auto: {kernel}",
              "checkpointing": ("offloaded to host" if offload and device.type == "cuda" else "on the device")
              if recipe.checkpointing else "off",
              "mlp": "ring_sp tiled" if recipe.tiled else "transformers",
              "loss": "ring_sp tiled" if recipe.tiled else "transformers (full logits)",
              "lean_layers": str(bool(config and config.lean_layers)),
              "head_chunks": str(config.head_chunks if config else None)}
    return Step(recipe.name, model, loss, pieces)


def share_parameters(source: nn.Module, target: nn.Module) -> None:
    """Make every parameter of ``target`` the very parameter of ``source`` at the same name (the
    same architecture; wrappers ring_sp or ALST put around modules hold no parameters of their
    own): one set of weights and gradients for both, ``target``'s own freed."""
    for name, module in target.named_modules():
        mine = source.get_submodule(name)
        for key in module._parameters:
            module._parameters[key] = mine._parameters[key]


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` inside the block, restored after (a module global a library patches)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


__all__ = ["RingSpRecipe", "Step", "TINY", "build_model", "llama_3_8b", "llama_config", "one_rank_topology",
           "patched", "ring_sp_step", "share_parameters", "tokens"]
