"""DeepSpeed on CPU ranks (``DS_ACCELERATOR=cpu``): what the examples do before DeepSpeed starts."""

from __future__ import annotations


def skip_cpu_inference_comm_build() -> None:
    """Keep DeepSpeed's CPU backend from JIT-compiling its shared-memory all-reduce.

    That op serves only ``inference_all_reduce`` (training collectives go through gloo), yet
    DeepSpeed builds it with g++ when the backend starts: about a minute on a small machine,
    and an error without a compiler. Marking it unavailable is what DeepSpeed does itself
    on platforms that cannot build it.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
