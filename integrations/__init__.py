"""Framework glue, installed as ``ring_sp.integrations`` (see setup.py's package_dir): ring_sp under
DeepSpeed, Megatron-core and Hugging Face transformers, in floors that import only downwards.

``versions`` (the supported framework ranges) and ``gradient_reduction`` (how a DeepSpeed
engine reduces gradients over SP) import no other integration; ``transformers`` (the
``attn_implementation``, sharding, loss and long-sequence step) stands on them; ``deepspeed``
(the config section, ``initialize``, mpu, data, loss) stands on those and on ``transformers``'
registration and long-sequence switch; ``transformers.trainer`` (the Hugging Face Trainer under
DeepSpeed) is the top floor; ``megatron`` stands beside them on ``versions`` alone. Nothing here
imports DeepSpeed, Megatron or transformers at import time; each submodule imports its framework
when it is imported itself (or first used).
"""
