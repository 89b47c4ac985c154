# cce: `make demo` (the main job), `make test` (CPU suite), `make test-gpu`, `make bench`, `make lint`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
# The CPU build of torch, installed first on machines without an NVIDIA GPU (a bare `torch`
# requirement would pull several GB of CUDA packages). Override with CPU_TORCH=... if needed.
CPU_TORCH ?= torch==2.13.0
# On a GPU host (torch preinstalled), run the GPU suite with that interpreter: make test-gpu GPU_PY=python3
GPU_PY ?= python3
PYTEST_ARGS ?=

.PHONY: install test test-gpu lint format demo demo-gpu bench bench-cpu clean

$(PYTHON):
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(PYTHON)
	$(PYTHON) -m pip install -q --upgrade pip
	@if ! $(PYTHON) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) -m pip install -q torch; \
	  else $(PYTHON) -m pip install -q "$(CPU_TORCH)"; fi; \
	fi
	$(PYTHON) -m pip install -q -e ".[test,hf,bench]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PYTHON) -m pytest -q -m "not gpu" $(PYTEST_ARGS) tests

test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -m gpu $(PYTEST_ARGS) tests

lint: install
	$(BIN)/ruff format --check cce tests bench examples
	$(BIN)/ruff check cce tests bench examples

format: install
	$(BIN)/ruff format cce tests bench examples
	$(BIN)/ruff check --fix cce tests bench examples

demo: install
	$(PYTHON) -m examples.demo

# On a GPU host with torch preinstalled: larger model, V = 131072, bf16.
demo-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m examples.demo --device cuda

bench:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench

bench-cpu: install
	$(PYTHON) bench/cpu_compare.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
