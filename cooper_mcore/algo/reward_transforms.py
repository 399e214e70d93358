"""The policy's reward from the reward model's logits, with the reference's precision and the
paper's discrete ablation as options.

Transforms (:data:`REWARD_TRANSFORMS`):

* ``"sigmoid"``: ``sigmoid(logit)`` in float32 (float64 kept), continuous in ``(0, 1)``.
* ``"sigmoid_bf16"``: the reference implementation's reward. Its reward model runs in bf16, so the
  logit is a bf16 number and the sigmoid is computed on it and rounded to bf16: rewards in
  ``[0.5, 1)`` lie on a ``2**-8`` grid (``[0.25, 0.5)`` on ``2**-9``, ...), and anything above
  ``1 - 2**-9`` rounds to exactly 1.0. Near-certain groups therefore tie (zero GRPO advantage)
  instead of turning differences of 1e-4 into full-size advantages.
* ``"binary"``: the paper's discrete-reward ablation, ``sigmoid(logit)`` thresholded at 0.5:
  1.0 where ``logit >= 0``, else 0.0.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["REWARD_TRANSFORMS", "RewardTransform", "reward_from_logits", "round_to_bf16"]

RewardTransform = Literal["sigmoid", "sigmoid_bf16", "binary"]
REWARD_TRANSFORMS: tuple[str, ...] = ("sigmoid", "sigmoid_bf16", "binary")


def round_to_bf16(x: Tensor) -> Tensor:
    """``x`` rounded to the nearest bfloat16 value (ties to even), in float32 (float64 kept)."""
    out_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(torch.bfloat16).to(out_dtype)


def reward_from_logits(logits: Tensor, transform: RewardTransform = "sigmoid") -> Tensor:
    """Policy reward from the reward model's raw logits.

    Args:
        logits: ``[...]`` raw RM logits (any float dtype).
        transform: "sigmoid" (default), "sigmoid_bf16" or "binary" (see the module docstring).

    Returns:
        ``[...]`` rewards, float32 (float64 for float64 logits).

    Raises:
        ValueError: unknown ``transform``.
    """
    z = logits if logits.dtype == torch.float64 else logits.float()
    if transform == "sigmoid":
        return torch.sigmoid(z)
    if transform == "sigmoid_bf16":
        # the sigmoid of the bf16 logit, computed in float32 and rounded once to bf16, as a bf16 kernel
        # (which computes in float32 internally) does; independent of the CPU/GPU kernel used
        return round_to_bf16(torch.sigmoid(round_to_bf16(z).float())).to(z.dtype)
    if transform == "binary":
        return (z >= 0).to(z.dtype)
    raise ValueError(f"unknown reward transform {transform!r}; expected one of {REWARD_TRANSFORMS}")
