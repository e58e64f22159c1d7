"""How a ring_sp DeepSpeed engine reduces gradients over SP: the fact every loss on it needs.

Each SP rank back-propagates through every other rank's attention, so the exact gradient
of the global loss is the SUM of the SP ranks' gradients (see :mod:`ring_sp.loss`).
DeepSpeed 0.19, told the sequence-parallel size by the mpu, reduces over all ``DP x SP``
ranks and then

* ZeRO 0, 1, 2 divide by ``DP`` only (engine ``_reduce_non_expert_gradients``; ZeRO 1/2
  ``average_tensor``, ``gradient_reduction_w_predivide``, ``allreduce_bucket``): a sum over
  SP, so the loss backward must not be scaled (``gradients_averaged_over_sp=False``);
* ZeRO 3 divides by ``DP x SP`` (``__avg_scatter_grads`` -> ``reduce_scatter_coalesced``,
  its default path with ``reduce_scatter: true``): an average over SP, which ring_sp's
  ``gradients_averaged_over_sp=True`` cancels.

:func:`gradients_averaged_over_sp` encodes that table and the tests prove each row. It
lives below both framework packages (it imports neither DeepSpeed nor any other
integration), so the DeepSpeed losses (:mod:`ring_sp.integrations.deepspeed.loss`) and the
Hugging Face ones (:mod:`ring_sp.integrations.transformers.loss`) read the same table.
"""

from __future__ import annotations

from typing import Any


def gradients_averaged_over_sp(engine: Any) -> bool:
    """Whether ``engine`` (from ``ring_sp.integrations.deepspeed.initialize``) averages gradients over SP.

    Pass it as ``gradients_averaged_over_sp=`` to :func:`ring_sp.sequence_parallel_loss` or
    :func:`ring_sp.sequence_parallel_cross_entropy` for a custom loss.
    """
    return engine.zero_optimization_stage() == 3


__all__ = ["gradients_averaged_over_sp"]
