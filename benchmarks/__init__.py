"""ring_sp's benchmarks: measurements of every mode side by side with DeepSpeed-Ulysses and
ALST on identical problems, checked against the design's formulas and the planner's models.
``python -m benchmarks`` runs the multi-rank suite (:mod:`.suite`: timing, bytes, memory,
activations, overlap, heads, the packed schedule, Ulysses head shapes, the KV exchange, the
whole step's length) and writes ``results.jsonl`` / ``results.md`` (:mod:`.report`);
``python -m benchmarks.gpu_check`` is the one-GPU check of kernels, the step-memory model,
the attention rate, the schedule's efficiency and the step's time; single-purpose scripts (:mod:`.cuda_long_sequence`,
:mod:`.schedule_cost`, :mod:`.window`, ...) run on their own. See docs/benchmarks.md.
"""
