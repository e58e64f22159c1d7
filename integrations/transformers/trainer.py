"""The Hugging Face ``Trainer`` (transformers 5.18, accelerate 1.15) with ring_sp, on DeepSpeed, FSDP2 or DDP.

A Trainer script whose DeepSpeed config has a ``"ring_sp"`` section changes by an import and
three lines (``prepare_sequence_parallel``, ``attn_implementation``, the Trainer class)::

    from ring_sp.integrations.transformers.trainer import SequenceParallelTrainer, prepare_sequence_parallel

    args = TrainingArguments(..., deepspeed="ds_config.json")        # holds "ring_sp": {...}
    prepare_sequence_parallel(args)                                   # groups + attn_implementation "ring_sp"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ring_sp")
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=..., data_collator=...)
    trainer.train()

The collator still returns GLOBAL batches (``input_ids``, ``labels``, optional
``position_ids`` restarting per packed document). What the Trainer needs, and where:

* engine: accelerate 1.15 calls ``deepspeed.initialize`` with no ``mpu`` (its own
  ``ParallelismConfig(sp_backend="deepspeed")`` only knows DeepSpeed's Ulysses, ALST:
  its attention, its data adapter, SP degree <= heads). While :meth:`train` runs, that call
  goes to :func:`ring_sp.integrations.deepspeed.initialize`, which adds ring_sp's mpu
  (ZeRO over all ``DP x SP`` ranks) and adopts the registered topology;
* data: the ranks of one SP group must read the same samples, so the sampler splits the
  dataset over the ``DP`` replicas (``sequence_parallel_sampler``) and accelerate's own
  split over all ranks is undone; the collator is wrapped to return this rank's shard
  (:func:`..shard_batch`);
* loss: the Trainer counts the valid tokens of the whole optimizer step (every
  gradient-accumulation micro-batch, every rank) and the loss is the token mean over them,
  as the Trainer does without SP, with the backward scaled for the ZeRO stage's reduction;
  the section's ``tiled_mlp`` / ``tiled_loss`` / ``offload_checkpoints`` (applied by
  ``initialize``) make it the long-sequence step (:func:`..model_loss`'s tiled loss).

FSDP2 or DDP instead of DeepSpeed: ``prepare_sequence_parallel(args, ulysses_size=2,
ring_size=2)`` (the section's keys as keywords), with FSDP2 asked for through accelerate
(``accelerate launch --config_file fsdp2.yaml``; :mod:`.fsdp`: on CPU ranks, where
accelerate 1.15 sets no FSDP up, the trainer shards the model itself when it is built), else
DDP (``torchrun``; on CPU ranks with ``use_cpu=True``). No engine is routed, the loss is
scaled for their mean over all ranks, the data and evaluation are as above. A DeepSpeed
config accelerate drops (``use_cpu=True`` / ``ACCELERATE_USE_CPU``) trains under DDP too,
exactly, unless the model was built partitioned by ZeRO-3 (refused). :mod:`.engines` picks
the engine when the trainer is built and checks the model accelerate prepared before the
first step; every engine is exact or refused (docs/engines.md).

Importing this module (with DeepSpeed installed) keeps DeepSpeed's CPU backend from
JIT-compiling its C++ shared-memory op when ``TrainingArguments`` starts it
(:func:`ring_sp.integrations.deepspeed.skip_cpu_inference_comm_build`, applied by
:mod:`.trainer_setup`, which holds the setup around the Trainer; nothing on CUDA).

* errors in the batches (``shard_batch``'s, the collator's, on any rank) raise on every rank,
  each step: one agreement over all ranks when the step's batches are fetched, before its
  first collective (:meth:`SequenceParallelTrainer.get_batch_samples`; evaluation likewise).
* evaluation: ``evaluate()`` (also ``eval_strategy="steps"``) returns the exact eval loss,
  the token mean over the whole eval set (:meth:`SequenceParallelTrainer.evaluation_loop`).
* checkpoints: a ``checkpoint-N`` folder gets a completion marker, written last by rank 0
  once every rank has written its files; ``resume_from_checkpoint=True`` takes the newest
  complete folder (a run killed while saving leaves a half-written one, which transformers
  would take), a path without the marker is refused.

Not supported (each raises when the Trainer is built): ``compute_metrics`` and ``predict()``
without ``prediction_loss_only`` (the logits are sharded; raises when called),
``compute_loss_func``, label smoothing, ``batch_rebalance``
or ``group_by_length`` sampling, IterableDatasets, accelerate's ``split_batches`` /
``dispatch_batches``, DataParallel (``n_gpu > 1``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput, rotate_checkpoints
from transformers.training_args import ParallelMode

from ring_sp import SequenceParallelTopology, sequence_parallel_loss
from ring_sp.agreement import CallSignature, raise_together
from ring_sp.data import IGNORE_INDEX
from ring_sp.integrations import deepspeed as rsp_ds
from ring_sp.integrations.versions import require_supported

from . import engines, fsdp
from .attention import ATTN_IMPLEMENTATION, uses_ring_sp
from .long_sequence import enable_long_sequence, shard_loss_sum
# the setup around the Trainer; SequenceParallelCollator and prepare_sequence_parallel are re-exported
from .trainer_setup import (SequenceParallelCollator, complete_checkpoint, mark_checkpoint_complete,
                            prepare_sequence_parallel, registered_topology_for, ring_sp_settings,
                            routed_deepspeed_initialize, section_hidden_from_accelerate, unshard)

_NO_LOGITS = (
    "the logits are sharded over the sequence-parallel ranks, so predictions and compute_metrics are not available; "
    "evaluate() gives the exact eval loss (prediction_loss_only), and for metrics on logits save the model "
    "(trainer.save_model) and predict with it on one rank without ring_sp (attn_implementation='sdpa')"
)


class SequenceParallelTrainer(Trainer):
    """``transformers.Trainer`` for models with ``attn_implementation="ring_sp"`` (DeepSpeed, FSDP2 or DDP).

    Takes ``Trainer``'s arguments. Without ring_sp's settings (an enabled ``"ring_sp"``
    section in ``args.deepspeed``, or ``prepare_sequence_parallel``'s keywords) it IS
    ``Trainer``. With them, every rank of an SP group trains on its shard of the same samples
    and the optimizer step equals the same step of one rank holding the whole sequences (same
    global batch): see the module docstring. ``ring_sp_topology`` is the grid and
    ``ring_sp_engine`` the engine (:class:`.engines.Engine`); None without settings.
    """

    # class defaults: the base __init__ (TRL's too) may call overridden methods first
    ring_sp_engine: engines.Engine | None = None
    ring_sp_topology: SequenceParallelTopology | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sp, ds_config = ring_sp_settings(self.args)  # the keywords (FSDP2, DDP), else DeepSpeed's section
        if self.is_deepspeed_enabled and (sp is None or ds_config is not None):  # the config accelerate applies
            ds_config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            sp = rsp_ds.RingSPConfig.from_ds_config(ds_config)
        self.ring_sp_config = sp
        section = {} if ds_config is None else ds_config.get(rsp_ds.SECTION)
        if isinstance(section, dict) and section.get("backend") == "auto":
            # accelerate takes every "auto" in the config for a value IT must fill in, and raises
            del section["backend"]  # the default, so the same choice
        if sp is not None:
            require_supported("accelerate", "ring_sp.integrations.transformers.trainer")
        if sp is None:
            if uses_ring_sp(self.model):
                raise ValueError(
                    f'the model uses attn_implementation="{ATTN_IMPLEMENTATION}" but ring_sp has no settings: with '
                    f'DeepSpeed add an enabled "{rsp_ds.SECTION}" section to its config (TrainingArguments.deepspeed), '
                    f'e.g. "ring_sp": {{"ulysses_size": 2, "ring_size": 2}}; with FSDP2 or DDP call '
                    f"prepare_sequence_parallel(args, ulysses_size=2, ring_size=2) on these arguments"
                )
            return
        self.ring_sp_engine = engines.trainer_engine(self.args, self.accelerator, self.model, sp, ds_config)
        self.ring_sp_topology = self._check_setup(sp)
        # the trainer agrees on the batches' errors once per step over all ranks (get_batch_samples)
        self.data_collator = SequenceParallelCollator(self.data_collator, self.ring_sp_topology, layout=sp.layout,
                                                      validate=False, model=self.model)
        # the loss below takes num_items_in_batch: the Trainer must not divide it by the GA steps again
        self.model_accepts_loss_kwargs = True
        if self.ring_sp_engine.kind != engines.DEEPSPEED:
            self._set_up_without_deepspeed(sp)

    @property
    def ring_sp_fsdp(self) -> bool:
        """Whether the engine is FSDP2."""
        return self.ring_sp_engine is not None and self.ring_sp_engine.kind == engines.FSDP2

    @property
    def ring_sp_shards_itself(self) -> bool:
        """FSDP2 on CPU ranks: the trainer sharded the model itself (accelerate sets no FSDP up there)."""
        return self.ring_sp_engine is not None and self.ring_sp_engine.shards_itself

    def _set_up_without_deepspeed(self, sp: rsp_ds.RingSPConfig) -> None:
        """FSDP2 or DDP: the settings' tiled MLP / loss now (DeepSpeed's ``initialize`` applies them there);
        FSDP2: its checks, then the model sharded here on CPU ranks, where accelerate does not (:mod:`.fsdp`);
        on GPUs accelerate shards it, and wraps it in DDP, when training starts."""
        if self.ring_sp_fsdp:
            fsdp.check_trainer(self.args, self.accelerator, shards_itself=self.ring_sp_shards_itself)
        if sp.long_sequence is not None:
            enable_long_sequence(self.model, **sp.long_sequence)
        if self.ring_sp_shards_itself:
            self.model = self.model_wrapped = fsdp.shard_model(self.model, fsdp.fsdp_plugin(self.args))

    def _check_setup(self, sp: rsp_ds.RingSPConfig) -> SequenceParallelTopology:
        """Everything local that must hold, checked on every rank before any collective."""
        topology = registered_topology_for(sp, self.model, self._source)
        args = self.args
        unsupported = {
            "compute_loss_func": (self.compute_loss_func is not None, "drop it (the loss is the exact causal-LM loss)"),
            "label_smoothing_factor": (args.label_smoothing_factor != 0, "set it to 0"),
            f"train_sampling_strategy={args.train_sampling_strategy!r}": (
                args.train_sampling_strategy not in ("random", "sequential"), "use 'random' or 'sequential'"),
            "an IterableDataset": (isinstance(self.train_dataset, torch.utils.data.IterableDataset),
                                   "use a map-style dataset (the sampler splits it over the data-parallel replicas)"),
            "accelerator_config.split_batches": (args.accelerator_config.split_batches, "set it to False"),
            "accelerator_config.dispatch_batches": (bool(args.accelerator_config.dispatch_batches), "set it to False"),
            "n_gpu > 1 (DataParallel)": (args.n_gpu > 1, "launch one process per device"),
            "compute_metrics": (self.compute_metrics is not None, _NO_LOGITS),
            f"{rsp_ds.SECTION}.offload_checkpoints without gradient_checkpointing": (
                sp.offload_checkpoints and not args.gradient_checkpointing,
                f'set TrainingArguments(gradient_checkpointing=True) or "{rsp_ds.SECTION}": {{"offload_checkpoints": false}}'),
        }
        for name, (present, fix) in unsupported.items():
            if present:
                raise ValueError(f"{type(self).__name__} does not support {name} with ring_sp ({self._source}); {fix}")
        return topology

    @property
    def _source(self) -> str:
        """Where ring_sp's settings came from and the engine they run on, for messages."""
        return self.ring_sp_engine.configured

    def _require_loss_only(self, description: str, prediction_loss_only: bool | None) -> None:
        """Raise unless only the loss is asked for: the logits stay sharded (``_NO_LOGITS``)."""
        loss_only = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        if not loss_only:
            call = "predict" if description == "Prediction" else "evaluate"
            raise ValueError(f"{type(self).__name__}.{call} without prediction_loss_only with ring_sp "
                             f"({self._source}): {_NO_LOGITS}")

    # ---------------------------------------------------------------- engine and checkpoints
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest COMPLETE checkpoint
        (:func:`.trainer_setup.complete_checkpoint`), and a path must be one."""
        with section_hidden_from_accelerate(self.accelerator) as section:
            if self.ring_sp_topology is None:
                return super().train(resume_from_checkpoint, *args, **kwargs)
            resume = complete_checkpoint(self.args.output_dir, resume_from_checkpoint)
            if self.ring_sp_engine.kind != engines.DEEPSPEED:  # no DeepSpeed engine to route
                return super().train(resume, *args, **kwargs)
            with routed_deepspeed_initialize(section):
                return super().train(resume, *args, **kwargs)

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """``Trainer``'s (the model prepared by accelerate), then, before the first step, the check that
        it runs the engine the loss is scaled for (:func:`.engines.check_prepared`)."""
        model, loader = super()._prepare_for_training(*args, **kwargs)
        if self.ring_sp_topology is not None:
            engines.check_prepared(self.ring_sp_engine, model)
        return model, loader

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; where the trainer sharded the model itself (FSDP2 on CPU ranks) the
        whole state dict is gathered first (collective: every rank calls it) and rank 0 writes it."""
        if not self.ring_sp_shards_itself:
            return super().save_model(output_dir, _internal_call)
        state_dict = fsdp.full_state_dict(self.model)
        if dist.get_rank() == 0:  # not args.should_save: accelerate's state without FSDP sees every rank as rank 0
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)
        return None

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``Trainer``'s; where accelerate's state has no distributed type (FSDP2 on CPU ranks) it would log
        rank 0's loss alone, so the loss is first averaged over all ranks as on GPUs."""
        if (self.ring_sp_shards_itself and self.args.parallel_mode != ParallelMode.DISTRIBUTED
                and self.control.should_log and self.state.global_step > self._globalstep_last_logged):
            fsdp.mean_over_ranks_(tr_loss)  # reset to zero by the Trainer right after logging
        return super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``Trainer._save_checkpoint``, then the completion marker once every rank has written its
        files; older checkpoints are rotated out (``save_total_limit``) only after that."""
        if self.ring_sp_topology is None:
            return super()._save_checkpoint(model, trial)
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial=trial)
        mark_checkpoint_complete(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"),
                                 self.state.global_step)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        return None

    # ---------------------------------------------------------------- evaluation
    def evaluation_loop(self, dataloader: torch.utils.data.DataLoader, description: str,
                        prediction_loss_only: bool | None = None, ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """The exact loss over the evaluation set: ``{prefix}_loss`` = the GLOBAL token mean.

        Serves ``evaluate()`` (also with ``eval_strategy="steps"`` while training) and, with
        ``prediction_loss_only``, ``predict()``. Each DP replica evaluates its slice of the set
        (every sample once, :func:`..deepspeed.sequence_parallel_eval_sampler`), each SP rank
        its shard of it; the token-loss sums and valid-token counts are summed over all
        ``DP x SP`` ranks once at the end, so the result is what one rank holding every whole
        sequence computes (the plain Trainer's ``eval_loss`` when every batch holds the same
        number of valid tokens; with unequal batches it averages the batch means instead).
        Predictions (logits) are sharded over the SP ranks and never gathered: without
        ``prediction_loss_only`` this raises (see ``_NO_LOGITS``).
        """
        if self.ring_sp_topology is None:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        self._require_loss_only(description, prediction_loss_only)
        model = self.model

        def loss_sum_of(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
            loss_sum, count, _ = self._shard_loss_sum(model, self._prepare_inputs(batch))
            return loss_sum, count

        was_training = model.training
        model.eval()
        try:
            loss, _ = rsp_ds.evaluation_loss(dataloader, loss_sum_of, self.ring_sp_topology, device=self.args.device)
        finally:
            model.train(was_training)
        return EvalLoopOutput(predictions=None, label_ids=None, metrics={f"{metric_key_prefix}_loss": loss},
                              num_samples=self.num_examples(dataloader))

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        loader = super().get_eval_dataloader(eval_dataset)
        if self.ring_sp_topology is not None:
            unshard(loader)
        return loader

    def get_test_dataloader(self, test_dataset: Any) -> torch.utils.data.DataLoader:
        loader = super().get_test_dataloader(test_dataset)
        if self.ring_sp_topology is not None:
            unshard(loader)
        return loader

    def _get_eval_sampler(self, eval_dataset: Any) -> torch.utils.data.Sampler | None:
        """Over the DP replicas, each sample once (a padded ``DistributedSampler`` would repeat some)."""
        if self.ring_sp_topology is None:
            return super()._get_eval_sampler(eval_dataset)
        return rsp_ds.sequence_parallel_eval_sampler(eval_dataset, self.ring_sp_topology)

    # ---------------------------------------------------------------- data
    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        """Over the DP replicas: every rank of an SP group draws the same samples."""
        if self.ring_sp_topology is None:
            return super()._get_train_sampler(train_dataset)
        dataset = self.train_dataset if train_dataset is None else train_dataset
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return rsp_ds.sequence_parallel_sampler(dataset, self.ring_sp_topology, seed=seed,
                                                shuffle=self.args.train_sampling_strategy == "random",
                                                drop_last=self.args.dataloader_drop_last)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        loader = super().get_train_dataloader()
        if self.ring_sp_topology is not None:
            unshard(loader)
        return loader

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step: the SP ranks of a replica share theirs."""
        if self.ring_sp_topology is None:
            return super().get_total_train_batch_size(args)
        return self._train_batch_size * args.gradient_accumulation_steps * self.ring_sp_topology.dp_size

    # ---------------------------------------------------------------- loss
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The step's micro-batches and its number of valid target tokens over ALL ranks.

        Each rank counts its shards' ``shift_labels``; the SP ranks hold disjoint tokens and
        the replicas different samples, so the sum over all ``DP x SP`` ranks is the count of
        the whole global step (what one rank holding everything would count). An error fetching
        them (the collator's, ``shard_batch``'s) on any rank raises on every rank first, with that
        rank's message (one agreement, :func:`ring_sp.agreement.raise_together`).
        """
        if self.ring_sp_topology is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batch_samples, error = [], None
        try:  # Trainer's fetch without its count (nor the count's gather: a collective before the agreement)
            batch_samples.extend(batch for _, batch in zip(range(num_batches), epoch_iterator))
        except (TypeError, ValueError) as exc:  # the collators shard without communicating: fail every rank here
            error = exc
        signature = CallSignature.named("shard", (num_batches,), f"the step's {num_batches} batches")
        raise_together(self.ring_sp_topology.dp_sp_group, signature, error, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        for batch in batch_samples:
            count += (batch["shift_labels"] != IGNORE_INDEX).sum().to(device)
        dist.all_reduce(count, group=self.ring_sp_topology.dp_sp_group)
        return batch_samples, count

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """Cross entropy of this rank's shard as a share of the exact global token mean.

        With ``num_items_in_batch`` (the step's valid tokens over all ranks, from
        :meth:`get_batch_samples`) the value is ``sum(SP group's token losses) x DP / count``,
        so the Trainer's mean over all ranks and micro-batches logs the step's token mean,
        and the backward gives ``count``'s token-mean gradient once the engine has reduced
        it (sum over SP for ZeRO 0-2, mean for ZeRO-3, FSDP2 and DDP). Without it: the micro-batch's
        token mean over the SP group (:func:`..causal_lm_loss`).
        """
        if self.ring_sp_topology is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        topology = self.ring_sp_topology
        averaged = self.ring_sp_engine.gradients_averaged_over_sp(self.deepspeed)  # ZeRO-3, FSDP2, DDP: yes
        loss_sum, count, outputs = self._shard_loss_sum(model, inputs)  # tiled when the section says so
        if num_items_in_batch is not None:
            # every rank claims an equal share of the step's count: summed over the SP group it is
            # the replica's share count / DP, so the value and backward are as documented above
            count = torch.as_tensor(num_items_in_batch, dtype=torch.float64, device=loss_sum.device)
            count = count / (topology.dp_size * topology.sp_size)
        loss = sequence_parallel_loss(loss_sum, count, group=topology.sp_group, gradients_averaged_over_sp=averaged)
        return (loss, outputs) if return_outputs else loss

    @staticmethod
    def _shard_loss_sum(model: torch.nn.Module, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(sum of this shard's token losses in fp32, its valid-token count, the model's outputs);
        ``labels`` never reach the model; the loss is tiled when ``enable_long_sequence`` says so."""
        inputs = dict(inputs)
        shift_labels = inputs.pop("shift_labels", None)
        if shift_labels is None:
            raise ValueError("the batch has no 'shift_labels': build it with the Trainer's collator "
                             "(SequenceParallelCollator around a collator of global batches with input_ids/labels)")
        inputs.pop("labels", None)
        loss_sum, outputs = shard_loss_sum(model, inputs, shift_labels)
        return loss_sum, (shift_labels != IGNORE_INDEX).sum(), outputs


__all__ = ["SequenceParallelCollator", "SequenceParallelTrainer", "prepare_sequence_parallel"]
