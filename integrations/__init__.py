"""Framework glue, installed as ``ring_sp.integrations`` (see setup.py's package_dir).

Nothing here imports DeepSpeed or Megatron at import time; each submodule imports its
framework when it is imported itself.
"""
