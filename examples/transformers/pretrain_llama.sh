#!/usr/bin/env bash
# Pretrain the Hugging Face Llama of pretrain_llama.py with the DeepSpeed launcher (run from anywhere).
#
#   examples/transformers/pretrain_llama.sh --cpu [ARGS...]   4 CPU ranks on this machine (DS_ACCELERATOR=cpu, gloo)
#   examples/transformers/pretrain_llama.sh [ARGS...]         every GPU of this machine (NCCL)
#
# ARGS go to pretrain_llama.py, e.g. --steps 200 --log-json --pack-documents --ulysses-size 1 --ring-size 4.
# Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$here/../common/deepspeed_launch.sh" "$here/pretrain_llama.py" "$@"
