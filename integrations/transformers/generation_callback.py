"""``GenerationCallback``: sample the model while it trains, in the training processes.

A ``transformers.TrainerCallback`` for ``SequenceParallelTrainer`` (or any Trainer): every
``every`` optimizer steps, and after the last, it calls ``model.generate(prompts, ...)`` on
every rank. On a ``"ring_sp"`` model with an SP group of more than one rank that is
:mod:`.generation`'s ``generate()``: the prompt prefilled over the grid into a KV cache sharded
over the SP ranks, every rank returning the same tokens, equal to one device's. Training goes on
exactly as without the callback:

* the model is put in eval mode for the call (no dropout) and back in the mode it was in;
* the call runs under ``torch.no_grad()`` and ``torch.random.fork_rng``, seeded with
  ``seed + step``: sampling (``do_sample=True``) draws the same on every rank (the SP ranks
  must sample alike) and leaves the training's random state as it was, so a run with the
  callback trains bit for bit as one without.

Each call's tokens ``[b, prompt + new]`` (on the host) are kept in :attr:`GenerationCallback.generations`
as ``{"step": step, "tokens": tensor}``; ``on_generate(step, tokens)`` is called too, e.g. to log
the decoded text on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

from .attention import generation_topology
from .generation import agree_to_generate


class GenerationCallback(TrainerCallback):
    """Generate from ``prompts`` ``[b, n]`` (token ids, the same on every rank) every ``every`` steps.

    ``generate_kwargs`` go to ``model.generate`` (``max_new_tokens``, ``do_sample``, ``top_k``,
    ``eos_token_id``, ``pad_token_id``...); what ring_sp cannot run exactly (beam search,
    speculative decoding...) raises on every rank when the first call is made, before any step is
    lost to it: generate()'s agreement runs alone at ``on_train_begin``.
    """

    def __init__(self, prompts: torch.Tensor, *, every: int, seed: int = 0,
                 on_generate: Callable[[int, torch.Tensor], None] | None = None, **generate_kwargs: Any) -> None:
        if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.is_floating_point():
            raise ValueError(f"prompts must be token ids [batch, prompt]; got {type(prompts).__name__} "
                             f"{tuple(getattr(prompts, 'shape', ()))}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} must be a positive int (optimizer steps between generations)")
        self.prompts, self.every, self.seed = prompts, every, seed
        self.on_generate, self.generate_kwargs = on_generate, generate_kwargs
        self.generations: list[dict[str, Any]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._call(model, state.global_step, self._agree)  # what generate() refuses fails here, before any step

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.generate(model, state.global_step)

    def generate(self, model: torch.nn.Module, step: int) -> torch.Tensor:
        """``model.generate`` on the prompts now, as the callback does after step ``step``: the tokens."""
        out = self._call(model, step, lambda m, prompts: m.generate(prompts, **self.generate_kwargs))
        tokens = (out if isinstance(out, torch.Tensor) else out.sequences).cpu()
        self.generations.append({"step": step, "tokens": tokens})
        if self.on_generate is not None:
            self.on_generate(step, tokens)
        return tokens

    def _agree(self, model: torch.nn.Module, prompts: torch.Tensor) -> None:
        """generate()'s agreement over the SP group, alone (nothing for a model generate() runs alone)."""
        topology = generation_topology(model)
        if topology is not None:
            agree_to_generate(model, topology, (prompts,), self.generate_kwargs)

    def _call(self, model: torch.nn.Module, step: int, call: Callable[[torch.nn.Module, torch.Tensor], Any]) -> Any:
        """``call(model, prompts)`` in eval mode, without gradients, seeded with ``seed + step`` on a forked
        random state (the training's left as it was)."""
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(self.seed + step)
                return call(model, self.prompts.to(device))
        finally:
            model.train(was_training)


__all__ = ["GenerationCallback"]
