#!/usr/bin/env bash
# Runs COMMAND with CUDA_VISIBLE_DEVICES narrowed to this process's GPUs, chosen by its local
# rank on the node: LOCAL_RANK (torchrun), else SLURM_LOCALID (srun), else 0.
#
# Usage: ROLLOUT_LOCAL_DEVICES=LIST deploy/local-device.sh COMMAND [ARGS...]
#   LIST  one entry per local rank, comma-separated; "+" joins the GPUs of one entry:
#         "0,1,2,3" (one GPU each) or "0+1,2+3" (two each). Indices count the GPUs this
#         process sees (entries of its CUDA_VISIBLE_DEVICES when that is set).
# Unset or empty: CUDA_VISIBLE_DEVICES is left as it is. LOCAL_RANK is exported either way.
#
#   ROLLOUT_LOCAL_DEVICES=0,1 torchrun --standalone --nproc-per-node=2 --no-python \
#       deploy/local-device.sh rollout trainer --connect HOST:PORT --secret-file FILE
set -euo pipefail

if (($# < 1)); then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
local_rank=${LOCAL_RANK:-${SLURM_LOCALID:-0}}
export LOCAL_RANK=$local_rank
if [[ -n ${ROLLOUT_LOCAL_DEVICES:-} ]]; then
    IFS=, read -ra entries <<<"$ROLLOUT_LOCAL_DEVICES"
    if ((local_rank >= ${#entries[@]})); then
        echo "local-device.sh: local rank $local_rank has no entry in ROLLOUT_LOCAL_DEVICES=$ROLLOUT_LOCAL_DEVICES" >&2
        exit 2
    fi
    visible=()
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
    fi
    IFS=+ read -ra indices <<<"${entries[local_rank]}"
    mine=()
    for index in "${indices[@]}"; do
        if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
            if ((index >= ${#visible[@]})); then
                echo "local-device.sh: GPU $index is not visible (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)" >&2
                exit 2
            fi
            mine+=("${visible[index]}")
        else
            mine+=("$index")
        fi
    done
    CUDA_VISIBLE_DEVICES=$(
        IFS=,
        echo "${mine[*]}"
    )
    export CUDA_VISIBLE_DEVICES
fi
exec "$@"
