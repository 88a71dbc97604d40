#!/usr/bin/env bash
# Runs the built image ($IMAGE, default gpupipe) as its own user, on the CPU: the image check and `gpupipe info`, a
# short `gpupipe bench --device cpu`, a two-epoch `gpupipe train --device cpu` writing its checkpoint to a mounted
# folder, and a resume from it. The sample data is written once by the image, then mounted read-only.
# Outputs stay in $OUT (default runs/docker-test).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-gpupipe}
OUT=$(realpath -m "${OUT:-runs/docker-test}")
# shellcheck source=docker/engine.sh
. docker/engine.sh
pick_engine
has_image "$IMAGE" || { echo "error: no image $IMAGE: build it first (make docker)" >&2; exit 1; }
probe_run_flags "$IMAGE"
run() { "${ENGINE[@]}" run --rm "${RUN_FLAGS[@]}" --shm-size 1g "$@"; }
step() { echo "== $*"; }

# the image's user writes there; a previous run's files (the image user's) are removed from inside the image
if [ -e "$OUT/data" ] || [ -e "$OUT/run" ]; then
  run --user 0 -v "$OUT:/out" --entrypoint rm "$IMAGE" -rf /out/data /out/run
fi
mkdir -p "$OUT/data" "$OUT/run"
chmod a+rwx "$OUT/data" "$OUT/run"
# a tenth of the embedded set's images (10 classes): a short run
run -v "$OUT/data:/out" "$IMAGE" sample-data /out/sample --per-class 6 >/dev/null
run -v "$OUT/data:/out" "$IMAGE" sample-data /out/sample-val --split val --per-class 2 >/dev/null
gp() { run -v "$OUT/data:/data:ro" -v "$OUT/run:/out" "$IMAGE" "$@"; }

user=$(run --entrypoint id "$IMAGE" -un)
[ "$(run --entrypoint id "$IMAGE" -u)" != 0 ] || { echo "error: $IMAGE runs as root" >&2; exit 1; }
step "the image check, as $user"
run --entrypoint python "$IMAGE" /opt/check_image.py
step "gpupipe info"
gp info 2>&1 | tee "$OUT/run/info.txt"
grep -q "nvjpeg.*CUDA" "$OUT/run/info.txt" || { echo "error: info does not say why nvjpeg is unavailable" >&2; exit 1; }

step "gpupipe bench --device cpu"
gp bench --data /data/sample --device cpu --pipelines decode,train --image-size 96 --batch-size 32 --workers 2 \
  --seconds 1 --repeats 1 --json /out/bench.json

train=(train --data /data/sample --val /data/sample-val --model resnet10t --image-size 64 --batch-size 16 --lr 0.2
  --workers 1 --device cpu --out /out/train)
step "gpupipe train: two epochs"
gp "${train[@]}" --epochs 2
test -s "$OUT/run/train/checkpoints/last.pt" || { echo "error: no checkpoint in $OUT/run/train" >&2; exit 1; }
step "gpupipe train --resume: a third epoch from the checkpoint"
gp "${train[@]}" --epochs 3 --resume --allow-config-change 2>&1 | tee "$OUT/run/resume.txt"
grep -q "resumed from" "$OUT/run/resume.txt" || { echo "error: the run did not say it resumed" >&2; exit 1; }
epochs=$(wc -l <"$OUT/run/train/metrics.jsonl")
[ "$epochs" = 3 ] || { echo "error: metrics.jsonl has $epochs epochs, not 3" >&2; exit 1; }
echo "docker-test passed: $IMAGE ran info, bench, train and resume (outputs in $OUT/run)"
