#!/usr/bin/env bash
# Pillow and pillow-simd side by side in one run. pillow-simd installs as `PIL` and replaces Pillow, so it lives in
# a second environment, .venv-simd, which reuses .venv's packages (a .pth file) but has its own PIL first on the path.
# Needs: make setup (the .venv), a C compiler, libjpeg-dev and zlib1g-dev.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${VENV:-.venv}
SIMD=${SIMD_VENV:-.venv-simd}
DATA=${DATA:-data/sample}
WORKERS=${WORKERS:-1}
SECONDS_PER=${SECONDS_PER:-6}
VERSION=${PILLOW_SIMD_VERSION:-9.5.0.post2}
if [ ! -x "$SIMD/bin/python" ]; then
  python3 -m venv "$SIMD"
  base_site=$("$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  simd_site=$("$SIMD/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$base_site" > "$simd_site/_gpupipe_base.pth"  # appended after simd_site: its own PIL wins
  CC="cc -mavx2" "$SIMD/bin/python" -m pip install -q --no-binary :all: --no-deps "pillow-simd==$VERSION"
fi
"$SIMD/bin/python" -c "import PIL, sys; from gpupipe.backends.pillow import pil_is_simd; \
sys.exit(0 if pil_is_simd() else 'not pillow-simd: ' + PIL.__version__)"
stamp=$(date -u +%Y-%m-%d)
out=bench/results/pillow-simd-${WORKERS}w-${stamp}
"$BASE/bin/gpupipe" sample-data "$DATA" >/dev/null
"$BASE/bin/gpupipe" bench --data "$DATA" --device cpu --workers "$WORKERS" --seconds "$SECONDS_PER" \
  --backends pillow --json "$out.pillow.json"
"$SIMD/bin/python" -m gpupipe bench --data "$DATA" --device cpu --workers "$WORKERS" --seconds "$SECONDS_PER" \
  --backends pillow-simd --json "$out.simd.json"
"$BASE/bin/python" bench/merge.py "$out.pillow.json" "$out.simd.json" --out "$out.json"
