"""Preference-pair selection for Cooper's reward-model update, on tensors.

Per prompt, the positive is the first rollout the rule verifier scored 1; a prompt with none gives a
masked pair.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["first_positive_index", "gather_by_group"]


def first_positive_index(rule_correct: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the first correct rollout in each group.

    Args:
        rule_correct: ``[num_groups, G]`` bool, or numeric rule scores where exactly ``1`` means correct.

    Returns:
        ``(index, has_positive)``: ``index`` ``[num_groups]`` long, the first correct column (0 for a
        group without one); ``has_positive`` ``[num_groups]`` bool.

    Raises:
        ValueError: ``rule_correct`` is not 2-D or has groups of size 0.
    """
    if rule_correct.dim() != 2 or rule_correct.shape[1] == 0:
        raise ValueError(f"rule_correct must be [num_groups, G] with G > 0, got shape {tuple(rule_correct.shape)}")
    correct = rule_correct if rule_correct.dtype == torch.bool else rule_correct == 1
    g = correct.shape[1]
    cols = torch.arange(g, device=correct.device).expand_as(correct)
    first = torch.where(correct, cols, torch.full_like(cols, g)).min(dim=1).values
    has_positive = correct.any(dim=1)
    index = torch.where(has_positive, first, torch.zeros_like(first))
    return index.long(), has_positive


def gather_by_group(values: Tensor, index: Tensor) -> Tensor:
    """Pick one entry per group: ``values[i, index[i]]``.

    Args:
        values: ``[num_groups, G, ...]`` per-rollout values (e.g. RM scores).
        index: ``[num_groups]`` long column per group (e.g. from ``first_positive_index``).

    Returns:
        ``[num_groups, ...]``.

    Raises:
        ValueError: shapes do not fit or an index is out of range.
    """
    if values.dim() < 2 or index.dim() != 1 or index.shape[0] != values.shape[0]:
        raise ValueError(f"need values [num_groups, G, ...] and index [num_groups], got "
                         f"{tuple(values.shape)} and {tuple(index.shape)}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= values.shape[1]):
        raise ValueError(f"index out of range [0, {values.shape[1]})")
    return values[torch.arange(values.shape[0], device=values.device), index.long()]
