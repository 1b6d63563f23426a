#!/bin/bash
# One-node atma_titan training: one trainer process per GPU through torchrun.
#
#   launch/train_local.sh [CONFIG] [--section.key value ...]
#   NGPU=4 launch/train_local.sh train_configs/atma_370m.toml --training.steps 100
#   DRY_RUN=1 launch/train_local.sh          # print the torchrun command instead of running it
#
# CONFIG defaults to train_configs/atma_370m.toml. NGPU defaults to the number of visible GPUs
# (CUDA_VISIBLE_DEVICES if set, else nvidia-smi), or 1 without a GPU (one CPU process).
# Rerunning the same command resumes from the newest complete checkpoint of the run's dump folder.
# To stop gracefully (finish the step, save, exit): kill -TERM <torchrun pid>.

set -euo pipefail

DEFAULT_CONFIG=train_configs/atma_370m.toml

count_gpus() {
    if [[ -n ${CUDA_VISIBLE_DEVICES+x} ]]; then
        # nvidia-smi ignores CUDA_VISIBLE_DEVICES; count its entries ("" or "-1" hide every GPU).
        local -a ids
        IFS=, read -r -a ids <<<"$CUDA_VISIBLE_DEVICES"
        if ((${#ids[@]} == 0)) || [[ ${ids[0]} == -1 ]]; then echo 0; else echo "${#ids[@]}"; fi
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c . || true
    else
        echo 0
    fi
}

config=$DEFAULT_CONFIG
if [[ $# -gt 0 && $1 != --* ]]; then
    config=$1
    shift
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."   # the repository root: relative paths resolve from here

if [[ -z ${NGPU:-} ]]; then
    NGPU=$(count_gpus)
    ((NGPU > 0)) || NGPU=1   # no GPU: a single CPU process
fi

cpus=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus / NGPU > 0 ? cpus / NGPU : 1))}
if [[ -z ${PYTORCH_CUDA_ALLOC_CONF:-} && -z ${PYTORCH_ALLOC_CONF:-} ]]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
# torchrun gives its trainers this long after a SIGTERM/Ctrl-C before SIGKILL (torch default 30 s):
# enough to finish the step and save a checkpoint.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

cmd=(torchrun --standalone --nproc_per_node="$NGPU" -m atma_titan.train --config "$config" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
    out=""
    for arg in "${cmd[@]}"; do out+="${out:+ }$(printf '%q' "$arg")"; done
    printf '%s\n' "$out"
    exit 0
fi

exec "${cmd[@]}"   # exec: signals (Ctrl-C, SIGTERM) go straight to torchrun, and so does the exit status
