#!/usr/bin/env bash
# Pretrain the small GPT of pretrain_gpt.py with torchrun on this machine (run from anywhere).
#
#   examples/megatron/pretrain_gpt.sh --cpu [ARGS...]   4 CPU ranks on gloo: CP = 4 as ulysses 2 x ring 2
#   examples/megatron/pretrain_gpt.sh [ARGS...]         one rank per GPU (NCCL), all context-parallel
#
# ARGS (pretrain_gpt.py --help) override the defaults passed below, e.g.
#   --tensor-model-parallel-size 2 --context-parallel-size 2 --ring-sp-ulysses-size 1 --log-json
# On N nodes: the same command on each, plus --nnodes N --node-rank K --master-addr HOST --master-port PORT
# (examples/common/nodes.sh, docs/multinode.md): context parallelism then spans every rank of every node.
# Environment: NUM_RANKS (ranks per node: default 4 on CPU, the GPU count otherwise), MASTER_PORT, PYTHON.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../common/nodes.sh"
set -- "${args[@]+"${args[@]}"}"
# PYTHON if set, else the project's .venv (make setup) when it exists, else python from PATH
venv_python="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv/bin/python"
if [[ -n "${PYTHON:-}" ]]; then python="$PYTHON"; elif [[ -x "$venv_python" ]]; then python="$venv_python"; else python=python; fi

if [[ "${1:-}" == "--cpu" ]]; then
    shift
    ranks="${NUM_RANKS:-4}"
    device_args=(--cpu)
else
    ranks="${NUM_RANKS:-$("$python" -c "import torch; print(torch.cuda.device_count())")}"
    device_args=()
    if [[ "$ranks" -lt 1 ]]; then
        echo "no CUDA device found; pass --cpu for CPU ranks" >&2
        exit 1
    fi
fi

# torchrun's --standalone picks a free port, so several runs can share the machine.
if [[ "$nnodes" -gt 1 ]]; then
    # torchrun's static rendezvous: the node at --master-addr hosts the store every rank meets at
    rendezvous=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr" --master-port "$master_port")
else
    rendezvous=(--standalone)
fi
exec "$python" -m torch.distributed.run "${rendezvous[@]}" --nproc-per-node "$ranks" \
    "$here/pretrain_gpt.py" "${device_args[@]}" \
    --ring-sp --context-parallel-size "$(( ranks * nnodes ))" --ring-sp-ulysses-size 2 "$@"
