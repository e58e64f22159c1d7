"""DeepSpeed on CPU ranks (``DS_ACCELERATOR=cpu``): start its comm without building a C++ op.

Every place where ring_sp starts DeepSpeed's comm (``initialize``, ``build_topology``, the
Hugging Face Trainer path, the tests, benchmarks and examples) calls
:func:`skip_cpu_inference_comm_build` first, so a machine without a C++ compiler, or with an
empty ``TORCH_EXTENSIONS_DIR``, starts exactly as one with the op pre-built.
"""

from __future__ import annotations


def skip_cpu_inference_comm_build() -> None:
    """Keep DeepSpeed's CPU backend from JIT-compiling its shared-memory all-reduce.

    That op serves only ``inference_all_reduce`` (training collectives go through gloo), yet
    DeepSpeed's comm backend builds it with g++ when it starts: about a minute on a small
    machine, an error without a compiler, and a lock file in ``TORCH_EXTENSIONS_DIR`` that
    blocks every later start if the build is killed. Marking the op incompatible is what
    DeepSpeed does itself on platforms that cannot build it (``deepspeed.comm.torch.build_shm_op``
    then returns None). On any other accelerator (CUDA, ...) this changes nothing. Idempotent;
    call it before DeepSpeed's comm starts (it has no effect on a backend already running).
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


__all__ = ["skip_cpu_inference_comm_build"]
