"""TRL's ``SFTTrainer`` (trl 1.16) on ring_sp's ``U x R`` grid, under DeepSpeed, FSDP2 or DDP.

Set up exactly like :class:`.trainer.SequenceParallelTrainer`::

    from trl import SFTConfig
    from ring_sp.integrations.transformers import SequenceParallelSFTTrainer     # lazy: imports trl here
    from ring_sp.integrations.transformers.trainer import prepare_sequence_parallel

    args = SFTConfig(..., packing=True, max_length=32768, deepspeed="ds_config.json")  # holds "ring_sp": {...}
    prepare_sequence_parallel(args)                                    # groups + attn_implementation "ring_sp"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="ring_sp")
    trainer = SequenceParallelSFTTrainer(model=model, args=args, train_dataset=..., processing_class=tokenizer)
    trainer.train()

Under FSDP2 or DDP (no DeepSpeed) the settings are keywords instead,
``prepare_sequence_parallel(args, ulysses_size=2, ring_size=2)``, with FSDP2 asked for through
``accelerate launch --config_file examples/trl/fsdp2.yaml`` (:mod:`.fsdp`), else DDP (on CPU
ranks ``use_cpu=True``); which engine runs is :mod:`.engines`' (docs/engines.md).

Without ring_sp settings it IS ``trl.SFTTrainer``. With them, TRL prepares the
data as usual (tokenising, completion-only / assistant-only label masks, packing) and its
collator builds GLOBAL batches; ``max_length`` is the GLOBAL (whole-sequence) length, split
over the ``U x R`` ranks. Then:

* data: :class:`SFTShardCollator` turns each global batch into this rank's shard: TRL's
  padding-free rows (BFD packing, ``padding_free=True``: ``position_ids`` restarting per
  document, labels masked at document starts) become documents of the ``document_zigzag``
  layout; padded rows (``packing=False``) lose their padding and become documents of one
  flattened row (what sdpa's padding mask computes); ``seq_idx`` (linear-attention
  convolutions) is dropped. The samplers, the engine, the step's token count and the
  checkpoints are :class:`.trainer.SequenceParallelTrainer`'s;
* loss: TRL's fused LM head (per-token log-probabilities in chunks, never the full logits)
  on this rank's ``shift_labels``; its sum over the SP group, scaled as
  :class:`.trainer.SequenceParallelTrainer` scales its cross entropy, is the exact global
  token mean (``loss_type="dft"`` too: its weights are per token);
* metrics: ``mean_token_accuracy``, ``entropy`` and ``num_tokens`` are summed over all
  ``DP x SP`` ranks per micro-batch (one small all-reduce), so they equal one rank holding the
  whole batch; ``evaluate()`` gives the exact eval loss and the eval metrics as token means
  over the whole eval set;
* PEFT (``peft_config=LoraConfig(...)``): exact (only the adapters train; the fused head reads
  the frozen head weight).

Refused when the trainer is built, with the reason: ``use_liger_kernel`` (Liger's Triton
kernels replace layers ring_sp's attention and tiled MLP sit beside, untested on the grid;
ring_sp's ``tiled_mlp`` and TRL's fused head cover the memory), a Mixture-of-Experts router
aux loss (a per-shard mean; set ``router_aux_loss_coef=0``), vision datasets, plus everything
:class:`.trainer.SequenceParallelTrainer` refuses (``compute_metrics``, ``compute_loss_func``,
label smoothing, IterableDatasets, ...). TRL's other trainers (DPO, GRPO, KTO, ...) are not
covered. The section's ``tiled_loss`` adds nothing here: TRL's fused head already tiles the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import is_peft_model
from transformers.trainer_utils import EvalLoopOutput
from trl import SFTTrainer

from ring_sp import SequenceParallelTopology
from ring_sp.data import IGNORE_INDEX
from ring_sp.integrations import deepspeed as rsp_ds
from ring_sp.integrations.versions import require_supported

from .data import shard_batch
from .trainer import SequenceParallelTrainer
from .trainer_setup import prepare_sequence_parallel, ring_sp_settings

TOKENS_KEY = "ring_sp_num_tokens"  # the global batch's tokens (TRL's num_tokens metric), added to each shard
_DROPPED = ("seq_idx",)  # TRL's padding-free key for linear-attention convolutions (no ring_sp model uses it)


def flatten_padding(batch: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(A GLOBAL TRL batch without padding, its number of tokens as TRL's ``num_tokens`` counts them).

    Rows with an ``attention_mask`` holding zeros (``packing=False``) become ONE row of their
    real tokens, ``position_ids`` restarting at 0 per row (each row a document): the tokens,
    positions and targets sdpa's padding mask gives them. Other batches keep their form (an
    all-ones mask is dropped). No communication.
    """
    batch = {key: value for key, value in batch.items() if key not in _DROPPED}
    mask = batch.pop("attention_mask", None)
    input_ids = batch["input_ids"]
    if mask is None:
        return batch, int(input_ids.numel())
    mask = torch.as_tensor(mask).bool()
    tokens = int(mask.sum())
    if bool(mask.all()):
        return batch, tokens
    if "position_ids" not in batch:
        batch["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    flat = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.shape[:2] == mask.shape:
            flat[key] = value[mask].unsqueeze(0)  # row by row, real tokens only
        else:
            raise ValueError(f"batch[{key!r}] is not a [batch, seq] tensor; ring_sp cannot drop the padding of "
                             f"{type(value).__name__} (use padding_free=True or packing=True)")
    return flat, tokens


class SFTShardCollator:
    """Wraps TRL's collator of GLOBAL batches: returns this rank's shard plus :data:`TOKENS_KEY`.

    See :func:`flatten_padding` and :func:`..shard_batch` (``validate``: its; the trainer
    passes False and agrees once per step over all ranks instead).
    """

    def __init__(self, collator: Callable[[list[Any]], Mapping[str, Any]], topology: SequenceParallelTopology,
                 *, layout: str, pad_id: int = 0, validate: bool | None = None) -> None:
        if not callable(collator):
            raise TypeError(f"collator must be callable; got {type(collator).__name__}")
        self.collator, self.topology, self.layout, self.pad_id = collator, topology, layout, pad_id
        self.validate = validate

    def __call__(self, features: list[Any]) -> dict[str, torch.Tensor]:
        batch, tokens = flatten_padding(self.collator(features))
        shard = shard_batch(batch, self.topology, layout=self.layout, pad_id=self.pad_id, validate=self.validate)
        shard[TOKENS_KEY] = torch.tensor(tokens, dtype=torch.int64)
        return shard


class SequenceParallelSFTTrainer(SequenceParallelTrainer, SFTTrainer):
    """``trl.SFTTrainer`` for models with ``attn_implementation="ring_sp"`` (DeepSpeed, FSDP2 or DDP).

    Takes ``SFTTrainer``'s arguments. Without ring_sp's settings (an enabled ``"ring_sp"``
    section in ``args.deepspeed``, or ``prepare_sequence_parallel``'s keywords) it IS
    ``SFTTrainer``; with them, every step's loss, gradients and
    logged metrics equal ``SFTTrainer``'s on one rank holding the whole sequences (same
    global batch, sdpa): see the module docstring.
    """

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, **kwargs: Any) -> None:
        sp = None if args is None else ring_sp_settings(args)[0]
        if sp is not None:
            require_supported("trl", "ring_sp.integrations.transformers.SequenceParallelSFTTrainer")
            if getattr(args, "use_liger_kernel", False):
                raise ValueError(
                    "SequenceParallelSFTTrainer does not support use_liger_kernel with ring_sp: "
                    "Liger's Triton kernels (GPU only, deprecated by TRL) are untested beside ring_sp's attention; for "
                    f"memory at long context TRL's fused LM head already tiles the loss and the section's "
                    f'"tiled_mlp": true tiles the MLP; set use_liger_kernel=False')
        super().__init__(model, args, *rest, **kwargs)  # SequenceParallelTrainer -> SFTTrainer -> Trainer
        if self.ring_sp_topology is None:
            return
        if is_peft_model(self.model):
            require_supported("peft", "ring_sp.integrations.transformers.SequenceParallelSFTTrainer")
        refused = {
            "a Mixture-of-Experts router aux loss": (
                self.aux_loss_enabled, "it is a per-shard mean; set SFTConfig(router_aux_loss_coef=0.0)"),
            "vision datasets": (self._is_vision_dataset, "train on text"),
        }
        for name, (present, fix) in refused.items():
            if present:
                raise ValueError(f"SequenceParallelSFTTrainer does not support {name} with ring_sp ({self._source}); "
                                 f"{fix}")
        inner = self.data_collator.collator  # SequenceParallelTrainer wrapped TRL's collator; shard TRL's batches
        pad_id = getattr(inner, "pad_token_id", None) or 0
        self.data_collator = SFTShardCollator(inner, self.ring_sp_topology, layout=self.ring_sp_config.layout,
                                              pad_id=pad_id, validate=False)  # agreed per step (get_batch_samples)

    # ---------------------------------------------------------------- loss
    def _shard_loss_sum(self, model: torch.nn.Module, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(Sum of this shard's token losses in fp32, its valid-token count, TRL's fused outputs).

        TRL's fused LM head scores ``shift_labels`` as given (already shifted on the whole
        sequence by :func:`..shard_batch`); ``labels`` never reach the model.
        """
        inputs = dict(inputs)
        inputs.pop(TOKENS_KEY, None)
        shift_labels = inputs.pop("shift_labels", None)
        if shift_labels is None:
            raise ValueError("the batch has no 'shift_labels': build it with the trainer's collator (SFTShardCollator "
                             "around TRL's collator of global batches)")
        inputs.pop("labels", None)
        inputs["use_cache"] = False
        outputs = model(**inputs, shift_labels=shift_labels, fused_lm_head=True)
        per_token = -outputs.log_probs  # zero where the label is ignored
        if self.args.loss_type == "dft":  # Dynamic Fine-Tuning: each token weighted by its probability
            per_token = per_token * outputs.log_probs.exp().detach()
        return per_token.float().sum(), (shift_labels != IGNORE_INDEX).sum(), outputs

    @staticmethod
    def _metric_sums(outputs: Any, tokens: Any = 0) -> torch.Tensor:
        """float64 ``[valid tokens, entropy sum, correct top-1, tokens]`` of this rank's shard."""
        return torch.stack([outputs.label_mask.sum().double(), outputs.entropy.detach().double().sum(),
                            outputs.is_top1.sum().double(),
                            torch.as_tensor(tokens, dtype=torch.float64, device=outputs.label_mask.device)])

    def _record(self, mode: str, sums: torch.Tensor) -> None:
        """TRL's metrics from sums over all ``DP x SP`` ranks (``sums[3]``: tokens, counted by every SP rank)."""
        valid, entropy, correct, tokens = sums.tolist()
        self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += round(tokens / self.ring_sp_topology.sp_size)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """:meth:`.trainer.SequenceParallelTrainer.compute_loss` on TRL's fused head, plus TRL's metrics, exact."""
        if self.ring_sp_topology is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        tokens = inputs.get(TOKENS_KEY, 0)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        sums = self._metric_sums(outputs, tokens)
        dist.all_reduce(sums, group=self.ring_sp_topology.dp_sp_group)
        self._record("train" if self.model.training else "eval", sums)
        return (loss, outputs) if return_outputs else loss

    # ---------------------------------------------------------------- evaluation
    def evaluation_loop(self, dataloader: torch.utils.data.DataLoader, description: str,
                        prediction_loss_only: bool | None = None, ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """The exact eval loss (:meth:`.trainer.SequenceParallelTrainer.evaluation_loop`) and TRL's eval
        metrics as token means over the whole eval set, summed over all ``DP x SP`` ranks once at the end."""
        if self.ring_sp_topology is None:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        self._require_loss_only(description, prediction_loss_only)
        model, device = self.model, self.args.device
        sums = torch.zeros(4, dtype=torch.float64, device=device)
        counted: list[Any] = [None]  # the last batch counted: a replica out of batches repeats it, uncounted

        def loss_sum_of(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
            loss_sum, count, outputs = self._shard_loss_sum(model, self._prepare_inputs(batch))
            if batch is not counted[0]:
                sums.add_(self._metric_sums(outputs).to(device))
                counted[0] = batch
            return loss_sum, count

        model.eval()  # left in eval mode, as Trainer.evaluation_loop leaves it (TRL's log() reads the mode)
        loss, _ = rsp_ds.evaluation_loss(dataloader, loss_sum_of, self.ring_sp_topology, device=device)
        dist.all_reduce(sums, group=self.ring_sp_topology.dp_sp_group)
        self._metrics["eval"].clear()
        self._record("eval", sums)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics={f"{metric_key_prefix}_loss": loss},
                              num_samples=self.num_examples(dataloader))


__all__ = ["SFTShardCollator", "SequenceParallelSFTTrainer", "flatten_padding", "prepare_sequence_parallel"]
