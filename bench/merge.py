"""Merge two `gpupipe bench --json` reports (e.g. Pillow and pillow-simd environments) into one, with every figure
as a ratio to the *first* report's baseline, and print the table."""

import argparse
import json

from rich.console import Console

from gpupipe.bench.report import print_table


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("reports", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    reps = [json.load(open(r)) for r in args.reports]
    base = {r["pipeline"]: r["images_per_s"] for r in reps[0]["results"] if r["backend"] == "baseline"}
    results = []
    for i, rep in enumerate(reps):
        for r in rep["results"]:
            if r["backend"] == "baseline" and i > 0:
                r = {**r, "backend": f"baseline ({'simd' if rep['machine']['pil_simd'] else 'pillow'} env)"}
            if r["pipeline"] in base:
                r = {**r, "vs_baseline": r["images_per_s"] / base[r["pipeline"]]}
            results.append(r)
    merged = {**reps[0], "results": results, "environments": [r["machine"] for r in reps]}
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print_table(merged, Console(width=160))


if __name__ == "__main__":
    main()
