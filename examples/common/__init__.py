"""Pieces shared by the DeepSpeed and Megatron pretraining examples: data and progress."""
