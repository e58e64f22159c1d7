#!/usr/bin/env bash
# Run a DeepSpeed example script with the DeepSpeed launcher: the examples' .sh files call this.
#
#   examples/common/deepspeed_launch.sh SCRIPT.py --cpu [ARGS...]   4 CPU ranks on this machine (DS_ACCELERATOR=cpu, gloo)
#   examples/common/deepspeed_launch.sh SCRIPT.py [ARGS...]         every GPU of this machine (NCCL)
#
# ARGS go to SCRIPT.py. Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON.
set -euo pipefail
script="$1"
shift
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
exec "${launcher[@]}" "$script" "$@"
