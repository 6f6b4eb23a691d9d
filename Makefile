# adaloss: `make help` lists the targets.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help setup test test-full lint format demo bench gpu-check tables figures reproduce-mini reproduce-claims docs clean results-check

help: ## list the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# the torch and torchvision builds CI tests (from the machines' disk); the package itself takes torch>=2.11
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[runner,test]'
	@# the docs extra (make docs) from PyPI; without it everything else still works and the site tests skip
	$(PY) -m pip install --quiet -e '.[docs]' || echo "warning: the docs extra did not install; make docs needs it"
	@touch $(STAMP)

setup: $(STAMP) ## create .venv (Python 3.11): torch 2.14.1, torchvision 0.29.1, the package with its runner and test extras

# Two pytest workers, one torch thread each: with torch's default (a thread per core) two workers put twice as
# many threads as cores to work, and their spin-waits cost a third of the suite's time on the 2-core machines.
TEST_THREADS ?= OMP_NUM_THREADS=1

test: setup ## run the test suite on the CPU, two pytest workers of one thread (about 7-8 minutes on 2 cores)
	$(TEST_THREADS) $(PY) -m pytest -q -n 2 --dist worksteal -m "not slow" tests

test-full: setup ## run every test, the slow ones included (two pytest workers of one thread)
	$(TEST_THREADS) $(PY) -m pytest -q -n 2 --dist worksteal tests

results-check: setup ## rerun the cheapest committed cell of every result on a page; compare bit for bit on the recorded kernel path (6 samples, a few CPU-minutes; --full: make test-full)
	$(PY) scripts/results_check.py

lint: setup ## ruff lint and format check; the import contracts of the three layers (pyproject.toml)
	$(VENV)/bin/ruff check src tests scripts train.py
	$(VENV)/bin/ruff format --check src tests scripts train.py
	$(VENV)/bin/lint-imports

format: setup ## ruff auto-format and fix
	$(VENV)/bin/ruff format src tests scripts train.py
	$(VENV)/bin/ruff check --fix src tests scripts train.py

demo: setup ## train ResNet-20 on digits under FP32 and every FP16 scaler; print the comparison table
	$(PY) scripts/demo.py

bench: setup ## step-time ratios (emulated FP16 / FP32, scalers / none, telemetry; the tiny GPT; the host-bound step eager and compiled), dispatched ops per step -> results/bench/bench.json, docs/performance.md
	$(PY) scripts/bench.py
	$(PY) scripts/render_docs.py stamp results/bench/bench.json --command "make bench"
	$(PY) scripts/render_docs.py

GPU_PYTHON ?= python3
gpu-check: ## on a CUDA GPU, with that machine's own torch (nothing installed): CUDA tests, FP16/BF16 gradients, adaptive/dynamic step times -> results/gpu/<gpu>.json
	$(GPU_PYTHON) scripts/gpu_check.py

.PHONY: fp8-lab
fp8-lab: setup ## FP8 lab: loss scalers x gradient quantizers, E5M2/E4M3, tiny GPT + ResNet-20, 5 seeds (~25 CPU-min, resumable) -> results/fp8, docs/fp8.md
	OMP_NUM_THREADS=1 $(PY) scripts/fp8_lab.py --docs docs/fp8.md

RUNS ?= results/sweeps
tables: setup ## the paper's tables that have runs, and a summary of every sweep under RUNS (default results/sweeps) -> results/tables
	$(PY) scripts/make_tables.py $(RUNS) --out results/tables

figures: setup ## Figures 1a/1b/4a/4b, and underflow and loss-scale figures of every sweep under RUNS -> results/figures
	$(PY) scripts/make_figures.py $(RUNS) --out results/figures

reproduce-mini: setup ## every experiment in reduced form on bundled data, all tables and figures (3 seeds, ~1 h), then the claims stage (~40 CPU-min more)
	$(PY) scripts/reproduce_mini.py --out results/mini

reproduce-claims: setup ## only the claims stage of reproduce-mini: calibrated SSD, 2 calibrations x 7 methods x 5 seeds -> results/mini/claims (~40 CPU-min)
	$(PY) scripts/reproduce_mini.py --out results/mini --claims-only

docs: setup ## build the documentation site into site/ offline, strict: a stale table, broken link or unresolved API reference fails
	$(PY) scripts/render_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean: ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache site
