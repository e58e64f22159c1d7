"""``python -m benchmarks.gpu_check``: one command that spends a few minutes of one GPU on what
has never been measured there (issue 32): the CUDA kernel tests (:mod:`.kernel_tests`), the
whole-step memory model against the allocator and the longest sequence that fits, ring_sp
against ALST's modules (:mod:`.memory` on the stack of :mod:`.stack`), and the ring
schedule's compute against one fused kernel (:mod:`.efficiency`). Every GPU-only call goes
through one seam (:mod:`.seam`: device, memory counter, timer), so ``--dry`` runs every
section on the CPU at tiny sizes (CI); :mod:`.preflight` brings wheels, names what is
missing before anything runs, and describes the card.
"""
