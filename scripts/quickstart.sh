#!/usr/bin/env bash
# One command from a fresh clone to a trained model: setup, the tiny local model and data,
# then `rollout run configs/quickstart.toml`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$ROLLOUT" init-quickstart --dir artifacts/quickstart
exec "$ROLLOUT" run configs/quickstart.toml --overwrite "$@"
