"""Lean layers for Hugging Face models: their RMSNorms through :func:`ring_sp.lean.rms_norm`.

``enable_long_sequence(model, lean_layers=True)`` (on by default with tiling) gives every
RMSNorm of a known class (:data:`LEAN_NORMS`: Llama, Qwen2/3, Mistral, OLMo 2, gpt-oss, Gemma
1/2/3, Mixtral, Qwen2-MoE, Granite, Phi-3; the q/k norms of Qwen3 and Gemma 3 included) a forward that keeps only its input and one
fp32 ``rstd`` per row for the backward, instead of the fp32 copies transformers' autograd
keeps; the values are the module's own (:mod:`ring_sp.lean`). An RMSNorm of another class is
an error naming it and ``lean_layers=False``. Liger-kernel's norms (``LigerRMSNorm``, after
``use_liger_kernel`` or ``apply_liger_kernel_to_*``) already keep only their input and rstd:
they are left as they are, never wrapped twice. Imports no transformers (classes by name).
"""

from __future__ import annotations

import torch
from torch import nn

from ring_sp.lean import rms_norm

from .tiled_modules import mix, unmix

# RMSNorm classes (transformers 5.18) -> how they apply their weight (ring_sp.lean.NORM_VARIANTS)
LEAN_NORMS = {"LlamaRMSNorm": "llama", "Qwen2RMSNorm": "llama", "Qwen3RMSNorm": "llama", "MistralRMSNorm": "llama",
              "MixtralRMSNorm": "llama", "Qwen2MoeRMSNorm": "llama", "GraniteRMSNorm": "llama", "Phi3RMSNorm": "llama",
              "Olmo2RMSNorm": "olmo", "GptOssRMSNorm": "olmo", "GemmaRMSNorm": "gemma", "Gemma2RMSNorm": "gemma",
              "Gemma3RMSNorm": "gemma"}


class LeanRMSNorm:
    """Mixed into a known RMSNorm's class: its forward through :func:`ring_sp.lean.rms_norm`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        eps = self.eps if hasattr(self, "eps") else self.variance_epsilon
        return rms_norm(hidden_states, self.weight, eps, LEAN_NORMS[type(self).__bases__[1].__name__])


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") or isinstance(module, LeanRMSNorm)


def check_lean_layers(model: nn.Module) -> list[nn.Module]:
    """The RMSNorms of ``model`` to make lean (none changed here); raises on one ring_sp does not know."""
    found = []
    for name, module in model.named_modules():
        if not _is_norm(module) or isinstance(module, LeanRMSNorm):
            found += [module] if isinstance(module, LeanRMSNorm) else []
            continue
        cls = type(module).__name__
        if cls.startswith("Liger"):  # already lean (input and rstd): left to Liger
            continue
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        weight = getattr(module, "weight", None)
        if cls not in LEAN_NORMS or not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
            raise ValueError(f"{name or 'model'} is a {cls}, which ring_sp's lean layers do not know (they replace "
                             f"{sorted(LEAN_NORMS)} with a 1-D weight and an eps); pass lean_layers=False")
        found.append(module)
    if not found:
        raise ValueError(f"{type(model).__name__} has no RMSNorm ring_sp's lean layers know ({sorted(LEAN_NORMS)}); "
                         f"pass lean_layers=False")
    return found


def set_lean_layers(model: nn.Module, on: bool) -> None:
    """Switch every known RMSNorm of ``model`` to the lean forward (``on``) or back, in place.
    Call :func:`check_lean_layers` first when switching on."""
    for module in list(model.modules()):
        if on and not isinstance(module, LeanRMSNorm) and type(module).__name__ in LEAN_NORMS:
            mix(module, LeanRMSNorm)
        elif not on and isinstance(module, LeanRMSNorm):
            unmix(module)


__all__ = ["LEAN_NORMS", "LeanRMSNorm", "check_lean_layers", "set_lean_layers"]
