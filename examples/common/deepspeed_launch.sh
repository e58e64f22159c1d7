#!/usr/bin/env bash
# Run a DeepSpeed example script with the DeepSpeed launcher (or torchrun): the examples' .sh files call this.
#
#   examples/common/deepspeed_launch.sh SCRIPT.py --cpu [ARGS...]   4 CPU ranks on this machine (DS_ACCELERATOR=cpu, gloo)
#   examples/common/deepspeed_launch.sh SCRIPT.py [ARGS...]         every GPU of this machine (NCCL)
#
# On N nodes: the same command on each, plus --nnodes N --node-rank K --master-addr HOST --master-port PORT
# (examples/common/nodes.sh, docs/multinode.md), and with LAUNCHER=torchrun --max-restarts M for torchrun's
# elastic restarts; with HOSTFILE set, the DeepSpeed launcher starts every node
# of that hostfile itself over ssh (pdsh) instead.
# ARGS go to SCRIPT.py. Environment: NUM_RANKS (CPU ranks, default 4; per node), MASTER_PORT (default 29500),
# PYTHON, LAUNCHER (deepspeed, the default, or torchrun), HOSTFILE. Either launcher stops the other ranks
# of its node when one dies.
set -euo pipefail
script="$1"
shift
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/nodes.sh"
set -- "${args[@]+"${args[@]}"}"
# PYTHON if set, else the project's .venv (make setup) when it exists, else python from PATH
venv_python="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python"
if [[ -n "${PYTHON:-}" ]]; then python="$PYTHON"; elif [[ -x "$venv_python" ]]; then python="$venv_python"; else python=python; fi
kind="${LAUNCHER:-deepspeed}"
case "$kind" in
  # --quiet keeps the launcher's own log lines off stdout, which then carries only --log-json lines.
  deepspeed) launcher=("$python" -m deepspeed.launcher.runner --quiet --master_port "$master_port") ;;
  torchrun) launcher=("$python" -m torch.distributed.run) ;;
  *) echo "LAUNCHER must be deepspeed or torchrun, not '${LAUNCHER}'" >&2; exit 2 ;;
esac
ranks=""
if [[ "${1:-}" == "--cpu" ]]; then
  shift
  ranks="${NUM_RANKS:-4}"
  export DS_ACCELERATOR=cpu
  # Share the cores between the ranks instead of each rank starting a thread per core.
  threads=$(( $(nproc) / ranks ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
fi
if [[ "$max_restarts" -gt 0 && "$kind" != torchrun ]]; then
  echo "--max-restarts $max_restarts: torchrun's elastic restart; run with LAUNCHER=torchrun" >&2
  exit 2
fi
if [[ "$kind" == torchrun ]]; then
  launcher+=(--nproc-per-node "${ranks:-gpu}")
  if [[ "$max_restarts" -gt 0 ]]; then
    # Elastic: the c10d rendezvous (hosted by the node at --master-addr; start it first) lets torchrun restart
    # every node's ranks when one fails and a lost node rejoin; nodes get their rank in the order they join.
    # The workers keep a store of their own per round: sharing the agent's, workers of nodes whose restart
    # counts differ (a node that failed vs one that only followed) meet under different keys and hang
    # (pytorch/pytorch#135712). Resume with the script's --auto-resume.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    launcher+=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port"
               --rdzv-id "${RDZV_ID:-ring_sp}" --max-restarts "$max_restarts" --monitor-interval 1)
  else
    launcher+=(--master-port "$master_port")
    if [[ "$nnodes" -gt 1 ]]; then
      # torchrun's static rendezvous: the node at --master-addr hosts the store every rank meets at
      launcher+=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr")
    fi
  fi
elif [[ -n "${HOSTFILE:-}" ]]; then
  launcher+=(--hostfile "$HOSTFILE")  # DeepSpeed starts every node of the hostfile (pdsh over ssh)
elif [[ "$nnodes" -gt 1 ]]; then
  # One DeepSpeed launcher per node, no ssh: a hostfile naming N nodes of this node's ranks, and this node's rank.
  slots="${ranks:-$("$python" -c "import torch; print(torch.cuda.device_count())")}"
  hostfile="${TMPDIR:-/tmp}/ring_sp_hostfile_${nnodes}x${slots}"  # the same content for every run of this shape
  for ((node = 0; node < nnodes; node++)); do echo "node$node slots=$slots"; done > "$hostfile"
  launcher+=(--hostfile "$hostfile" --no_ssh --node_rank "$node_rank" --master_addr "$master_addr")
elif [[ -n "$ranks" ]]; then
  launcher+=(--num_gpus "$ranks")
fi
exec "${launcher[@]}" "$script" "$@"
