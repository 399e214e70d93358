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
# pip compiles every module at install (keep it: where PYTHONDONTWRITEBYTECODE is set, as on this
# project's machines, Python would otherwise compile each imported module again in every process; with
# --no-compile the unit tier took 618 s instead of 477).
PIP := $(VPY) -m pip install -q --progress-bar off

.PHONY: venv demo test test-fast test-isa sglang-venv test-sglang gpu-check gpu-wheels lint bench clean

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

# The core tiers one after another (tests/tiers.py: unit, badinput, multiproc, packaging, rehearsal, gpu), each a
# pytest run with its own options (two workers where tests are independent), then a table of tests and
# seconds per tier; every tier runs even after a failure. One tier: `.venv/bin/python tests/tiers.py unit`.
test: $(STAMP)
	$(VPY) -m ruff check cooper_mcore tools tests benchmarks
	OMP_NUM_THREADS=1 $(VPY) tests/tiers.py

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

sglang-venv: $(SGL_STAMP)

test-sglang: $(SGL_STAMP)
	$(SGL_PY) tests/tiers.py sglang

# The GPU checks (tools/gpu_check.py): on a GPU machine without network, with the image's python
# (torch + transformers) and the wheels of GPU_WHEELS (made by `make gpu-wheels` where there is a
# network) installed offline first. Within 8 minutes (--budget-s 480: a lent GPU has 15 minutes, start-up
# included), in this order, each in its time slice: tests/gpu (240 s), the MoE step with grouped experts
# at Qwen3-30B-A3B's layer shape (150 s), the Cooper-step benchmark (both settings; the rest), then the
# train-step benchmark only where its whole 120 s slice is left. Writes runs/gpu_check/report.md after
# every step; exits 1 without a GPU, when a step fails or gets no time, and when the bf16 engine-trainer
# log-prob mismatch of the Cooper step is above 0.1 nats mean or 0.01 KL, or was not measured.
GPU_WHEELS ?= wheels/gpu
GPU_PKGS := megatron-core==0.16.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 omegaconf==2.4.0
GPU_PYVER ?= 3.12

gpu-check:
	@if [ -d "$(GPU_WHEELS)" ]; then $(PY) -m pip install -q --no-index --no-deps --find-links $(GPU_WHEELS) $(GPU_PKGS); fi
	$(PY) tools/gpu_check.py --out runs/gpu_check

gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYVER) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d $(GPU_WHEELS) $(GPU_PKGS)

# The numerics-sensitive tests (losses, gradients, updates against references; TP/PP/DP and packed
# runs against one process) under each ATen CPU kernel set this CPU can run: default and avx2, and
# avx512 where /proc/cpuinfo reports avx512f (torch dies with "Illegal instruction" otherwise).
# CI and users run other x86 CPUs than the developers': a tolerance must hold on all three.
ISA_TESTS := tests/unit/test_algo.py tests/unit/test_policy_update.py tests/unit/test_vocab_logprobs.py tests/unit/test_reward_model.py \
	tests/unit/test_micro_batching_runner.py tests/unit/test_micro_batching_packing.py tests/unit/test_pairs.py \
	tests/unit/test_nonfinite.py tests/multiproc/test_parallel.py tests/multiproc/test_trainer.py \
	tests/multiproc/test_micro_batching_packing.py tests/multiproc/test_rm_dist.py \
	tests/unit/test_moe_model.py tests/unit/test_moe_aux_loss.py tests/multiproc/test_moe_ep.py \
	tests/unit/test_moe_grouped.py tests/unit/test_routing_replay.py tests/multiproc/test_moe_layouts.py
ISA_LEVELS ?= default avx2 $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo avx512)

test-isa: $(STAMP)
	@for isa in $(ISA_LEVELS); do echo "== ATEN_CPU_CAPABILITY=$$isa"; \
		ATEN_CPU_CAPABILITY=$$isa $(VPY) -m pytest -q -p no:cacheprovider $(ISA_TESTS) || exit 1; done

test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not multiproc" tests

lint: $(STAMP)
	$(VPY) -m ruff check cooper_mcore tools tests benchmarks

bench: $(STAMP)
	$(VPY) benchmarks/convert.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
