#!/usr/bin/env bash
# Builds the `rollout` wheel into dist/: the release binary (maturin, bindings = "bin") with
# the rollout_sdk and python_plugins packages (packaging/pyproject.toml). Needs cargo and the
# Python the wheel is for; it installs the pinned maturin into that Python's environment if
# it is missing. Prints the wheel's path on stdout.
#
#   scripts/build-wheel.sh                    # for .venv/bin/python (scripts/setup.sh makes it)
#   PYTHON=/path/to/python scripts/build-wheel.sh
#
# The wheel is for that Python's version and platform only: the binary links its libpython.
# Cargo builds in target/wheel/cargo (CARGO_TARGET_DIR overrides it), apart from the
# development build in target/release, because maturin's build environment differs from
# `cargo build`'s and sharing one directory would make each rebuild PyO3 and rollout.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="${WHEEL_DIR:-$ROOT/dist}"
STAGE="$ROOT/target/wheel/pkg"
MATURIN_VERSION="$(sed -n 's/^maturin==//p' "$ROOT/requirements.txt")"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
fail() { printf 'build-wheel: %s\n' "$*" >&2; exit 1; }

command -v cargo >/dev/null || fail "cargo is not installed; install Rust with rustup (https://rustup.rs)"
[ -x "$PYTHON" ] || fail "$PYTHON does not exist: run scripts/setup.sh or set PYTHON"
if ! "$PYTHON" -m maturin --version >/dev/null 2>&1; then
  say "installing maturin==$MATURIN_VERSION into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
  "$PYTHON" -m pip install --quiet "maturin==$MATURIN_VERSION"
fi

# maturin packs only Python packages under its pyproject.toml's directory: stage them.
rm -rf "$STAGE"
mkdir -p "$STAGE"
cp "$ROOT/packaging/pyproject.toml" "$ROOT/README.md" "$STAGE/"
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - rollout_sdk python_plugins \
  | tar -C "$STAGE" -xf -

say "building the wheel for $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
mkdir -p "$OUT"
(
  cd "$STAGE"
  CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target/wheel/cargo}" \
    "$PYTHON" -m maturin build --release --locked --interpreter "$PYTHON" --out "$OUT" >&2
)
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)"
tag="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')"
wheel="$(ls -t "$OUT"/rollout-"$version"-"$tag"-*.whl 2>/dev/null | head -n1)"
[ -n "$wheel" ] || fail "maturin finished but no rollout-$version-$tag-*.whl is in $OUT"
echo "$wheel"
