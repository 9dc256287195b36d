#!/usr/bin/env bash
# The whole test suite, from a fresh clone: setup, formatting and lints, Rust tests, Python
# tests (SDK, built-in plugins) and end-to-end tests of the binary.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export PYO3_PYTHON="$PYTHON"

# Packages some tests need, installed where we are root with apt: bubblewrap (the code
# reward's sandbox: without it the reward refuses to load and its tests fail) and chromium
# (the report test screenshots the page; skipped without it).
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
command -v chromium >/dev/null || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  say "installing ${missing[*]} for the sandbox and report tests"
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; } \
    || echo "could not install ${missing[*]}: the tests that need them will fail or skip" >&2
fi

say "formatting and lints"
cargo fmt --all --check
cargo clippy --release --locked --all-targets --quiet -- -D warnings
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .

say "Rust tests"
cargo test --release --locked --workspace --quiet

# The core links no Python: nothing in rollout-core's dependency graph (normal, build or dev)
# is PyO3 or a Python binding. The graph, not a rebuild: building the core alone recompiles
# its dependencies with other features (minutes) to show what this shows at once.
say "rollout-core without Python"
python_crates="$(cargo tree --locked -p rollout-core -e normal,build,dev --prefix none \
  | grep -E '^(pyo3|numpy|python3-sys|cpython)[ -]' || true)"
if [ -n "$python_crates" ]; then
  echo "rollout-core depends on Python bindings:" >&2
  echo "$python_crates" >&2
  exit 1
fi

say "Python and end-to-end tests"
# The wheel test builds with maturin in this target directory rather than its own
# (scripts/build-wheel.sh): only the PyO3 crates and the binary are rebuilt for maturin's
# environment (about a minute) instead of everything (about ten). The binary maturin leaves
# in target/release is built from the same sources and profile.
export CARGO_TARGET_DIR="$ROOT/target"
set +e
"$PYTHON" -m pytest -q --durations=25 tests
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure of the suite, not a pass" >&2
  exit 1
fi
exit "$status"
