"""ALST's long-sequence recipe on one GPU, on the same ``LlamaForCausalLM`` as ring_sp's (:mod:`.llama`).

The recipe ALST's users run on one GPU is ArcticTraining's (snowflakedb/ArcticTraining,
``projects/sequence-parallelism/run-h100-sp1-llama-8b.yml`` and ``run-h200-sp1-llama-8b-liger-
offload-tiled-mlp.yml``: ``sequence_parallel_size: 1``, ``activation_checkpoint_cpu_offload: true``,
``tiled_mlp_compute: true``, ``model: type: "liger"``, ``attn_implementation: flash_attention_2``
on the H100 and ``_3`` on the H200; DeepSpeed's ALST tutorial points there). Its pieces, each
as the source does it:

* DeepSpeed's ``TiledMLP`` on every decoder MLP, ``ceil(seqlen / hidden)`` tiles of
  ``down(act(gate(x)) * up(x))`` (ArcticTraining ``arctic_training/model/tiled_compute.py``,
  ``tiled_mlp_forward_common``; one rank: no all-reduce of the tile count);
* Liger's kernels where they apply (``arctic_training/model/liger_factory.py``:
  ``AutoLigerKernelForCausalLM`` with ``swiglu=False`` under the tiled MLP): RMSNorm, RoPE, and
  the fused linear cross entropy for the loss (``arctic_training/trainer/sft_trainer.py``: at
  ``sequence_parallel_size == 1`` the loss is ``model(**batch).loss``, Liger's). Applied with
  ``apply_liger_kernel_to_llama(model=...)``; its module-global RoPE patch is held only while
  an ALST step runs (:attr:`Step.context`), so a ring_sp model in the same process keeps
  transformers' RoPE. Without Liger (the dry run: Liger's kernels are Triton, CUDA only; or
  ``liger=False``) the norms and RoPE are transformers' and the loss is DeepSpeed's
  ``TiledFusedLogitsLoss`` with ArcticTraining's shards of about 1 GiB of fp32 logits each
  (``sft_trainer.py``'s non-Liger path);
* activation checkpointing of every decoder layer (reentrant), its input copied to pageable
  host memory in the forward and back, synchronously, when its backward starts
  (ArcticTraining ``arctic_training/monkey_patches.py``, ``CheckpointFunctionWithCPUOffload``):
  here torch's ``save_on_cpu(pin_memory=False)`` around torch's reentrant checkpoint, which
  saves exactly that input and moves it the same way;
* the attention: transformers' ``sdpa`` held to SDPA's flash backend, the flash-attention 2
  kernel the recipe's ``flash_attention_2`` runs (flash-attn itself is not on the GPU image),
  GQA without repeating KV heads (``enable_gqa``).

:class:`AlstRecipe`'s options turn pieces off: the ``step`` section times ALST's modules as
issue 38 did (``AlstRecipe(liger=False, sdpa_backend=None, offload_checkpoints=False)``: no
Liger, SDPA's own choice of kernel, checkpoints on the device).

DeepSpeed and Liger are imported by :func:`alst_step` (the GPU machine may lack them: the
caller records the ALST rows as skipped with the import error).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from ring_sp.plan.step_memory import Transformer

from .llama import Step, build_model, patched

ALST_LOSS_TILE_BYTES = 2**30  # ArcticTraining's non-Liger loss: shards of about 1 GiB of fp32 logits


@dataclass(frozen=True)
class AlstRecipe:
    """``liger``: Liger's RMSNorm, RoPE and fused linear cross entropy (True), or transformers'
    modules and DeepSpeed's ``TiledFusedLogitsLoss`` (False); None: Liger wherever it can run
    (CUDA, liger-kernel importable), the reason in ``Step.pieces`` where not.
    ``sdpa_backend``: the one SDPA backend the attention may run (flash-attention 2, as the
    recipe's ``flash_attention_2``), or None: torch's own choice (cuDNN's on an H200: the modules
    issue 38 timed). ``offload_checkpoints``: each layer's checkpointed input in host memory (the
    recipe), or on the device."""

    liger: bool | None = None
    sdpa_backend: SDPBackend | None = SDPBackend.FLASH_ATTENTION
    offload_checkpoints: bool = True


def liger_unavailable(device: torch.device) -> str | None:
    """Why Liger's kernels cannot run on ``device``, or None."""
    if device.type != "cuda":
        return f"Liger's kernels are Triton kernels for CUDA; this run is on {device.type}"
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (any import failure is the reason)
        return f"liger-kernel is not importable ({type(exc).__name__}: {exc}); bring its wheel with --wheels"
    return None


def tiled_mlp_forward(tiled_mlp: Any) -> Any:
    """An MLP forward through DeepSpeed's ``TiledMLP`` with ArcticTraining's ``ceil(seqlen / hidden)`` tiles."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shards = math.ceil(x.shape[-2] / x.shape[-1])

        def gated(self: nn.Module, t: torch.Tensor) -> torch.Tensor:
            return self.down_proj(self.act_fn(self.gate_proj(t)) * self.up_proj(t))

        return tiled_mlp.apply(gated, self, x, shards, [self.down_proj.weight, self.gate_proj.weight,
                                                         self.up_proj.weight])

    return forward


def offloaded_checkpoint(function: Any, *args: Any) -> Any:
    """A reentrant checkpoint whose saved input lives in pageable host memory (module docstring)."""
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        return checkpoint(function, *args, use_reentrant=True)


def _apply_liger(model: nn.Module) -> Any:
    """Liger's RMSNorm / RoPE / fused linear cross entropy on ``model`` (not its SwiGLU: the MLP is
    tiled); returns Liger's RoPE function, whose module-global patch is undone here and held
    again by each ALST step."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    saved = {name: getattr(modeling_llama, name) for name in ("apply_rotary_pos_emb", "LlamaRMSNorm")}
    try:
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
        rope = modeling_llama.apply_rotary_pos_emb
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)
    return rope


def alst_step(shape: Transformer, device: torch.device, dtype: torch.dtype, recipe: AlstRecipe = AlstRecipe()) -> Step:
    """ALST's step on ``LlamaForCausalLM`` of ``shape`` (module docstring)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from transformers.models.llama import modeling_llama

    reason = liger_unavailable(device)
    if recipe.liger and reason:
        raise RuntimeError(f"AlstRecipe(liger=True): {reason}")
    liger = reason is None and recipe.liger is not False
    model = build_model(shape, device, dtype, "sdpa")
    rope = _apply_liger(model) if liger else None
    for layer in model.model.layers:
        layer.mlp.forward = tiled_mlp_forward(TiledMLP).__get__(layer.mlp)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if recipe.offload_checkpoints:
        for layer in model.model.layers:
            layer._gradient_checkpointing_func = offloaded_checkpoint

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with (sdpa_kernel(recipe.sdpa_backend) if recipe.sdpa_backend is not None else contextlib.nullcontext()), (
                patched(modeling_llama, "apply_rotary_pos_emb", rope) if liger else contextlib.nullcontext()):
            yield

    def liger_loss(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    def tiled_loss(ids: torch.Tensor) -> torch.Tensor:
        shift_labels = F.pad(ids, (0, 1), value=-100)[:, 1:]
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        shards = max(1, math.ceil(ids.numel() * shape.vocab * 4 / ALST_LOSS_TILE_BYTES))
        good = (shift_labels != -100).sum()

        def loss_sum(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = module.lm_head(x)
            return module.loss_function(logits=logits, labels=None, vocab_size=shape.vocab, shift_labels=y) * (
                (y != -100).sum())

        total = TiledFusedLogitsLoss.apply(loss_sum, model, hidden, shift_labels, None, shards,
                                           [model.lm_head.weight], "sum")
        return total / good.clamp(min=1)

    without = f"transformers' (Liger off: {reason or 'liger=False'})"
    attention = {None: "sdpa, torch's own choice of kernel", SDPBackend.FLASH_ATTENTION: "sdpa, flash backend "
                 "(flash-attention 2)"}.get(recipe.sdpa_backend, f"sdpa, {recipe.sdpa_backend}")
    pieces = {"attention": attention,
              "checkpointing": "every layer, its input in pageable host memory" if recipe.offload_checkpoints
              else "every layer, on the device",
              "mlp": "DeepSpeed TiledMLP, ceil(n / hidden) tiles",
              "norm_rope": "Liger" if liger else without,
              "loss": "Liger fused linear cross entropy" if liger else
              "DeepSpeed TiledFusedLogitsLoss, 1 GiB fp32 logits per tile"}
    return Step("ALST" if liger else "ALST (no Liger)", model, liger_loss if liger else tiled_loss, pieces, context)


__all__ = ["ALST_LOSS_TILE_BYTES", "AlstRecipe", "alst_step", "liger_unavailable", "offloaded_checkpoint",
           "tiled_mlp_forward"]
