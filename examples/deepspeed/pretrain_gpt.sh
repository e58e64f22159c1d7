#!/usr/bin/env bash
# Pretrain the compact GPT of pretrain_gpt.py with the DeepSpeed launcher (run from anywhere).
#
#   examples/deepspeed/pretrain_gpt.sh --cpu [ARGS...]   4 CPU ranks on this machine (DS_ACCELERATOR=cpu, gloo)
#   examples/deepspeed/pretrain_gpt.sh [ARGS...]         every GPU of this machine (NCCL)
#
# ARGS go to pretrain_gpt.py, e.g. --steps 200 --log-json --save ckpt --ulysses-size 1 --ring-size 4.
# Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$here/../common/deepspeed_launch.sh" "$here/pretrain_gpt.py" "$@"
