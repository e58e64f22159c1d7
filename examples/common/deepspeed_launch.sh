#!/usr/bin/env bash
# Run a DeepSpeed example script with the DeepSpeed launcher (or torchrun): the examples' .sh files call this.
#
#   examples/common/deepspeed_launch.sh SCRIPT.py --cpu [ARGS...]   4 CPU ranks on this machine (DS_ACCELERATOR=cpu, gloo)
#   examples/common/deepspeed_launch.sh SCRIPT.py [ARGS...]         every GPU of this machine (NCCL)
#
# ARGS go to SCRIPT.py. Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON,
# LAUNCHER (deepspeed, the default, or torchrun). Either launcher stops the other ranks when one dies.
set -euo pipefail
script="$1"
shift
# PYTHON if set, else the project's .venv (make setup) when it exists, else python from PATH
venv_python="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python"
if [[ -n "${PYTHON:-}" ]]; then python="$PYTHON"; elif [[ -x "$venv_python" ]]; then python="$venv_python"; else python=python; fi
kind="${LAUNCHER:-deepspeed}"
case "$kind" in
  # --quiet keeps the launcher's own log lines off stdout, which then carries only --log-json lines.
  deepspeed) launcher=("$python" -m deepspeed.launcher.runner --quiet --master_port "${MASTER_PORT:-29500}") ;;
  torchrun) launcher=("$python" -m torch.distributed.run --master-port "${MASTER_PORT:-29500}") ;;
  *) echo "LAUNCHER must be deepspeed or torchrun, not '${LAUNCHER}'" >&2; exit 2 ;;
esac
if [[ "${1:-}" == "--cpu" ]]; then
  shift
  ranks="${NUM_RANKS:-4}"
  export DS_ACCELERATOR=cpu
  # Share the cores between the ranks instead of each rank starting a thread per core.
  threads=$(( $(nproc) / ranks ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
  if [[ "$kind" == torchrun ]]; then launcher+=(--nproc-per-node "$ranks"); else launcher+=(--num_gpus "$ranks"); fi
elif [[ "$kind" == torchrun ]]; then
  launcher+=(--nproc-per-node gpu)
fi
exec "${launcher[@]}" "$script" "$@"
