#!/usr/bin/env bash
# On a GPU machine, in parts that each fit a 10-minute call:
#   bash bench/run_gpu.sh tests | decode | train | eval | e2e     one part
#   bash bench/run_gpu.sh                                         every part, in that order
# tests: the GPU tests; decode/train/eval: that pipeline at 224 for every available backend; e2e: the end-to-end
# resnet50 mode. A failing part (the tests, say) does not stop the others; the exit status is then 1.
# Writes JSON (and the tests' log) to ${OUT:-bench/results}.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUTDIR=${OUT:-bench/results}
DATA=${DATA:-data/sample-gpu}
stamp=$(date -u +%Y-%m-%d)
mkdir -p "$OUTDIR"
$PYTHON -m gpupipe sample-data "$DATA" --classes 10 --per-class 200 >/dev/null || exit 1
bench=(-m gpupipe bench --data "$DATA" --device cuda --workers 16 --batch-size 256)

part() {
  case "$1" in
    tests) $PYTHON -m pytest -m gpu -q tests 2>&1 | tee "$OUTDIR/gpu-tests-${stamp}.txt" ;;
    decode | train | eval)
      $PYTHON "${bench[@]}" --pipelines "$1" --json "$OUTDIR/gpu-$1-${stamp}.json" --plot "$OUTDIR/gpu-$1-${stamp}.png" ;;
    e2e) $PYTHON "${bench[@]}" --pipelines train --model resnet50 --seconds 20 \
           --json "$OUTDIR/gpu-e2e-resnet50-${stamp}.json" ;;
    *) echo "unknown part '$1': tests, decode, train, eval or e2e" >&2; return 2 ;;
  esac
}

parts=("$@")
[ $# -gt 0 ] || parts=(tests decode train eval e2e)
status=0
for p in "${parts[@]}"; do
  part "$p" || { echo "part $p failed" >&2; status=1; }
done
exit $status
