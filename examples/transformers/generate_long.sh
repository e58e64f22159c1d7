#!/usr/bin/env bash
# Train the Llama of pretrain_llama.py briefly under ring_sp, then generate from a long prompt over the SP ranks
# (generate_long.py), with the DeepSpeed launcher (run from anywhere).
#
#   examples/transformers/generate_long.sh --cpu [ARGS...]   4 CPU ranks on this machine (DS_ACCELERATOR=cpu, gloo)
#   examples/transformers/generate_long.sh [ARGS...]         every GPU of this machine (NCCL)
#
# ARGS go to generate_long.py, e.g. --prompt-len 16384 --new-tokens 64 --steps 0 --sample --log-json.
# Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "$here/../common/deepspeed_launch.sh" "$here/generate_long.py" "$@"
