#!/usr/bin/env bash
# Pretrain the small GPT of pretrain_gpt.py with torchrun on this machine (run from anywhere).
#
#   examples/megatron/pretrain_gpt.sh --cpu [ARGS...]   4 CPU ranks on gloo: CP = 4 as ulysses 2 x ring 2
#   examples/megatron/pretrain_gpt.sh [ARGS...]         one rank per GPU (NCCL), all context-parallel
#
# ARGS (pretrain_gpt.py --help) override the defaults passed below, e.g.
#   --tensor-model-parallel-size 2 --context-parallel-size 2 --ring-sp-ulysses-size 1 --log-json
# Environment: NUM_RANKS (default 4 on CPU, the GPU count otherwise), PYTHON.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
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
exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
    "$here/pretrain_gpt.py" "${device_args[@]}" \
    --ring-sp --context-parallel-size "$ranks" --ring-sp-ulysses-size 2 "$@"
