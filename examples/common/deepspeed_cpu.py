"""DeepSpeed on CPU ranks (``DS_ACCELERATOR=cpu``): the library's one implementation, re-exported.

``ring_sp.integrations.deepspeed`` applies it itself wherever it starts DeepSpeed; a script
that starts DeepSpeed's comm on its own (``deepspeed.init_distributed``) calls it first.
"""

from __future__ import annotations

from ring_sp.integrations.deepspeed.cpu import skip_cpu_inference_comm_build

__all__ = ["skip_cpu_inference_comm_build"]
