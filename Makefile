# Two set-up commands on a fresh machine: `make demo` (the main job on its embedded default) and
# `make test` (the whole test suite). Each creates .venv and installs what it needs: torch
# first, pinned to the local CPU build (2.13.0) when there is no NVIDIA GPU, so that no CUDA
# wheels are pulled; the pin also reaches pip's build environments through PIP_CONSTRAINT.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH := torch
else
TORCH := torch==2.13.0
export PIP_CONSTRAINT := $(CURDIR)/constraints-cpu.txt
endif
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
PIP := $(VPY) -m pip install -q --progress-bar off

.PHONY: venv demo test test-fast test-sglang lint bench clean

venv: $(STAMP)

$(STAMP): setup.py constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" || true
	$(PIP) "$(TORCH)" 2>&1 | grep -v "is ignored" || true
	$(PIP) -e ".[dev]" 2>&1 | grep -v "is ignored" || true
	$(VPY) -c "import torch, megatron.core, transformers, cooper_mcore"
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m cooper_mcore demo

test: $(STAMP)
	$(VPY) -m ruff check cooper_mcore tools tests benchmarks
	$(VPY) -m pytest -q -p no:cacheprovider tests

# The real-SGLang tier (tests/sglang, docs/sglang.md): its own venv with sglang 0.5.23 and the
# torch 2.14.1 it pins (~11 GB, a few minutes), kept apart from .venv; its pins replace
# constraints-cpu.txt. SGLang runs there on its CPU backend with a test-only sgl_kernel stand-in.
# As for .venv, pip's output is filtered and the import check below is what fails a bad install.
SGL_VENV := .venv-sglang
SGL_PY := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.installed
SGL_PIP := PIP_CONSTRAINT=$(CURDIR)/tests/sglang/constraints.txt $(SGL_PY) -m pip install -q --progress-bar off

$(SGL_STAMP): setup.py tests/sglang/constraints.txt
	$(PY) -m venv $(SGL_VENV)
	$(SGL_PIP) --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" || true
	$(SGL_PIP) "sglang==0.5.23" 2>&1 | grep -v "is ignored" || true
	$(SGL_PIP) -e ".[dev]" 2>&1 | grep -v "is ignored" || true
	$(SGL_PY) -c "import torch, sglang, megatron.core, transformers, cooper_mcore; assert torch.__version__.startswith('2.14.1'), torch.__version__"
	touch $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	$(SGL_PY) -m pytest -q -p no:cacheprovider -m sglang tests/sglang

test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not multiproc" tests

lint: $(STAMP)
	$(VPY) -m ruff check cooper_mcore tools tests benchmarks

bench: $(STAMP)
	$(VPY) benchmarks/convert.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
