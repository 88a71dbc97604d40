#!/bin/sh
# Issue 21: the device stage's RandAugment (rand-m9-mstd0.5-inc1) + random erasing 0.25, the code before the batch
# draws and family calls (commit $BEFORE) and this checkout's, in one run, each beside pillow's plain loader, on
# ImageNet-like photos (batch 256) and large photos (batch 32). bench/README.md, "Host budget". From the repository
# root:   sh bench/host_budget_augment.sh [DATA (default: data)] [OUT (default: bench/results)]
# DATA holds photos/ and photos-large/ (bench/real_photos.py); each is listed 3 times in a CSV. NOTE="..." goes into
# the JSON's meta (the machine and how busy it was).
set -e
BEFORE=${BEFORE:-4a1fdeb}
PYTHON=${PYTHON:-$(pwd)/.venv/bin/python}  # not realpath: that would leave the venv
data=$(realpath "${1:-data}")
out=$(realpath "${2:-bench/results}")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/before"
git archive "$BEFORE" gpupipe | tar -x -C "$tmp/before"
cp gpupipe/bench/host_budget.py "$tmp/before/gpupipe/bench/"  # the same counters (launches) on both sides
for set in photos photos-large; do
  for _ in 1 2 3; do
    find "$data/$set" -name '*.jpg' | sort | awk -F/ '{print $0 "," substr($(NF-1), 7) + 0}'
  done >"$tmp/$set.csv"
done
for side in before after; do
  tree=$([ $side = before ] && echo "$tmp/before" || pwd)
  (cd "$tree" && PYTHONPATH="$tree" nice -n 10 "$PYTHON" -m gpupipe.bench.host_budget "$tmp/photos.csv" \
    --sizes 224 32 --batch 256 --batches 6 --workers 2 --backends pillow --json "$tmp/$side-photos.json")
  (cd "$tree" && PYTHONPATH="$tree" nice -n 10 "$PYTHON" -m gpupipe.bench.host_budget "$tmp/photos-large.csv" \
    --sizes 224 32 --batch 32 --batches 3 --workers 2 --backends pillow --json "$tmp/$side-large.json")
done
"$PYTHON" - "$tmp" "$out/host-budget-augment-$(date +%Y-%m-%d).json" "$BEFORE" "${NOTE:-}" <<'EOF'
import json, sys

tmp, path, before, note = sys.argv[1:]
out = {"meta": {"before": before, "command": "sh bench/host_budget_augment.sh", "machine": note}}
for side in ("before", "after"):
    out[side] = []
    for kind in ("photos", "large"):
        d = json.load(open(f"{tmp}/{side}-{kind}.json"))
        out["meta"].update({k: d["meta"][k] for k in ("date", "torch", "method")})
        out[side] += [{**r, "data": r["data"].rsplit("/", 1)[-1]} for r in d["rows"]]
json.dump(out, open(path, "w"), indent=1)
print("wrote", path)
EOF
