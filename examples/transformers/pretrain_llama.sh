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
python="${PYTHON:-python}"
# --quiet keeps the launcher's own log lines off stdout, which then carries only --log-json lines.
launcher=("$python" -m deepspeed.launcher.runner --quiet --master_port "${MASTER_PORT:-29500}")
if [[ "${1:-}" == "--cpu" ]]; then
  shift
  ranks="${NUM_RANKS:-4}"
  export DS_ACCELERATOR=cpu
  # Share the cores between the ranks instead of each rank starting a thread per core.
  threads=$(( $(nproc) / ranks ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
  launcher+=(--num_gpus "$ranks")
fi
exec "${launcher[@]}" "$here/pretrain_llama.py" "$@"
