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
# Set the role counts here, not with --set cluster.workers/trainers: both sides must agree.
#
# Ctrl-C reaches only the controller, which stops after the current step, writes a
# checkpoint and shuts the roles down; continue later with --resume.
set -euo pipefail

if (($# < 1)); then
    sed -n '2,17p' "$0" >&2
    exit 2
fi
config=$1
shift
trainers=${TRAINERS:-2}
workers=${WORKERS:-1}
controller=127.0.0.1:${PORT:-7100}
rollout=${ROLLOUT:-rollout}
torchrun=${TORCHRUN:-torchrun}

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
    "$@" 2> >(trap '' INT && exec tee "$log" >&2) &
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
for ((i = 0; i < workers; i++)); do
    setsid "$rollout" worker --connect "$controller" --name "worker-$i" \
        --secret-file "$secret_file" &
    roles+=($!)
done
setsid "$torchrun" --standalone --nnodes=1 --nproc-per-node="$trainers" --no-python \
    "$rollout" trainer --connect "$controller" --secret-file "$secret_file" &
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
