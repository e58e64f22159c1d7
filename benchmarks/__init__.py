"""ring_sp benchmarks: ``python -m benchmarks --help`` (see docs/benchmarks.md)."""
