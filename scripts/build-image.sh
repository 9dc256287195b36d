#!/usr/bin/env bash
# Builds the container image (Containerfile) with buildah, or podman where buildah is
# missing: Debian bookworm, the `rollout` wheel and its dependencies; entry point `rollout`.
#
#   scripts/build-image.sh                         # -> localhost/rollout:latest
#   IMAGE=registry.example.com/rollout:0.1.0 WHEEL=dist/rollout-0.1.0-cp311-cp311-linux_x86_64.whl \
#     EXTRAS=lora,tracking scripts/build-image.sh
#
# Environment (defaults in brackets):
#   IMAGE       the tag to build [localhost/rollout:latest]
#   WHEEL       the wheel to install [built with scripts/build-wheel.sh]; it must be for
#               CPython 3.11, Debian bookworm's python3
#   EXTRAS      wheel extras to install too, e.g. lora,tracking []
#   BASE_IMAGE  the Debian bookworm base [localhost/rollout-debian:bookworm]. When that name
#               is not in local storage the script makes it with debootstrap from
#               DEBIAN_MIRROR [http://deb.debian.org/debian] (root, or `buildah unshare`), so
#               no registry is needed; with Docker Hub reachable,
#               BASE_IMAGE=docker.io/library/debian:bookworm-slim pulls it instead.
#   PIP_INSTALL_ARGS  extra `pip install` options for the wheel and its dependencies, e.g.
#               "--extra-index-url https://download.pytorch.org/whl/cpu" (CPU-only torch) []
#   CA_BUNDLE   a CA bundle pip must trust (behind a TLS-inspecting proxy, e.g. $PIP_CERT);
#               mounted for the build only, not copied into the image []
#   BUILDAH_ISOLATION  how buildah runs RUN steps; when unset and the default (an OCI runtime)
#               cannot start a container here (e.g. inside another container), chroot
# Then scripts/image-smoke.sh runs the quickstart inside the image.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-localhost/rollout:latest}"
BASE_IMAGE="${BASE_IMAGE:-localhost/rollout-debian:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
EXTRAS="${EXTRAS:-}"
PIP_INSTALL_ARGS="${PIP_INSTALL_ARGS:-}"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
fail() { printf 'build-image: %s\n' "$*" >&2; exit 1; }

if command -v buildah >/dev/null; then
  tool=buildah
elif command -v podman >/dev/null; then
  tool=podman
else
  fail "neither buildah nor podman is installed (on Debian: apt-get install buildah)"
fi

# The wheel, inside the build context (the repository root).
if [ -z "${WHEEL:-}" ]; then
  WHEEL="$("$ROOT/scripts/build-wheel.sh")"
fi
WHEEL="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
[ -f "$WHEEL" ] || fail "no wheel at $WHEEL"
case "$(basename "$WHEEL")" in
  rollout-*-cp311-cp311-linux_x86_64.whl) ;;
  *) fail "$(basename "$WHEEL") is not a CPython 3.11 x86_64 Linux wheel; the image's Python is Debian bookworm's python3.11: build it with PYTHON=<a python3.11 venv> scripts/build-wheel.sh" ;;
esac
case "$WHEEL" in
  "$ROOT"/dist/*) ;;
  *) mkdir -p "$ROOT/dist" && cp "$WHEEL" "$ROOT/dist/" && WHEEL="$ROOT/dist/$(basename "$WHEEL")" ;;
esac
wheel_arg="dist/$(basename "$WHEEL")"

# The base image: local storage, else debootstrap for the default name, else pull.
if ! "$tool" image exists "$BASE_IMAGE" 2>/dev/null && ! "$tool" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  if [ "$BASE_IMAGE" = "localhost/rollout-debian:bookworm" ]; then
    command -v debootstrap >/dev/null || fail "debootstrap is needed to make $BASE_IMAGE (apt-get install debootstrap), or set BASE_IMAGE to a Debian bookworm image you can pull"
    [ "$tool" = buildah ] || fail "making $BASE_IMAGE needs buildah (apt-get install buildah)"
    say "making $BASE_IMAGE with debootstrap from $DEBIAN_MIRROR"
    ctr="$(buildah from scratch)"
    trap 'buildah umount "$ctr" >/dev/null 2>&1 || true; buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
    rootfs="$(buildah mount "$ctr")"
    debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >&2
    cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb ${DEBIAN_MIRROR%/debian}/debian-security bookworm-security main
SOURCES
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    buildah umount "$ctr" >/dev/null
    buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    buildah commit --rm --quiet "$ctr" "$BASE_IMAGE" >/dev/null
    trap - EXIT
  else
    say "pulling $BASE_IMAGE"
    "$tool" pull "$BASE_IMAGE" >&2
  fi
fi

# buildah's default isolation needs an OCI runtime that can create namespaces and cgroups;
# inside a container it often cannot ("cgroups in hybrid mode not supported"): use chroot.
if [ "$tool" = buildah ] && [ -z "${BUILDAH_ISOLATION:-}" ]; then
  probe="$(buildah from --quiet "$BASE_IMAGE")"
  if ! buildah run "$probe" -- true >/dev/null 2>&1; then
    say "buildah cannot start an OCI container here: using BUILDAH_ISOLATION=chroot"
    export BUILDAH_ISOLATION=chroot
  fi
  buildah rm "$probe" >/dev/null
fi

# Behind a TLS-inspecting proxy pip needs the proxy's CA: mounted for the build only, never
# copied into the image.
ca_mount=()
if [ -n "${CA_BUNDLE:-}" ]; then
  [ -f "$CA_BUNDLE" ] || fail "CA_BUNDLE=$CA_BUNDLE is not a file"
  ca_mount=(--volume "$CA_BUNDLE:/run/rollout-ca.pem:ro")
  PIP_INSTALL_ARGS="--cert /run/rollout-ca.pem $PIP_INSTALL_ARGS"
fi

say "building $IMAGE from $BASE_IMAGE with $tool ($wheel_arg${EXTRAS:+, extras $EXTRAS})"
cd "$ROOT"
"$tool" build --layers -f Containerfile "${ca_mount[@]}" \
  --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --build-arg WHEEL="$wheel_arg" \
  --build-arg EXTRAS="$EXTRAS" \
  --build-arg PIP_INSTALL_ARGS="$PIP_INSTALL_ARGS" \
  -t "$IMAGE" . >&2
say "built $IMAGE; smoke test: IMAGE=$IMAGE scripts/image-smoke.sh"
echo "$IMAGE"
