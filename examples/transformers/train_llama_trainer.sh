#!/usr/bin/env bash
# Train the small Llama of train_llama_trainer.py with the HF Trainer + DeepSpeed + ring_sp (run from anywhere).
#
#   examples/transformers/train_llama_trainer.sh --cpu [ARGS...]   4 CPU ranks on this machine (DS_ACCELERATOR=cpu, gloo)
#   examples/transformers/train_llama_trainer.sh [ARGS...]         every GPU of this machine (NCCL)
#
# ARGS go to train_llama_trainer.py, e.g. --steps 200 --log-json --ulysses-size 1 --ring-size 4 (--ddp: DDP
# instead of DeepSpeed). On N nodes: the same command on each, plus --nnodes N --node-rank K --master-addr HOST
# --master-port PORT (docs/multinode.md).
# Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$here/../common/deepspeed_launch.sh" "$here/train_llama_trainer.py" "$@"
