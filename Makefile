# cs336-systems: the README's commands. `make test` and `make pdf` work on a fresh CPU-only clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test test-gpu lint format env clean

env: $(STAMP)

$(STAMP): pyproject.toml .ci/constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/constraints-cpu.txt torch==2.13.0
	$(PY) -m pip install -q -c .ci/constraints-cpu.txt -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

## The whole CPU suite: model, harness, FlashAttention under the Triton interpreter, gloo
## multi-process distributed tests, and every notebook in quick mode.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

## On a GPU host (system python with torch+triton): the GPU-marked tests.
test-gpu:
	$(PYTHON) -m pytest -q -m "gpu or multigpu" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check cs336_systems tests notebooks
	$(VENV)/bin/ruff format --check cs336_systems tests notebooks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix cs336_systems tests notebooks
	$(VENV)/bin/ruff format cs336_systems tests notebooks

clean:
	rm -rf build .pytest_cache .ruff_cache
