"""Hugging Face transformers models on ring_sp's ``U x R`` grid.

    import ring_sp.integrations.transformers as rsp_hf

    name = rsp_hf.register(topology, layout="zigzag")            # -> "ring_sp"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)   # or from_pretrained / set_attn_implementation
    shard = rsp_hf.shard_batch(global_batch, topology)            # input_ids, position_ids, shift_labels (+ cu_seq_lens_*)
    logits = model(**shard).logits
    loss = rsp_hf.causal_lm_loss(logits, shard["shift_labels"], engine=engine)   # exact global token mean

* :func:`register`: ring_sp as an ``attn_implementation`` (attention + a mask hook that
  builds no mask), :func:`registered_topology` / :func:`registration`: what was registered.
* :func:`shard_batch`: a global HF batch of any length (padding-free packing included) ->
  this rank's shard, with a ``"ring_sp_shard"`` fingerprint the attention checks (a shard
  run on the wrong rank, topology, layout, documents or positions raises: :mod:`.shards`). Sliding windows (``sliding_window``, ``layer_types``) and attention
  sinks (gpt-oss) run exactly; Gemma 3's vision-language model with ``shard_batch(..., model=model)``
  (its image spans and the images of each shard: :mod:`.multimodal`).
* :func:`causal_lm_loss`: the exact loss over the SP group, scaled for the engine in use.
* :func:`enable_long_sequence` / :func:`model_loss`: the long-sequence step (tiled MLP,
  tiled logits + loss that never builds the full logits, checkpoints offloaded to host).
* ``model.generate(...)`` on every rank of the SP group: the prompt prefilled over the grid into
  a KV cache sharded over the ranks (:class:`RingSPCache`, exported lazily: it imports
  transformers), each token decoded against it; greedy and sampling, equal to one device's
  (:mod:`.generation`); :class:`GenerationCallback` samples the model every N steps of a Trainer,
  in the training processes, leaving the training bit for bit as it was.
* :class:`UnsupportedFeatureError`: what an unsupported model feature raises, on every rank,
  before any collective (chunked attention, attention dropout, padding or custom masks;
  beam search or speculative decoding in ``generate()``).

Importing this package does not import transformers: :func:`register` does. Nor does it
import :mod:`ring_sp.integrations.deepspeed`, which builds on it; the Trainer under DeepSpeed or
FSDP2 (:mod:`.trainer`, with :mod:`.trainer_setup` and :mod:`.fsdp`) stands on both and is
imported on its own.
:class:`SequenceParallelSFTTrainer` (TRL's ``SFTTrainer``, :mod:`.sft_trainer`) is exported
lazily: the first access to ``rsp_hf.SequenceParallelSFTTrainer`` imports it (and trl,
transformers, DeepSpeed's integration); importing the package imports none of them.
"""

from __future__ import annotations

from .attention import ATTN_IMPLEMENTATION, Registration, register, registered_topology, registration, uses_ring_sp
from .data import document_boundaries, shard_batch
from .features import UnsupportedFeatureError
from .long_sequence import enable_long_sequence, long_sequence_config, model_loss
from .loss import causal_lm_loss


def __getattr__(name: str) -> object:
    """``SequenceParallelSFTTrainer`` from :mod:`.sft_trainer` (it imports trl), ``RingSPCache`` from
    :mod:`.kv_cache` and ``GenerationCallback`` from :mod:`.generation_callback` (they import
    transformers), imported on first access."""
    if name == "SequenceParallelSFTTrainer":
        from .sft_trainer import SequenceParallelSFTTrainer

        return SequenceParallelSFTTrainer
    if name == "RingSPCache":
        from .kv_cache import RingSPCache

        return RingSPCache
    if name == "GenerationCallback":
        from .generation_callback import GenerationCallback

        return GenerationCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATION",
    "GenerationCallback",
    "Registration",
    "RingSPCache",
    "UnsupportedFeatureError",
    "causal_lm_loss",
    "document_boundaries",
    "enable_long_sequence",
    "long_sequence_config",
    "model_loss",
    "register",
    "registered_topology",
    "registration",
    "shard_batch",
    "uses_ring_sp",
]
