"""``python -m benchmarks.gpu_check``: one command that spends a few minutes of one GPU on what
has never been measured there (issues 32, 38 and 40): the CUDA kernel tests
(:mod:`.kernel_tests`); the whole-step memory model against the allocator and the longest
sequence that fits, ring_sp's recipe against ALST's on transformers' Llama (:mod:`.memory`,
:mod:`.longest`, :mod:`.memory_report`); each attention backend's rate against cuDNN SDPA
(:mod:`.attention_rate`) and the ring schedule's compute against one fused kernel, forward and
backward (:mod:`.efficiency` through :mod:`.loopback`); and the whole step with ring_sp's
defaults against ALST's modules and untiled (:mod:`.step`). The model and ring_sp's recipe on
it are :mod:`.llama`'s, ALST's recipe :mod:`.alst`'s, for both the memory and the step
sections. Every GPU-only call goes through one seam (:mod:`.seam`: device, memory counter,
timer, profiler, reference attention), so ``--dry`` runs every section on the CPU at tiny sizes
(CI); :mod:`.preflight` names what is missing before anything runs and describes the card,
:mod:`.wheels` brings the carried wheels, and :mod:`.checkout` makes ``ring_sp.integrations``
importable where ring_sp runs from this checkout uninstalled (the GPU machine).
"""
