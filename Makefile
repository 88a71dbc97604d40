# Two commands on a fresh Debian/Ubuntu machine: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
DATA   ?= data/sample
VAL    ?= $(DATA)-val
EXTRAS ?= all,dev
# e.g. https://download.pytorch.org/whl/cpu: torch and torchvision from there first (a CPU-only torch: no CUDA wheels)
TORCH_INDEX ?=

.PHONY: setup system-deps demo test lint check fast-tests bench-cpu clean docker docker-test

# System packages, installed when run as root: TurboJPEG's C library (the turbojpeg backend loads it at run time),
# libjpeg-turbo's headers (the install builds the turbojpeg backend's window decode against them: gpupipe/_jpeg_window.c)
# and its tools (the tests make an arithmetic-coded JPEG with jpegtran).
APT_PKGS := libturbojpeg0 libjpeg-dev libjpeg-turbo-progs
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg || ! command -v jpegtran >/dev/null || \
	  ! [ -e /usr/include/jpeglib.h ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $(APT_PKGS)"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(APT_PKGS) >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(APT_PKGS) >/dev/null; }; \
	  else echo "note: apt-get install $(APT_PKGS): without them the turbojpeg backend is unavailable (or decodes whole images) and the arithmetic-JPEG test is skipped"; fi; \
	fi

# A new .venv takes about 7 GB (torch's CUDA build, DALI), and pip unpacks each wheel beside it first: a disk with less
# free space than MIN_FREE_GB is named before the install starts, not by pip's "No space left on device" midway.
MIN_FREE_GB ?= 8
$(STAMP): pyproject.toml setup.py gpupipe/_jpeg_window.c gpupipe/_stamps.c
	@if [ ! -d $(VENV) ]; then where=$(dir $(abspath $(VENV))); \
	  free=$$(df -Pk "$$where" 2>/dev/null | awk 'NR == 2 {print int($$4 / 1048576)}'); \
	  if [ -n "$$free" ] && [ "$$free" -lt $(MIN_FREE_GB) ]; then \
	    echo "error: $$free GB free in $$where: a new $(VENV) needs about $(MIN_FREE_GB) GB (torch's CUDA build," \
	      "DALI; docs/install.md): free some space, or set MIN_FREE_GB=0 to try anyway" >&2; \
	    exit 1; fi; fi
	$(MAKE) system-deps
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# a DALI wheel left by an earlier install may be for another CUDA (the dali extra follows torch's): out first
	$(PY) -m pip uninstall -y -q $$($(PY) -m pip list --format=freeze | grep -o '^nvidia-dali-cuda[0-9]*') 2>/dev/null || true
	$(if $(TORCH_INDEX),$(PY) -m pip install -q torch torchvision --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

$(DATA)/.complete: | $(STAMP)
	$(VENV)/bin/gpupipe sample-data $(DATA)
	touch $@

# The held-out split the README's train command validates on.
$(VAL)/.complete: | $(STAMP)
	$(VENV)/bin/gpupipe sample-data $(VAL) --split val
	touch $@

# The main job: the benchmark table over every available backend, on the embedded sample data.
demo: setup $(DATA)/.complete $(VAL)/.complete
	$(VENV)/bin/gpupipe info
	$(VENV)/bin/gpupipe bench --data $(DATA) --seconds 3 --json runs/demo/bench.json --plot runs/demo/bench.png

# The checks .pre-commit-config.yaml also runs: lint (with complexity, C90), formatting, types, the Dockerfile.
lint: setup
	$(VENV)/bin/ruff check gpupipe tests bench examples
	$(VENV)/bin/ruff format --check gpupipe tests bench examples
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_imports.py tests/test_code_size.py
	$(VENV)/bin/hadolint docker/Dockerfile

test: setup lint
	$(VENV)/bin/python -m pytest

# The inner loop: lint beside the tests not marked slow (the full suite is `make test`, as CI runs it), meant to take
# at most 5 minutes on a clean 2-core machine (a test over a few seconds is marked slow: CONTRIBUTING.md). One
# backend's tests: `.venv/bin/python -m pytest -m dali` (markers: pillow, turbojpeg, dali, nvjpeg, synthetic).
check: setup
	$(MAKE) --no-print-directory -j2 lint fast-tests

fast-tests: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow"

bench-cpu: setup $(DATA)/.complete
	bash bench/run_cpu.sh

# The CUDA image (docker/Dockerfile) with docker, else podman (installed when root; a Debian base made with
# mmdebstrap where no registry answers), then run on the CPU as its user: info, bench, train and resume.
IMAGE ?= gpupipe
docker:
	IMAGE=$(IMAGE) bash docker/build.sh

docker-test: docker
	IMAGE=$(IMAGE) bash docker/test.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
