#!/usr/bin/env bash
# On a GPU machine (after the DALI bundle is installed: ../shared/device/README.md), everything in two 10-minute calls:
#   bash bench/run_gpu.sh 1     the GPU tests (incl. tests/test_sync.py: ten batches of every GPU backend under
#                               torch.cuda.set_sync_debug_mode("error")) and the host budget on CUDA
#   bash bench/run_gpu.sh 2     dali, nvjpeg and synthetic train/eval at 224, dali and nvjpeg with RandAugment + erasing
#                               on the device stage, resnet50 end to end (each backend's step rate vs synthetic's)
# or one part by name: tests | host | decode | train | eval | augment | e2e (no argument: every part, in order).
# A failing part (the tests, say) does not stop the others; the exit status is then 1. A backend that cannot run there
# (DALI not carried) is a row saying why, and the rest are measured. torchcodec need not be carried: without it (or
# without its CUDA build) the nvjpeg backend decodes with torchvision's decoder.
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
    host) $PYTHON -m gpupipe.bench.host_budget "$DATA" --device cuda --batch 256 --batches 8 --workers 16 \
            --json "$OUTDIR/gpu-host-budget-${stamp}.json" ;;
    decode | train | eval)
      $PYTHON "${bench[@]}" --pipelines "$1" --json "$OUTDIR/gpu-$1-${stamp}.json" --plot "$OUTDIR/gpu-$1-${stamp}.png" ;;
    quick) $PYTHON "${bench[@]}" --backends dali,nvjpeg,synthetic --pipelines train,eval --seconds 4 --repeats 2 \
             --json "$OUTDIR/gpu-train-eval-${stamp}.json" ;;
    augment) $PYTHON "${bench[@]}" --backends dali,nvjpeg --pipelines train --aa rand-m9-mstd0.5-inc1 --reprob 0.25 \
               --seconds 4 --repeats 2 --json "$OUTDIR/gpu-augment-${stamp}.json" ;;
    e2e) $PYTHON "${bench[@]}" --pipelines train --model resnet50 --seconds 20 \
           --json "$OUTDIR/gpu-e2e-resnet50-${stamp}.json" ;;
    *) echo "unknown part '$1': tests, host, decode, train, eval, quick, augment or e2e" >&2; return 2 ;;
  esac
}

parts=("$@")
[ $# -gt 0 ] || parts=(tests host decode train eval augment e2e)
[ "${1:-}" = 1 ] && parts=(tests host)
[ "${1:-}" = 2 ] && parts=(quick augment e2e)
status=0
for p in "${parts[@]}"; do
  part "$p" || { echo "part $p failed" >&2; status=1; }
done
exit $status
