"""The Megatron language-model training step the step benchmarks time (``train_step.py``, ``moe_step.py``).

The trainer's own path: ``wrap_for_training`` (megatron DDP, distributed optimizer, per-token loss)
and ``train_step`` on micro-batches of random token ids, next-token loss over every position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from cooper_mcore.models.forward import position_ids_for
from cooper_mcore.parallel import device
from cooper_mcore.train.moe_aux import AuxLossCounts, is_moe
from cooper_mcore.train.step import OptimConfig, train_step, wrap_for_training


def megatron_lm_step(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[Callable[[], float], list]:
    """One optimizer step over ``batches`` (equal ``[b, s]`` micro-batches) per call; returns the
    step function (it returns the mean loss) and the objects to keep alive (model, DDP, optimizer)."""
    ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-6), per_token_loss=True)
    dev = device()
    mbs, seq = batches[0].shape
    # every token is a loss unit (language-model loss), and every token is routed
    counts: Optional[AuxLossCounts] = None
    if is_moe(ddp):
        counts = AuxLossCounts.of_shapes(sum(b.numel() for b in batches), [tuple(b.shape) for b in batches])

    def forward_step(data_iterator, m):
        ids = next(data_iterator).to(dev)
        labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        per_token = m(ids, position_ids_for(ids), None, labels=labels)

        def loss_fn(loss):
            total = loss.float().sum()
            n = torch.tensor(loss.numel(), device=loss.device)
            return total, n.int(), {"loss": torch.stack([total.detach(), n.float()])}

        return per_token, loss_fn

    def step() -> float:
        result = train_step(ddp, opt, forward_step, iter(batches), len(batches), seq, mbs, aux_counts=counts)
        sums = torch.stack([m["loss"] for m in result.metrics]).sum(0)
        return float(sums[0] / sums[1])

    return step, [model, ddp, opt]
