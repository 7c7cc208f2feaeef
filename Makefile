# cs336-systems: the README's commands. `make test` and `make pdf` work on a fresh CPU-only clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
## Where pip finds torch. Empty: pip's configured index. On Linux plain PyPI serves the CUDA build of
## torch (several GB of nvidia-* wheels; the tests still run on the CPU); for the CPU-only build set
## TORCH_INDEX=https://download.pytorch.org/whl/cpu where that index is reachable.
TORCH_INDEX ?=
# JupyterLab defaults of this project (jupyter/lab-overrides.json5 says which and why), installed into
# the environment, never into the home directory. A rule of its own, so that an existing .venv gets
# them (or a changed version) without reinstalling the packages.
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.d/cs336-systems.json5

.PHONY: test test-distributed test-gpu lint format env clean notebooks pdf texdeps browserdeps lab wheelhouse gpu-notebooks

env: $(STAMP) $(LAB_SETTINGS)

$(STAMP): pyproject.toml .ci/constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c .ci/constraints-cpu.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(PY) -m pip install -q -c .ci/constraints-cpu.txt -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

$(LAB_SETTINGS): jupyter/lab-overrides.json5 | $(STAMP)
	install -D -m 644 $< $@

# apt-get install for the Debian packages a target needs, announced first by the caller (sudo unless root).
APT_INSTALL = SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -q && \
	$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends

## The whole CPU suite: model, harness, FlashAttention under the Triton interpreter, gloo
## multi-process distributed tests, every notebook in quick mode, and JupyterLab in a headless
## browser (tests/test_lab.py; installs Debian's chromium first when no Chromium is found).
test: $(STAMP) $(LAB_SETTINGS) browserdeps
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=25

## The multi-process tests (gloo, torchrun) REPEAT times in a row: a flaky rendezvous or an
## occasional hang fails here (each test has its own timeout) instead of once in a while in `make test`.
REPEAT ?= 5
test-distributed: $(STAMP)
	@for i in $$(seq $(REPEAT)); do echo "== distributed tests, round $$i of $(REPEAT)"; \
		$(PY) -m pytest -q -n 2 --dist loadgroup -m distributed -p no:cacheprovider || exit 1; done

## On a GPU host (system python with torch+triton): the GPU-marked tests.
test-gpu:
	$(PYTHON) -m pytest -q -m "gpu or multigpu" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check cs336_systems tests notebooks
	$(VENV)/bin/ruff format --check cs336_systems tests notebooks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix cs336_systems tests notebooks
	$(VENV)/bin/ruff format cs336_systems tests notebooks

## ---- Notebooks and the writeup (cs336_systems/report/) ----
## make notebooks [NB=<name substring>] [QUICK=1] [PARAMS='-p name value -y "key: [1, 2]"'] [NB_TIMEOUT=s]
##   jupytext .py -> .ipynb -> papermill -> build/executed/; runs past failures, lists them, exits 1 if any.
## PYTHON_NB: the interpreter with the notebook stack (.venv on CPU machines; python3 on the GPU host).
PYTHON_NB ?= $(PY)
NB ?=
QUICK ?=
PARAMS ?=
NB_TIMEOUT ?= 3600
NB_DEPS := $(if $(filter $(PY),$(PYTHON_NB)),$(STAMP))
TEX_PACKAGES := texlive-xetex texlive-fonts-recommended texlive-plain-generic pandoc fonts-dejavu-core

notebooks: $(NB_DEPS)
	$(PYTHON_NB) -m cs336_systems.report.run_notebooks --select '$(NB)' --timeout $(NB_TIMEOUT) \
		$(if $(filter 1 true yes True,$(QUICK)),--quick) -- $(PARAMS)

## writeup.pdf: re-execute the notebooks whose inputs changed (never in quick mode), merge them with
## writeup.md and typeset with xelatex. Installs the Debian TeX packages first when they are missing.
pdf: $(NB_DEPS) texdeps
	$(PYTHON_NB) -m cs336_systems.report.run_notebooks --stale-only --timeout $(NB_TIMEOUT)
	$(PYTHON_NB) -m cs336_systems.report.assemble --pdf writeup.pdf

## The PDF needs xelatex, pandoc and the DejaVu fonts (README, "System packages"). When one is missing
## this says so and installs the Debian packages with apt-get (sudo unless root), before anything else.
texdeps:
	@if command -v xelatex >/dev/null && command -v pandoc >/dev/null \
		&& command -v fc-list >/dev/null && fc-list | grep -q 'DejaVu Serif'; then exit 0; fi; \
	echo "make pdf typesets writeup.pdf with nbconvert -> pandoc -> xelatex, and xelatex, pandoc or the"; \
	echo "DejaVu fonts are missing. Installing these Debian packages with apt-get (about 580 MB installed):"; \
	echo "  $(TEX_PACKAGES)"; \
	command -v apt-get >/dev/null || { echo "no apt-get here: install the equivalents of those packages yourself"; exit 1; }; \
	$(APT_INSTALL) $(TEX_PACKAGES)

## The browser of tests/test_lab.py: CHROMIUM=<path>, chromium or google-chrome on PATH, else Debian's chromium.
browserdeps:
	@for b in "$$CHROMIUM" chromium chromium-browser google-chrome; do \
		[ -n "$$b" ] && command -v "$$b" >/dev/null && exit 0; done; \
	command -v apt-get >/dev/null || { echo "tests/test_lab.py needs Chromium or Chrome:" \
		"install one, or set CHROMIUM=/path/to/it"; exit 1; }; \
	echo "installing Chromium for the JupyterLab browser test: chromium"; \
	$(APT_INSTALL) chromium

## make lab [LAB_ARGS='--port 9000 --no-browser ...']: JupyterLab on notebooks/. A click opens a
## problem's .py as a notebook (LAB_SETTINGS); saving writes the .py (the source) and a git-ignored
## paired .ipynb that keeps the outputs (notebooks/jupytext.toml). Ctrl-C stops the server and its
## kernels at once (-y answers Jupyter's "Shut down this server?" prompt); --allow-root only as root.
LAB_ARGS ?=
lab: $(STAMP) $(LAB_SETTINGS)
	@echo "JupyterLab on notebooks/: open the http://.../lab?token=... URL printed below; Ctrl-C stops it."
	$(VENV)/bin/jupyter lab -y --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

## On a connected machine: the wheels of the notebook stack for the offline GPU host (Python 3.12).
wheelhouse:
	rm -rf .whl
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform any -d .whl papermill ipykernel nbformat nbclient jupytext nvtx
	@du -sh .whl

## On the offline GPU host (system python3 with torch/triton; .whl/ copied along):
##   make gpu-notebooks [NB=...] [GPU_OUT=dir]   -> GPU_OUT/results.tar.gz with new figures and data.
GPU_OUT ?= build/gpu-out
gpu-notebooks:
	@test -n "$$(ls .whl/*.whl 2>/dev/null)" || { echo "no .whl/: run 'make wheelhouse' on a connected machine"; exit 2; }
	mkdir -p $(GPU_OUT) build
	touch build/.gpu-notebooks-start
	test .site/.installed -nt .whl || { python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl \
		&& touch .site/.installed; }
	export PYTHONPATH=$$PWD/.site:$$PWD PATH=$$PWD/.site/bin:$$PATH; \
	python3 -m ipykernel install --user --name python3 >/dev/null && \
	$(MAKE) --no-print-directory notebooks PYTHON_NB=python3 NB='$(NB)' PARAMS='$(PARAMS)' \
		NB_TIMEOUT=$(NB_TIMEOUT); status=$$?; \
	find figures build/executed -type f -newer build/.gpu-notebooks-start > $(GPU_OUT)/new-files.txt; \
	tar czf $(GPU_OUT)/results.tar.gz -T $(GPU_OUT)/new-files.txt; \
	echo "$$(wc -l < $(GPU_OUT)/new-files.txt) new files -> $(GPU_OUT)/results.tar.gz"; \
	exit $$status

clean:
	rm -rf build .pytest_cache .ruff_cache
