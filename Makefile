# mfuscope: two commands on a fresh machine.
#   make demo   set up, profile a real 8-rank job, analyze it, print where to look
#               (then: make dashboard, and open http://127.0.0.1:8050/)
#   make test   set up, run the whole test suite
# Set-up is shared and idempotent: a .venv with torch (CPU build, pinned in
# constraints/ci.txt) and mfuscope installed editable with its [dev] extra.
#
# BYTECODE: this machine and CI set PYTHONDONTWRITEBYTECODE=1, so a module without its .pyc is
# compiled again by every process that imports it (every test rank recompiled sympy and torch's lazy
# modules: 6 s of CPU a rank, the suite 40% slower).  make's commands write bytecode instead (into
# .venv and the __pycache__ folders git ignores): a module the suite or the demo imports is compiled
# once, by the first process that imports it, and the rest never.  Compiling all 17,105 installed
# files up front (compileall -j 0) took 25 s of a fresh clone's 58 s set-up on 2 cores.
unexport PYTHONDONTWRITEBYTECODE

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mfuscope-installed
DEMO   ?= artifacts/demo

.PHONY: all install demo dashboard lint lint-tree test bench gpu-checks clean

all: test

$(STAMP): pyproject.toml setup.py analyzers/_kineto_scan.c constraints/ci.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -c constraints/ci.txt -e '.[dev]'
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m mfuscope.demo --out $(DEMO)

dashboard: $(STAMP)
	$(VENV)/bin/mfuscope dashboard $(DEMO)/runs

# `make lint` (seconds; `make test` runs it first): the import contracts (import-linter) and ruff, both
# configured in pyproject.toml (docs/contributing.md, "Layers and lint").  import-linter cannot follow
# pyproject's package-dir mapping of the top-level folders, so it reads a throwaway tree with the
# installed layout: $(LINT_TREE)/mfuscope/ links each entry of mfuscope/ and each mapped folder
# (mfuscope/analyzers -> analyzers, ...; the folders are read from the package-dir table).
LINT_TREE    ?= build/lint-tree
LINT_FOLDERS := $(shell sed -n 's/^"mfuscope\.\([a-z_]*\)" = "\1"$$/\1/p' pyproject.toml)
lint-tree:
	@rm -rf $(LINT_TREE) && mkdir -p $(LINT_TREE)/mfuscope
	@ln -s $(CURDIR)/mfuscope/* $(LINT_TREE)/mfuscope/
	@for d in $(LINT_FOLDERS); do ln -s $(CURDIR)/$$d $(LINT_TREE)/mfuscope/$$d; done

# lint-imports puts its working directory first on sys.path: it runs in the tree, not here.
lint: $(STAMP) lint-tree
	cd $(LINT_TREE) && PYTHONPATH=$$PWD $(abspath $(VENV))/bin/lint-imports --no-logo --no-cache $(CURDIR)/pyproject.toml
	$(VENV)/bin/ruff check

# The suite's budget is 12 minutes on 2 cores, venv included (docs/contributing.md).  It runs in two
# lanes at once (tests/lanes.py: timed tests in front, the rest at low priority beside them) and
# ends with its wall time since make started; each lane lists its slowest tests.
MAKE_START := $(shell date +%s)
test: $(STAMP)
	@$(MAKE) --no-print-directory lint; lint_rc=$$?; \
	$(PY) -m mfuscope.tests.lanes; rc=$$?; \
	if [ $$lint_rc -ne 0 ]; then rc=1; echo "make test: make lint FAILED (its output is above the lanes')"; fi; \
	echo "make test: $$(( $$(date +%s) - $(MAKE_START) )) s wall since make started, venv set-up included (budget 720 s on 2 cores)"; \
	exit $$rc

bench: $(STAMP)
	$(PY) benchmarks/bench_load.py
	$(PY) benchmarks/bench_analyze.py
	$(PY) benchmarks/bench_overhead.py
	$(PY) benchmarks/bench_dashboard.py
	$(PY) benchmarks/bench_plan.py
	$(PY) benchmarks/bench_kernels.py
	$(PY) benchmarks/bench_ci.py

# On a machine with a GPU (its own python with CUDA torch, not this .venv's CPU build): every GPU
# check in one go, each step under its own time limit, results under $(GPU_OUT) (scripts/gpu_session.sh
# says what each file holds); a failing step does not stop the others.  Offline machines: put the
# missing dependencies' wheels in .whl/ first (docs/kernels.md).
GPU_PY  ?= python3
GPU_OUT ?= artifacts/gpu
gpu-checks:
	OUT=$(GPU_OUT) GPU_PY=$(GPU_PY) bash scripts/gpu_session.sh

clean:
	rm -rf $(VENV) artifacts build dist *.egg-info
