"""The whole model the step's memory depends on: :class:`Transformer`, the presets, HF configs.

Pure data: the shapes of a decoder-only LM (attention heads, MLP width, layers, vocabulary),
read from a preset name or an HF ``config.json`` (Llama / Qwen / Mistral-style keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .request import PlanError


@dataclass(frozen=True)
class Transformer:
    """A decoder-only LM: Llama-style attention (``heads`` q / ``kv_heads`` kv of ``head_dim``),
    a gated MLP of ``ffn``, RMSNorms, an embedding and an LM head (``tied``: one matrix)."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool = False
    name: str = "custom"

    @property
    def q_width(self) -> int:
        """Elements of q (and of the attention output) per token: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Elements of k (or v) per token in sequence layout: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.q_width, self.kv_width
        return h * q + 2 * h * kv + q * h + 3 * h * self.ffn + 2 * h  # q k v o, gate up down, two norms

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden

    @property
    def largest_param(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * self.ffn, self.hidden * self.q_width)

    @staticmethod
    def from_hf_config(config: dict | str | Path, name: str | None = None) -> Transformer:
        """From an HF ``config.json`` (path or dict): Llama / Qwen / Mistral-style keys."""
        if not isinstance(config, dict):
            path = Path(config)
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise PlanError(f"model={str(path)!r}: cannot read an HF config.json ({exc}); pass a preset "
                                f"({', '.join(PRESETS)}) or the path of a model's config.json") from None
            name = name or path.parent.name or path.name
        config = config.get("text_config", config)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                               "vocab_size") if not isinstance(config.get(k), int)]
        if missing:
            raise PlanError(f"the HF config lacks {', '.join(missing)}: only decoder-only LMs with Llama-style keys "
                            f"(a dense gated MLP) can be planned")
        heads = config["num_attention_heads"]
        return Transformer(hidden=config["hidden_size"], ffn=config["intermediate_size"], heads=heads,
                           kv_heads=config.get("num_key_value_heads") or heads,
                           head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                           layers=config["num_hidden_layers"], vocab=config["vocab_size"],
                           tied=bool(config.get("tie_word_embeddings", False)), name=name or config.get("model_type", "hf"))


# The published config.json values (meta-llama/Meta-Llama-3-8B, -70B; Qwen/Qwen3-32B).
PRESETS = {
    "llama-3-8b": Transformer(4096, 14336, 32, 8, 128, 32, 128256, name="Llama-3-8B"),
    "llama-3-70b": Transformer(8192, 28672, 64, 8, 128, 80, 128256, name="Llama-3-70B"),
    "qwen3-32b": Transformer(5120, 25600, 64, 8, 128, 64, 151936, name="Qwen3-32B"),
}


def model_from(spec: str) -> Transformer:
    """A preset name (case-insensitive) or the path of an HF ``config.json`` (or its folder)."""
    if spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise PlanError(f"model={spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config.json")
    return Transformer.from_hf_config(path)


__all__ = ["PRESETS", "Transformer", "model_from"]
