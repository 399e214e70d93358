"""One Megatron model of a job with everything that trains, offloads and saves it.

A Cooper run holds two: the policy and the reward model (frozen in ``static_rm`` mode, trained in
``cooper`` mode). Checkpoints, offloading and the steps take these records, never loose tuples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.train.offload import ModelOffloader


@dataclass
class ModelState:
    """A model of this rank (its pipeline stage) and its training state.

    Attributes:
        name: its folder inside a training checkpoint (``policy``, ``rm``).
        module: this rank's stage of the Megatron model (unwrapped).
        arch: the architecture.
        hf_config: the original HF ``config.json`` (written back on export).
        dtype: parameter dtype.
        source_ckpt: the checkpoint it was loaded from (its ``hf_extra/`` tokenizer files are
            copied into every checkpoint of this model).
        tokenizer: the model's HF tokenizer.
        offloader: moves its parameters / gradients / optimizer state off the device and back.
        ddp: megatron DDP wrapper when the model trains, else None.
        optimizer: its megatron optimizer when the model trains, else None.
        scheduler: its learning-rate schedule when the model trains, else None.
    """

    name: str
    module: torch.nn.Module
    arch: ArchSpec
    hf_config: dict[str, Any]
    dtype: torch.dtype
    source_ckpt: str
    tokenizer: Any
    offloader: ModelOffloader
    ddp: Optional[DistributedDataParallel] = None
    optimizer: Optional[MegatronOptimizer] = None
    scheduler: Optional[OptimizerParamScheduler] = None

    @property
    def trains(self) -> bool:
        """Whether the model has an optimizer (and is saved with it in training checkpoints)."""
        return self.optimizer is not None

    @property
    def model(self) -> torch.nn.Module:
        """What the forward passes run: the DDP wrapper when training, else the module."""
        return self.ddp if self.ddp is not None else self.module
