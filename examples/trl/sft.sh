#!/usr/bin/env bash
# Fine-tune the small Llama of sft.py with TRL's SFTTrainer + ring_sp (run from anywhere).
#
#   examples/trl/sft.sh --cpu [ARGS...]   4 CPU ranks on this machine, U2 x R2, DeepSpeed ZeRO-1 (gloo)
#   examples/trl/sft.sh [ARGS...]         every GPU of this machine (NCCL)
#
# ARGS go to sft.py, e.g. --steps 100 --log-json --ulysses-size 1 --ring-size 4 --zero-stage 3 --lora.
# Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON, LAUNCHER (deepspeed or torchrun).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$here/../common/deepspeed_launch.sh" "$here/sft.py" "$@"
