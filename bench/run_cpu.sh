#!/usr/bin/env bash
# The CPU suites on this machine: 1 worker and 2 workers, every available backend plus the baseline, in one run
# each. Results go to bench/results/ with the machine, versions and date inside the JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DATA=${DATA:-data/sample}
SECONDS_PER=${SECONDS_PER:-6}
stamp=$(date -u +%Y-%m-%d)
"$VENV/bin/gpupipe" sample-data "$DATA" >/dev/null
for w in 1 2; do
  "$VENV/bin/gpupipe" bench --data "$DATA" --device cpu --workers "$w" --seconds "$SECONDS_PER" --repeats 3 \
    --json "bench/results/cpu-${w}w-${stamp}.json" --plot "bench/results/cpu-${w}w-${stamp}.png"
done
cp "bench/results/cpu-1w-${stamp}.png" bench/results/cpu-2core.png
