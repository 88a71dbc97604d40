#!/usr/bin/env bash
# Builds docker/Dockerfile as $IMAGE (default gpupipe) with docker, else podman (docker/engine.sh), on $BASE (default
# debian:bookworm-slim; made with mmdebstrap where no registry answers). Prints the build time and the image size.
# Extra arguments go to the build (e.g. --build-arg EXTRAS=...).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-gpupipe}
BASE=${BASE:-debian:bookworm-slim}
# shellcheck source=docker/engine.sh
. docker/engine.sh
pick_engine
base=$(resolve_base "$BASE")
start=$(date +%s)
"${ENGINE[@]}" build "${BUILD_FLAGS[@]}" --build-arg "BASE=$base" -f docker/Dockerfile -t "$IMAGE" "$@" .
size=$("${ENGINE[@]}" image inspect --format '{{.Size}}' "$IMAGE")
echo "built $IMAGE on $base with ${ENGINE[0]} in $(( $(date +%s) - start )) s; image size $(( size / 1000000 )) MB"
