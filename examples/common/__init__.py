"""Pieces shared by the examples: data, progress, DeepSpeed on CPU."""
