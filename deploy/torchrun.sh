#!/usr/bin/env bash
# A distributed run on one machine with the trainer ranks under torchrun:
#   - the controller: `rollout launch CONFIG --external-roles`, listening on 127.0.0.1:PORT;
#   - WORKERS generation workers: `rollout worker`;
#   - TRAINERS data-parallel trainer ranks: `torchrun --standalone --no-python rollout trainer`
#     (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each rank).
#
# Usage: deploy/torchrun.sh CONFIG [--set KEY=VALUE ...] [--resume | --overwrite]
#
# Environment (defaults in brackets):
#   TRAINERS  trainer ranks [2]        WORKERS   generation workers [1]
#   PORT      controller port [7100]   ROLLOUT   the rollout executable [rollout]
#   TORCHRUN  the torchrun command [torchrun]
#   GPUS      GPUs to place the roles on [the visible ones: CUDA_VISIBLE_DEVICES, else the
#             driver's list]; 0: no placement (CPU, or every process sees every GPU)
#   COLOCATE  1: workers share the trainers' GPUs (worker i on rank i's GPU) and release
#             their memory while the trainers step (needs cluster.max_staleness = 0) [0]
# With GPUs, trainer rank r gets GPU r and worker i GPU TRAINERS + i (colocated: GPU i),
# each as its own CUDA_VISIBLE_DEVICES (the rank's through deploy/local-device.sh).
# Set the role counts here, not with --set cluster.workers/trainers: both sides must agree.
#
# Ctrl-C reaches only the controller, which stops after the current step, writes a
# checkpoint and shuts the roles down; continue later with --resume.
set -euo pipefail

if (($# < 1)); then
    sed -n '2,23p' "$0" >&2
    exit 2
fi
config=$1
shift
trainers=${TRAINERS:-2}
workers=${WORKERS:-1}
controller=127.0.0.1:${PORT:-7100}
rollout=${ROLLOUT:-rollout}
torchrun=${TORCHRUN:-torchrun}
colocate=${COLOCATE:-0}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# GPUs by index among the visible ones (as `rollout launch` counts them).
if [[ -n ${GPUS:-} ]]; then
    gpus=$GPUS
elif [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
    gpus=${#visible[@]}
else
    gpus=$(find /proc/driver/nvidia/gpus -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
fi
trainer_gpus=()
worker_gpus=()
device_args=()
if ((gpus > 0)); then
    first_worker_gpu=$trainers
    ((colocate)) && first_worker_gpu=0
    if ((trainers > gpus || first_worker_gpu + workers > gpus)); then
        echo "torchrun.sh: $trainers trainer ranks and $workers workers need more than $gpus GPUs; set COLOCATE=1 or start fewer" >&2
        exit 2
    fi
    for ((r = 0; r < trainers; r++)); do trainer_gpus+=("$r"); done
    for ((i = 0; i < workers; i++)); do worker_gpus+=("$((first_worker_gpu + i))"); done
fi
if ((colocate)); then
    device_args=(--set cluster.devices.colocate=true)
fi

# A fresh cluster secret, readable by this user only.
tmp=$(mktemp -d -t rollout-torchrun.XXXXXX)
secret_file=$tmp/cluster-secret
(umask 077 && od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' >"$secret_file")
log=$tmp/controller.log

roles=()
# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
    for pid in "${roles[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo "torchrun.sh: interrupted; waiting for the controller to stop" >&2' INT

"$rollout" launch "$config" --external-roles \
    --set "cluster.listen=$controller" \
    --set "cluster.workers=$workers" \
    --set "cluster.trainers=$trainers" \
    --set "cluster.secret_file=\"$secret_file\"" \
    "${device_args[@]}" "$@" 2> >(trap '' INT && exec tee "$log" >&2) &
controller_pid=$!

# Roles do not retry their connection: start them once the controller listens.
until grep -q "listening on" "$log" 2>/dev/null; do
    if ! kill -0 "$controller_pid" 2>/dev/null; then
        wait "$controller_pid" || exit $?
        exit 1
    fi
    sleep 0.2
done

# setsid: a Ctrl-C in the terminal goes to the controller only.
worker_list=$(
    IFS=,
    echo "${worker_gpus[*]}"
)
for ((i = 0; i < workers; i++)); do
    ROLLOUT_LOCAL_DEVICES=$worker_list LOCAL_RANK=$i setsid "$here/local-device.sh" \
        "$rollout" worker --connect "$controller" --name "worker-$i" \
        --secret-file "$secret_file" &
    roles+=($!)
done
trainer_list=$(
    IFS=,
    echo "${trainer_gpus[*]}"
)
ROLLOUT_LOCAL_DEVICES=$trainer_list setsid "$torchrun" --standalone --nnodes=1 \
    --nproc-per-node="$trainers" --no-python \
    "$here/local-device.sh" "$rollout" trainer --connect "$controller" \
    --secret-file "$secret_file" &
roles+=($!)

while kill -0 "$controller_pid" 2>/dev/null; do
    wait "$controller_pid" || true
done
status=0
wait "$controller_pid" || status=$?

# The controller shut the roles down as it finished; give them a moment to exit.
for _ in $(seq 60); do
    alive=0
    for pid in "${roles[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then alive=1; fi
    done
    ((alive)) || break
    sleep 1
done
exit "$status"
