#!/usr/bin/env bash
# The GPU check, in four parts of under 10 minutes each (one device call each, the machine kept warm between them;
# the first two need no DALI, so that DALI can be carried beside them in parts: ../shared/device/README.md):
#   bash bench/run_gpu.sh 1   the `gpu` tests (pytest -m gpu), then the nvjpeg, pillow and turbojpeg loaders alone
#   bash bench/run_gpu.sh 2   ResNet-50 trained end to end (bf16, channels-last, batch 256) fed by synthetic (the
#                             GPU's ceiling), pillow, turbojpeg and nvjpeg
#   bash bench/run_gpu.sh 3   dali and DALI's own pipeline (bench/gpu_check.py dali-own, written as DALI's docs write
#                             it), alone and feeding ResNet-50; `gpupipe train --backend dali` data-wait in fp16 and
#                             bf16; the GPU memory the dali loader holds
#   bash bench/run_gpu.sh 4   the CIFAR-10 AlexNet experiment at 227 px, batch 64 (gpupipe.bench.cifar_alexnet):
#                             torchvision's CIFAR10 loader with 0 workers and every core beside pillow, turbojpeg,
#                             dali and cache="device" on the same dataset object, alone and under a simulated step;
#                             its report also in ${OUT:-bench/results}/cifar-alexnet-cuda-DATE.json
#   bash bench/run_gpu.sh --cpu 1|2|3|4   the same steps, small, on the CPU: a check of this script without a GPU
# Every measurement runs in a fresh process under `timeout` (the step budgets below add up to under 9 minutes a
# part: 1: data 120 + tests 270 + 3 x 45 s; 2: 4 x 80 s; 3: 2 x 50 + 2 x 75 + 2 x (90 + 15) + 45 s; 4: 480 s); a step that fails or runs out of time is a row saying so, and the rest go on (exit status 1). Each part
# writes ${OUT:-bench/results}/gpu-check-partN-DATE.json: the rows with the device, date, commit and versions.
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUTDIR=${OUT:-bench/results}
DEVICE=cuda BATCH=256 SIZE=224 SECONDS=10 MODEL=resnet50 CLASSES=10 PER_CLASS=40 COPIES=20 SCALE=1
CIFAR=(--count 10000 --batch 64 --size 227 --seconds 10 --steps 20)  # part 4: the write-up's settings
if [ "${1:-}" = --cpu ]; then  # small and quick: every step's code runs, no figure means anything
  shift
  DEVICE=cpu BATCH=8 SIZE=64 SECONDS=1 MODEL=test_resnet CLASSES=2 PER_CLASS=8 COPIES=2 SCALE=3
  CIFAR=(--count 200 --batch 8 --size 64 --seconds 1 --steps 3)
fi
DATA=${DATA:-/tmp/gpupipe-check/$DEVICE-data}
CIFAR_DATA=${CIFAR_DATA:-/tmp/gpupipe-check/$DEVICE-cifar}  # made there by the step when it holds none
stamp=$(date -u +%Y-%m-%d)
part_no=${1:-}
rows="$OUTDIR/gpu-check-part${part_no}-${DEVICE}-${stamp}.jsonl"
mkdir -p "$OUTDIR"
status=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
check=("$PYTHON" bench/gpu_check.py --device "$DEVICE" --batch "$BATCH" --size "$SIZE" --seconds "$SECONDS")

# step NAME SECONDS COMMAND...: COMMAND under `timeout` (SECONDS x SCALE on the CPU); its JSON row (its last line
# of output), or a row naming the failure, appended to the part's rows. run NAME SECONDS COMMAND...: the same for a
# command that prints no row (a row only when it fails).
step() { _timed row "$@"; }
run() { _timed none "$@"; }
_timed() {
  local kind=$1 name=$2 limit=$(($3 * SCALE)) out rc
  shift 3
  echo "== $name (at most ${limit} s)" >&2
  out=$(timeout --kill-after=10 "$limit" "$@" | tail -n 1)
  rc=$?
  if [ "$rc" -eq 0 ] && { [ "$kind" = none ] || [ "${out:0:1}" = "{" ]; }; then
    [ "$kind" = row ] && echo "$out" >>"$rows"
    return 0
  fi
  status=1
  local why="exit $rc"
  [ "$rc" -eq 124 ] && why="over its ${limit} s"
  printf '{"what": "%s", "failed": "%s", "device": "%s"}\n' "$name" "$why" "$DEVICE" >>"$rows"
  return 1
}

# the data: ImageNet-like JPEGs (300-600 px), each hard-linked COPIES times: an epoch of a 256-batch loader is
# 30+ batches, made in seconds
data() {
  [ -f "$DATA/.complete" ] && return 0
  rm -rf "$DATA" && mkdir -p "$(dirname "$DATA")"
  timeout $((120 * SCALE)) "$PYTHON" -m gpupipe sample-data "$DATA" --classes "$CLASSES" --per-class "$PER_CLASS" \
    >/dev/null || return 1
  for dir in "$DATA"/*/; do
    for f in "$dir"*.jpg; do
      for k in $(seq 2 "$COPIES"); do ln "$f" "${f%.jpg}-$k.jpg"; done
    done
  done
  touch "$DATA/.complete"
}

train_wait() {  # gpupipe train --backend dali, two epochs: the second epoch's data-wait
  local precision=$1 out=/tmp/gpupipe-check/train-dali-$1-$DEVICE
  rm -rf "$out"
  run "gpupipe train dali $precision" 90 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 \
    -m gpupipe train --data "$DATA" --backend dali --model "$MODEL" --batch-size $((BATCH / 2)) --accum 2 \
    --precision "$precision" --channels-last --epochs 2 --image-size "$SIZE" --device "$DEVICE" --out "$out" &&
    step "data-wait dali $precision" 15 "${check[@]}" train-wait "$out"
}

case "$part_no" in
  1)
    data || exit 1
    if [ "$DEVICE" = cuda ]; then
      echo "== pytest -m gpu (at most 270 s)" >&2
      timeout 270 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUTDIR/gpu-tests-${stamp}.txt" \
        | tail -n 3
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    else
      "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider --co tests >/dev/null || status=1  # collected, not run
    fi
    for backend in nvjpeg pillow turbojpeg; do
      [ "$DEVICE" = cpu ] && [ "$backend" = nvjpeg ] && continue  # nvjpeg decodes on CUDA only
      step "loader $backend" 45 "${check[@]}" loader "$DATA" "$backend"
    done
    ;;
  2)
    data || exit 1
    for backend in synthetic pillow turbojpeg nvjpeg; do
      [ "$DEVICE" = cpu ] && [ "$backend" = nvjpeg ] && continue
      step "train $MODEL with $backend" 80 "${check[@]}" e2e "$DATA" "$backend" --model "$MODEL"
    done
    ;;
  3)
    data || exit 1
    step "loader dali" 50 "${check[@]}" loader "$DATA" dali
    step "loader dali-own" 50 "${check[@]}" dali-own "$DATA"
    step "train $MODEL with dali" 75 "${check[@]}" e2e "$DATA" dali --model "$MODEL"
    step "train $MODEL with dali-own" 75 "${check[@]}" dali-own "$DATA" --model "$MODEL"
    train_wait fp16
    train_wait bf16
    [ "$DEVICE" = cuda ] && step "gpu memory dali" 45 "${check[@]}" memory "$DATA" dali
    ;;
  4)
    step "cifar alexnet" 480 "$PYTHON" -m gpupipe.bench.cifar_alexnet "$CIFAR_DATA" --device "$DEVICE" "${CIFAR[@]}" \
      --json "$OUTDIR/cifar-alexnet-${DEVICE}-${stamp}.json"
    ;;
  *)
    echo "usage: bash bench/run_gpu.sh [--cpu] 1|2|3|4" >&2
    exit 2
    ;;
esac
"$PYTHON" bench/gpu_check.py collect "$rows" "${rows%.jsonl}.json" >/dev/null || status=1
cat "${rows%.jsonl}.json"
exit $status
