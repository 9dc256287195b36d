#!/usr/bin/env bash
# The whole test suite, from a fresh clone: setup, formatting and lints, Rust tests, Python
# tests (SDK, built-in plugins) and end-to-end tests of the binary.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export PYO3_PYTHON="$PYTHON"

say "formatting and lints"
cargo fmt --all --check
cargo clippy --release --locked --all-targets --quiet -- -D warnings
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .

say "Rust tests"
cargo test --release --locked --workspace --quiet

say "Python and end-to-end tests"
set +e
"$PYTHON" -m pytest -q tests
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure of the suite, not a pass" >&2
  exit 1
fi
exit "$status"
