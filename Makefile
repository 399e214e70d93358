# Two set-up commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv (torch first, pinned to the CPU build where there is no GPU) and installs
# the package with its dev extras.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PIP_CONSTRAINT := $(CURDIR)/constraints-cpu.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

$(STAMP): setup.py constraints-cpu.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip setuptools wheel
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m cooper_mcore demo

test: $(STAMP)
	$(VPY) -m ruff check cooper_mcore tools tests benchmarks
	$(VPY) -m pytest -q tests

lint: $(STAMP)
	$(VPY) -m ruff check cooper_mcore tools tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
