#!/usr/bin/env bash
# The CPU suites on this machine: every available backend plus the baseline, timed in interleaved windows, with
# 1 and 2 workers. DATA is the folder (default: ImageNet-like JPEGs cut from real photos, see real_photos.py);
# results go to bench/results/cpu-<data>-<N>w-<date>.{json,png}, with the machine, versions and date in the JSON.
# Large photos decode at tens of images/s: use a smaller BATCH and longer SECONDS_PER there, e.g.
#   DATA=data/photos-large WORKERS=1 BATCH=16 SECONDS_PER=15 bash bench/run_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DATA=${DATA:-data/photos}
WORKERS=${WORKERS:-1 2}
SECONDS_PER=${SECONDS_PER:-6}
REPEATS=${REPEATS:-3}
BATCH=${BATCH:-64}
PIPELINES=${PIPELINES:-decode,floor,train,eval}
stamp=$(date -u +%Y-%m-%d)
label=$(basename "$DATA")
if [ ! -d "$DATA" ]; then
  case "$label" in
    photos) "$VENV/bin/python" bench/real_photos.py --out "$DATA" --kind imagenet --count 1000 ;;
    photos-large) "$VENV/bin/python" bench/real_photos.py --out "$DATA" --kind large --count 120 ;;
    *) "$VENV/bin/gpupipe" sample-data "$DATA" >/dev/null ;;
  esac
fi
for w in $WORKERS; do
  out="bench/results/cpu-${label}-${w}w-${stamp}"
  "$VENV/bin/gpupipe" bench --data "$DATA" --device cpu --workers "$w" --seconds "$SECONDS_PER" --repeats "$REPEATS" \
    --batch-size "$BATCH" --pipelines "$PIPELINES" \
    --json "$out.json" --plot "$out.png"
done
