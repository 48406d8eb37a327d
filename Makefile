# mfuscope: two commands on a fresh machine.
#   make demo   set up, profile a real 8-rank job, analyze it, print where to look
#               (then: make dashboard, and open http://127.0.0.1:8050/)
#   make test   set up, run the whole test suite
# Set-up is shared and idempotent: a .venv with torch (CPU build, pinned in
# constraints/ci.txt) and mfuscope installed editable with its [dev] extra.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mfuscope-installed
DEMO   ?= artifacts/demo

.PHONY: all install demo dashboard test bench gpu-checks clean

all: test

$(STAMP): pyproject.toml constraints/ci.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/ci.txt -e '.[dev]'
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m mfuscope.demo --out $(DEMO)

dashboard: $(STAMP)
	$(VENV)/bin/mfuscope dashboard $(DEMO)/runs

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_load.py
	$(PY) benchmarks/bench_analyze.py
	$(PY) benchmarks/bench_overhead.py
	$(PY) benchmarks/bench_dashboard.py
	$(PY) benchmarks/bench_plan.py
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_ci.py

# On a machine with a GPU (its own python with CUDA torch, not this .venv's CPU build): every GPU
# check in one go, each writing JSON under $(GPU_OUT); a failing one does not stop the others.
GPU_PY  ?= python3
GPU_OUT ?= artifacts/gpu
gpu-checks:
	$(GPU_PY) -m pip install --quiet -e .
	mkdir -p $(GPU_OUT)
	-$(GPU_PY) scripts/gpu_kernels_check.py --json $(GPU_OUT)/kernels_check.json > /dev/null
	-$(GPU_PY) scripts/gpu_check.py --json $(GPU_OUT)/gpu_check.json > /dev/null
	-$(GPU_PY) benchmarks/bench_kernels.py --rounds 10 --json $(GPU_OUT)/bench_kernels.json
	@echo "GPU results in $(GPU_OUT)/"

clean:
	rm -rf $(VENV) artifacts build dist *.egg-info
