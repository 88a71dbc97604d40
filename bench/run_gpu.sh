#!/usr/bin/env bash
# On a GPU machine: the GPU tests, the train-recipe benchmark at 224 for dali and nvjpeg, and the end-to-end
# resnet50 mode. Writes JSON to ${OUT:-bench/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUTDIR=${OUT:-bench/results}
DATA=${DATA:-data/sample-gpu}
stamp=$(date -u +%Y-%m-%d)
mkdir -p "$OUTDIR"
$PYTHON -m gpupipe sample-data "$DATA" --classes 10 --per-class 200 >/dev/null
$PYTHON -m pytest -m gpu -q tests | tee "$OUTDIR/gpu-tests-${stamp}.txt"
$PYTHON -m gpupipe bench --data "$DATA" --device cuda --workers 16 --batch-size 256 --pipelines decode,train,eval \
  --json "$OUTDIR/gpu-${stamp}.json" --plot "$OUTDIR/gpu-${stamp}.png"
$PYTHON -m gpupipe bench --data "$DATA" --device cuda --workers 16 --batch-size 256 --pipelines train \
  --model resnet50 --seconds 20 --json "$OUTDIR/gpu-e2e-resnet50-${stamp}.json"
