# cce: `make demo` (the main job), `make test` (CPU suite, minutes), `make test-all` (the thorough tier),
# `make test-gpu` / `make test-gpu-all`, `make bench`, `make lint`.
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
# pytest-xdist workers: `auto` = one per CPU core (the CPU suite), 4 processes sharing one GPU.
TEST_WORKERS ?= auto
GPU_WORKERS ?= 4
# The GPU host's python may lack pytest-xdist: then the GPU suite runs in one process.
GPU_XDIST = $(shell $(GPU_PY) -c "import xdist" 2>/dev/null && echo "-n $(GPU_WORKERS) --dist loadgroup")

.PHONY: install test test-all test-gpu test-gpu-all lint format demo demo-gpu bench bench-cpu clean

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

# The default tier: every public option, error path, Triton kernel (in the interpreter) and
# integration at the smallest shapes that exercise them; hypothesis derandomized, few examples.
# Test files are the unit of work of the xdist workers (--dist loadfile): the gloo groups of
# tests/distributed run once per file's worker. (--dist loadgroup's xdist_group marks do not
# group tests under pytest 9.2 with pytest-xdist 3.8: every worker that reached a group's tests
# then waited for the group on another.)
test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu and not slow" $(PYTEST_ARGS) tests

# The thorough tier: the default tier plus the `slow` tests, hypothesis randomized with the full
# example counts. Run it before a kernel change lands. (--dist loadfile, as above.)
test-all: install
	CCE_TEST_TIER=all $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu" $(PYTEST_ARGS) tests

test-gpu:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -q $(GPU_XDIST) -m "gpu and not slow" $(PYTEST_ARGS) tests

test-gpu-all:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} CCE_TEST_TIER=all $(GPU_PY) -m pytest -q $(GPU_XDIST) -m gpu $(PYTEST_ARGS) tests

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
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m examples.demo --device cuda

bench:
	@$(GPU_PY) -c "import torch; raise SystemExit(not torch.cuda.is_available())" 2>/dev/null || { \
	  echo "make bench needs a CUDA GPU and a python with torch ($(GPU_PY)); none here."; \
	  echo "On the CPU: make bench-cpu (impl='torch' against PyTorch's chunked linear cross entropy)."; \
	  exit 1; }
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m bench $(BENCH_ARGS)

bench-cpu: install
	$(PYTHON) bench/cpu_compare.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
