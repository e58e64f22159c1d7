"""``python -m benchmarks.gpu_check``: one command that spends a few minutes of one GPU on what
has never been measured there (issue 32): the CUDA kernel tests (:mod:`.kernel_tests`), the
whole-step memory model against the allocator and the longest sequence that fits, ring_sp's
recipe against ALST's on transformers' Llama (:mod:`.memory`, :mod:`.longest`,
:mod:`.memory_report`; the model and ring_sp's recipe :mod:`.llama`, ALST's :mod:`.alst`), and
the ring schedule's compute against one fused kernel (:mod:`.efficiency`). Every GPU-only call
goes through one seam (:mod:`.seam`: device, memory counter, timer), so ``--dry`` runs every
section on the CPU at tiny sizes (CI); :mod:`.preflight` names what is missing before
anything runs and describes the card, :mod:`.wheels` brings the carried wheels.
"""
