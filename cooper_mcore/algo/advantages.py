"""GRPO advantages: each prompt's group of rollout rewards normalized to zero mean and unit std.

An optional floor on the group's std (``std_floor``) keeps tiny reward differences inside a group
(e.g. a continuous RM reward of 0.9990 vs 0.9995) from becoming full-size advantages: a group whose
std is below the floor is divided by the floor instead, so its advantages shrink in proportion.

The scalar advantage of a rollout applies to every one of its response tokens; ``broadcast_to_tokens``
spreads it over a ``[b, t]`` token grid.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["group_advantages", "broadcast_to_tokens"]


def group_advantages(rewards: Tensor, eps: float = 1e-6, unbiased: bool = True, std_floor: float = 0.0) -> Tensor:
    """GRPO group-normalized advantages, ``(r - mean) / (max(std, std_floor) + eps)`` within each group.

    A group of size 1 and a group whose rewards are all equal get advantage 0 exactly (no NaN, and
    no float round-off divided by ``eps``).

    Args:
        rewards: ``[num_groups, G]`` rewards, one row per prompt, one column per rollout.
        eps: added to the std before dividing.
        unbiased: Bessel-corrected std (divide by ``G - 1``) when True, population std (divide by ``G``)
            when False.
        std_floor: minimum of the std used as the divisor; 0 (default) is plain GRPO, as the paper.

    Returns:
        ``[num_groups, G]`` float advantages (float32 unless ``rewards`` is float64).

    Raises:
        ValueError: ``rewards`` is not 2-D or has no columns, or ``eps`` or ``std_floor`` is negative.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] == 0:
        raise ValueError("rewards has groups of size 0")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not std_floor >= 0:
        raise ValueError(f"std_floor must be >= 0, got {std_floor}")
    r = rewards.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)
    if r.shape[1] == 1:
        return torch.zeros_like(r)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=unbiased).clamp(min=std_floor)
    adv = (r - mean) / (std + eps)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(adv), adv)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give each response token its sequence's scalar advantage.

    Args:
        advantages: ``[b]`` per-sequence advantages.
        mask: ``[b, t]`` response-token mask (nonzero = response token).

    Returns:
        ``[b, t]`` advantages, 0 where ``mask`` is 0.

    Raises:
        ValueError: the shapes do not fit.
    """
    if advantages.dim() != 1 or mask.dim() != 2 or advantages.shape[0] != mask.shape[0]:
        raise ValueError(f"need advantages [b] and mask [b, t], got {tuple(advantages.shape)} and {tuple(mask.shape)}")
    return torch.where(mask.bool(), advantages[:, None].expand(mask.shape), advantages.new_zeros(()))
