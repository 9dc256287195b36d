#!/usr/bin/env bash
# Smoke test of the image scripts/build-image.sh built: its entry point is `rollout`, and
# `rollout --version`, `rollout init-quickstart` and a two-step `rollout run` of the
# quickstart work inside it (no repository, no network needed).
#
#   IMAGE=localhost/rollout:latest scripts/image-smoke.sh
#
# Uses podman run (through the entry point) where podman is installed, else buildah run.
set -euo pipefail

IMAGE="${IMAGE:-localhost/rollout:latest}"
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
fail() { printf 'image-smoke: %s\n' "$*" >&2; exit 1; }

# Extra `podman run`/`buildah run` options, e.g. RUN_ARGS="-v /data:/data".
read -ra run_args <<<"${RUN_ARGS:-}"
quick=(--set run.steps=2 --set sft.steps=2 --set sft.batch_size=8
  --set rollout.prompts_per_step=4 --set rollout.group_size=2 --set policy.options.torch_threads=1)

if command -v podman >/dev/null; then
  entrypoint="$(podman image inspect --format '{{json .Config.Entrypoint}}' "$IMAGE")"
  [ "$entrypoint" = '["rollout"]' ] || fail "the entry point of $IMAGE is $entrypoint, not [\"rollout\"]"
  say "rollout --version (podman run $IMAGE)"
  podman run --rm "${run_args[@]}" "$IMAGE" --version
  say "init-quickstart and a two-step run in one container"
  podman run --rm "${run_args[@]}" --entrypoint /bin/sh "$IMAGE" -c \
    "rollout init-quickstart --dir /tmp/qs && rollout run /tmp/qs/quickstart.toml ${quick[*]}"
else
  command -v buildah >/dev/null || fail "neither podman nor buildah is installed"
  entrypoint="$(buildah inspect --type image --format '{{.OCIv1.Config.Entrypoint}}' "$IMAGE")"
  [ "$entrypoint" = '[rollout]' ] || fail "the entry point of $IMAGE is $entrypoint, not [rollout]"
  ctr="$(buildah from --quiet "$IMAGE")"
  trap 'buildah rm "$ctr" >/dev/null' EXIT
  if [ -z "${BUILDAH_ISOLATION:-}" ] && ! buildah run "$ctr" -- true >/dev/null 2>&1; then
    export BUILDAH_ISOLATION=chroot # no OCI runtime here (e.g. inside a container)
  fi
  # buildah run does not apply the entry point: run `rollout` (the entry point) explicitly.
  say "rollout --version (buildah run, $IMAGE)"
  buildah run "${run_args[@]}" "$ctr" -- rollout --version
  say "rollout init-quickstart --dir /tmp/qs"
  buildah run "${run_args[@]}" "$ctr" -- rollout init-quickstart --dir /tmp/qs
  say "rollout run /tmp/qs/quickstart.toml (two steps)"
  buildah run "${run_args[@]}" --workingdir /work "$ctr" -- rollout run /tmp/qs/quickstart.toml "${quick[@]}"
fi
say "the image works"
