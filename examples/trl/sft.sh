#!/usr/bin/env bash
# Fine-tune the small Llama of sft.py with TRL's SFTTrainer + ring_sp (run from anywhere).
#
#   examples/trl/sft.sh --cpu [ARGS...]           4 CPU ranks on this machine, U2 x R2, DeepSpeed ZeRO-1 (gloo)
#   examples/trl/sft.sh [ARGS...]                 every GPU of this machine (NCCL)
#   examples/trl/sft.sh --cpu --fsdp2 [ARGS...]   FSDP2 instead of DeepSpeed: accelerate launch with fsdp2.yaml
#   examples/trl/sft.sh --fsdp2 [ARGS...]         FSDP2 on every GPU of this machine
#   examples/trl/sft.sh --cpu --ddp [ARGS...]     DDP instead of DeepSpeed (no FSDP), the same launcher
#
# ARGS go to sft.py, e.g. --steps 100 --log-json --ulysses-size 1 --ring-size 4 --zero-stage 3 --lora.
# Environment: NUM_RANKS (CPU ranks, default 4), MASTER_PORT (default 29500), PYTHON, LAUNCHER (deepspeed or
# torchrun; DeepSpeed runs only: --fsdp2 always goes through accelerate launch).
# On N nodes: the same command on each, plus --nnodes N --node-rank K --master-addr HOST --master-port PORT
# (examples/common/nodes.sh, docs/multinode.md; accelerate launch's --num_machines ... for --fsdp2).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/nodes.sh"
set -- "${args[@]+"${args[@]}"}"
cpu=()
fsdp2=0
ddp=()
while [[ $# -gt 0 && ( "$1" == --cpu || "$1" == --fsdp2 || "$1" == --ddp ) ]]; do
  if [[ "$1" == --cpu ]]; then cpu=(--cpu); elif [[ "$1" == --ddp ]]; then ddp=(--ddp); else fsdp2=1; fi
  shift
done
if [[ $fsdp2 == 0 ]]; then
  exec "$here/../common/deepspeed_launch.sh" "$here/sft.py" "${cpu[@]}" "${ddp[@]}" "$@" --nnodes "$nnodes" \
    --node-rank "$node_rank" --master-addr "$master_addr" --master-port "$master_port"
fi
# FSDP2: accelerate launch. PYTHON if set, else the project's .venv (make setup) when it exists, else python.
venv_python="$here/../../.venv/bin/python"
if [[ -n "${PYTHON:-}" ]]; then python="$PYTHON"; elif [[ -x "$venv_python" ]]; then python="$venv_python"; else python=python; fi
if [[ ${#cpu[@]} -gt 0 ]]; then
  ranks="${NUM_RANKS:-4}"
  # Share the cores between the ranks instead of each rank starting a thread per core.
  threads=$(( $(nproc) / ranks ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
  export CUDA_VISIBLE_DEVICES=""  # CPU ranks even on a machine with GPUs
  export DS_ACCELERATOR=cpu       # ring_sp imports DeepSpeed when installed: no accelerator probe on stdout
else
  ranks="$("$python" -c 'import torch; print(torch.cuda.device_count())')"
fi
# accelerate counts processes over all machines
exec "$python" -m accelerate.commands.launch --config_file "$here/fsdp2.yaml" --num_processes "$(( ranks * nnodes ))" \
  --num_machines "$nnodes" --machine_rank "$node_rank" --main_process_ip "$master_addr" \
  --main_process_port "$master_port" "$here/sft.py" --fsdp2 "$@"
