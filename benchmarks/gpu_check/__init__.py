"""``python -m benchmarks.gpu_check``: one command that spends a few minutes of one GPU on what
has never been measured there (issues 32 and 38): the CUDA kernel tests (:mod:`.kernel_tests`),
the whole-step memory model against the allocator and the longest sequence that fits, ring_sp
against ALST's modules (:mod:`.memory` on the stack of :mod:`.stack`), each attention backend's
rate against cuDNN SDPA (:mod:`.attention_rate`) and the ring schedule's compute against one
fused kernel, forward and backward (:mod:`.efficiency` through :mod:`.loopback`), and the whole
step with ring_sp's defaults against ALST's modules and untiled (:mod:`.step` on the model of
:mod:`.hf_llama`). Every GPU-only call goes through one seam (:mod:`.seam`: device, memory
counter, timer, profiler, reference attention), so ``--dry`` runs every section on the CPU at
tiny sizes (CI); :mod:`.preflight` brings wheels, names what is missing before anything runs,
and describes the card; :mod:`.checkout` makes ``ring_sp.integrations`` importable where
ring_sp runs from this checkout uninstalled (the GPU machine).
"""
