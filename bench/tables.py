"""Markdown tables of `gpupipe bench --json` reports, for bench/README.md.

python bench/tables.py bench/results/cpu-photos-1w-2026-11-22.json [...]
"""

import json
import sys


def table(path: str) -> str:
    with open(path) as f:
        rep = json.load(f)
    m, cfg = rep["machine"], rep["config"]
    keys = ("torch", "torchvision", "pil", "pil_simd", "libjpeg_turbo", "pyturbojpeg", "dali")
    dali = m.get("dali")
    m = {**m, "dali": dali.get("package") if isinstance(dali, dict) else dali}
    versions = ", ".join(f"{k} {m[k]}" for k in keys if m.get(k) is not None)
    lines = [
        f"**{path.rsplit('/', 1)[-1]}** — {m['cpu']}, {cfg['workers']} worker(s), {cfg['device']}, "
        f"{cfg['seconds']} s per figure in {cfg['repeats']} interleaved windows, {rep['date'][:10]}; {versions}",
        "",
        "| pipeline | backend | img/s | spread | img/s/worker | vs baseline | vs floor |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rep["results"]:
        ratio = f"{r['vs_baseline']:.2f}x" if r.get("vs_baseline") else ""
        floor = f"{r['vs_floor']:.0%}" if r.get("vs_floor") else ""
        lines.append(
            f"| {r['pipeline']} | {r['backend']} | {r['images_per_s']:,.0f} | "
            f"{r['spread'][0]:,.0f}–{r['spread'][1]:,.0f} | {r['images_per_s_per_worker']:,.0f} | {ratio} | {floor} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
