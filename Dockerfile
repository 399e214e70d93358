# cooper_mcore for NVIDIA GPUs (H100 and later), single- or multi-node.
#
# NOT BUILT on the project's machines (no Docker, no GPU there): it is linted with hadolint and its
# pins are checked against setup.py by tests/unit/test_dockerfile.py. Build and run (docs/deploy.md):
#   docker build -t cooper_mcore:0.1.0 .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it \
#       -v /models:/models -v /data:/data -e OPENAI_API_KEY -e WANDB_API_KEY cooper_mcore:0.1.0 cooper --help
# No secret is baked in: API keys are passed at run time with `-e NAME` (the value is read from
# the caller's environment, so it appears neither in the image nor on the command line).
#
# Why a virtual environment on the NGC image: sglang 0.5.23 pins torch==2.14.1 (a CUDA 13 build on
# PyPI), which is not the NGC image's own torch build, and the image's Transformer Engine and apex are
# compiled against its own torch. Replacing torch inside the image's site-packages would leave those
# (and torchvision, torch-tensorrt, flash-attn, ...) ABI-broken. So the NGC image supplies the CUDA 13
# toolkit (nvcc, headers), cuDNN, the InfiniBand/RDMA user libraries and the Python 3.12 interpreter,
# and everything Python lives in /opt/venv, built against torch==2.14.1: Transformer Engine's torch
# extension and apex's C++/CUDA extensions are compiled here, from pinned sources.
#
# The NGC entrypoint is kept (no ENTRYPOINT here): it sets up CUDA forward compatibility, without
# which CUDA 13 does not initialise on data-center drivers older than R580 (R580+ needs nothing).
FROM nvcr.io/nvidia/pytorch:25.09-py3

# Pins (tests/unit/test_dockerfile.py checks them against setup.py). TE_VERSION stays inside
# megatron-core 0.16's tested range (its `dev` extra: transformer-engine>=2.9,<2.12).
ARG PYTHON_VERSION=3.12
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.2
ARG TORCHAUDIO_VERSION=2.11.0
ARG TE_VERSION=2.11.0
ARG MCORE_VERSION=0.16.1
ARG SGLANG_VERSION=0.5.23
ARG APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
ARG VIRTUALENV_VERSION=21.15.7
ARG SETUPTOOLS_VERSION=84.2.1
ARG WHEEL_VERSION=0.48.0
ARG NINJA_VERSION=1.13.2
ARG PYBIND11_VERSION=3.1.0
ARG PACKAGING_VERSION=26.3
# GPU architectures the extensions are compiled for: 9.0 = H100/H200 (add 10.0 for B200).
ARG CUDA_ARCHS=9.0
ARG MAX_JOBS=16
ARG USER_UID=1000

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The NGC image points pip at a constraints file that pins its own torch; the venv uses ours.
# LD_LIBRARY_PATH: the NGC value without its own torch's lib folders (.../dist-packages/torch/lib,
# torch_tensorrt/lib), which the loader searched before the venv torch's RUNPATH, so `import torch`
# could load the image's libtorch_python.so; the CUDA forward-compatibility and driver folders stay.
# CUDNN_PATH/NVRTC_PATH/CURAND_PATH: Transformer Engine looks for these libraries under them first
# (then under /usr/local/cuda): pointed at the venv's nvidia wheels, the same ones torch loads.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_CONSTRAINT=/opt/constraints-gpu.txt \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    LD_LIBRARY_PATH=/usr/local/cuda/compat/lib:/usr/local/nvidia/lib:/usr/local/nvidia/lib64 \
    CUDNN_PATH=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia \
    NVRTC_PATH=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia \
    CURAND_PATH=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia \
    HF_HUB_DISABLE_TELEMETRY=1

# 1. the interpreter the pins assume, a glibc the sglang wheel's manylinux_2_34 tag accepts, a clean venv,
# and the constraints every later pip call obeys
RUN python3 -c "import platform, sys; v = '.'.join(map(str, sys.version_info[:2])); \
assert v == '${PYTHON_VERSION}', f'base image has Python {v}, the pins assume ${PYTHON_VERSION}'; \
libc = tuple(map(int, platform.libc_ver()[1].split('.'))); assert libc >= (2, 34), libc" \
 && printf '%s\n' "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
        "torchaudio==${TORCHAUDIO_VERSION}" "transformer-engine==${TE_VERSION}" \
        "transformer-engine-cu13==${TE_VERSION}" "transformer-engine-torch==${TE_VERSION}" \
        "megatron-core==${MCORE_VERSION}" "sglang==${SGLANG_VERSION}" > /opt/constraints-gpu.txt \
 && PIP_CONSTRAINT="" python3 -m pip install "virtualenv==${VIRTUALENV_VERSION}" \
 && python3 -m virtualenv --python python3 /opt/venv \
 && pip install "setuptools==${SETUPTOOLS_VERSION}" "wheel==${WHEEL_VERSION}" "ninja==${NINJA_VERSION}" \
        "pybind11==${PYBIND11_VERSION}" "packaging==${PACKAGING_VERSION}"

# 2. torch (PyPI's CUDA 13 build, the one sglang 0.5.23 requires), loaded from the venv and nowhere else
RUN pip install "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
        "torchaudio==${TORCHAUDIO_VERSION}" \
 && python -c "import torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; \
assert torch.version.cuda and torch.version.cuda.startswith('13'), torch.version.cuda; \
libs = {l.split()[-1] for l in open('/proc/self/maps') if 'libtorch' in l or 'libc10' in l}; \
assert libs and all(p.startswith('/opt/venv/') for p in libs), libs" \
 && test -n "$(find "${CUDNN_PATH}" -name 'libcudnn.so.*' -print -quit)"

# 3. Transformer Engine: the CUDA 13 core wheel and its torch extension compiled against this torch
RUN NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="$(echo "${CUDA_ARCHS}" | tr -d .)" MAX_JOBS="${MAX_JOBS}" \
    pip install --no-build-isolation "transformer-engine[pytorch,core_cu13]==${TE_VERSION}"

# 4. apex from source at a pinned commit (fetched by that commit, then checked), with its C++ and CUDA
# extensions (fused Adam, fused norms); the contrib extensions and their cudnn-frontend submodule are not built
WORKDIR /tmp/apex
RUN git init -q . \
 && git remote add origin https://github.com/NVIDIA/apex.git \
 && git fetch -q --depth 1 origin "${APEX_COMMIT}" \
 && git checkout -q FETCH_HEAD \
 && test "$(git rev-parse HEAD)" = "${APEX_COMMIT}" \
 && APEX_CPP_EXT=1 APEX_CUDA_EXT=1 APEX_PARALLEL_BUILD="${MAX_JOBS}" TORCH_CUDA_ARCH_LIST="${CUDA_ARCHS}" \
    pip install -v --no-build-isolation . \
 && python -c "import apex, apex_C, amp_C" \
 && rm -rf /tmp/apex

# 5. megatron-core, sglang (setup.py's `gpu` extra) and cooper_mcore with the rest of its dependencies.
# `.[gpu]` is pinned through PIP_CONSTRAINT (torch, TE, megatron-core, sglang), which hadolint cannot see.
# sglang and its kernels from their published wheels only (sglang 0.5.23: cp312 manylinux_2_34_x86_64).
# The check imports Transformer Engine's torch module (a broken TE build fails here) with a stub
# libcuda.so.1 (there is no driver during a build) and checks it loaded the venv's cuDNN; `cooper config` of a
# shipped preset, from outside this folder, checks the installed package (not the source tree) reads its presets.
WORKDIR /opt/cooper_mcore
COPY setup.py README.md ./
COPY cooper_mcore ./cooper_mcore
# the presets and model configs are package data of the wheel (cooper_mcore.presets)
COPY examples ./examples
# hadolint ignore=DL3013
RUN pip install "megatron-core==${MCORE_VERSION}" \
 && pip install --only-binary=sglang,sglang-kernel ".[gpu]" \
 && mkdir -p /tmp/cuda-stub && ln -s /usr/local/cuda/lib64/stubs/libcuda.so /tmp/cuda-stub/libcuda.so.1 \
 && LD_LIBRARY_PATH="/tmp/cuda-stub:${LD_LIBRARY_PATH}" python -c "import torch, megatron.core, sglang, apex, cooper_mcore; \
import transformer_engine.pytorch; \
from importlib.metadata import version as v; \
assert v('transformer-engine') == '${TE_VERSION}', v('transformer-engine'); \
assert v('megatron-core') == '${MCORE_VERSION}' and v('sglang') == '${SGLANG_VERSION}'; \
assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__; \
cudnn = {l.split()[-1] for l in open('/proc/self/maps') if 'libcudnn.so' in l}; \
assert cudnn and all(p.startswith('/opt/venv/') for p in cudnn), cudnn" \
 && LD_LIBRARY_PATH="/tmp/cuda-stub:${LD_LIBRARY_PATH}" env -C /tmp cooper config --config tiny_cpu > /dev/null \
 && rm -rf /tmp/cuda-stub \
 && cooper --help > /dev/null

# Scripts (not needed by the installed package, handy inside the container)
COPY tools ./tools
COPY benchmarks ./benchmarks

# A non-root user (Ubuntu 24.04 images already have `ubuntu` at uid 1000: it is replaced). Any other
# uid (`docker run --user $(id -u):$(id -g)`, enroot/pyxis) has no home: HOME and every cache (Hugging
# Face, Triton and FlashInfer JIT kernels, torch inductor) are in /workspace, and /workspace and the
# relative run folder runs/ are writable by everyone (sticky, like /tmp).
RUN if id -u ubuntu > /dev/null 2>&1; then userdel --remove ubuntu; fi \
 && useradd --create-home --uid "${USER_UID}" --shell /bin/bash cooper \
 && mkdir -p /workspace/.cache/huggingface /workspace/.cache/triton /workspace/.cache/torchinductor \
        /opt/cooper_mcore/runs \
 && chown -R "${USER_UID}:${USER_UID}" /workspace /opt/cooper_mcore/runs \
 && chmod -R 1777 /workspace /opt/cooper_mcore/runs
USER ${USER_UID}
# the scripts, presets and tools (examples/, tools/, benchmarks/) are here, as the docs' commands expect
WORKDIR /opt/cooper_mcore
ENV HOME=/workspace \
    XDG_CACHE_HOME=/workspace/.cache \
    HF_HOME=/workspace/.cache/huggingface \
    TRITON_CACHE_DIR=/workspace/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/workspace/.cache/torchinductor \
    FLASHINFER_WORKSPACE_BASE=/workspace

CMD ["cooper", "--help"]
