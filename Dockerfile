# cooper_mcore on GPUs: a first version (completed by the scale-and-deploy work).
# The NGC PyTorch image brings CUDA, torch, Transformer Engine and apex built for it.
# Not built on the project's CPU-only machines; build and run with:
#   docker build -t cooper_mcore .
#   docker run --gpus all --ipc=host --rm -it -v /data:/data cooper_mcore cooper --help
FROM nvcr.io/nvidia/pytorch:25.09-py3

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/cooper_mcore
COPY setup.py README.md constraints-cpu.txt ./
COPY cooper_mcore ./cooper_mcore
COPY tools ./tools
COPY examples ./examples
# Keep the image's torch/TE/apex: install the package without letting pip replace torch.
RUN python -m pip install --no-cache-dir "megatron-core==0.16.1" \
 && python -m pip install --no-cache-dir -e . \
 && python -c "import torch, megatron.core, cooper_mcore; print(torch.__version__)"

RUN useradd --create-home --uid 1000 cooper
USER cooper
ENTRYPOINT []
CMD ["cooper", "--help"]
