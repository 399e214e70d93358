"""Preference-pair selection for Cooper's reward-model update, on tensors.

Inputs are per-prompt grids ``[P, G]`` (prompts x rollouts):

* rule verdicts, as codes (:data:`CORRECT` 1, :data:`WRONG` 0, anything else, e.g.
  :data:`UNVERIFIABLE` -1 or NaN, is unverifiable) or as a bool tensor (True correct, False wrong);
  :func:`verdict_codes` builds the codes from ``Optional[bool]`` verdicts. Unverifiable rollouts are
  never positives nor negatives.
* the current reward model's scores (logits, or any increasing function of them such as
  ``sigmoid``), needed only by the ``"hardest"`` picks.

Picks, per prompt:

* positives (rule-correct rollouts): ``"first"`` in column order (the reference implementation:
  the first rule-correct rollout), ``"hardest"`` lowest score first, ``"random"`` a random order;
* negatives (the policy's own rule-wrong rollouts): ``"hardest"`` highest score first (the exploit
  the policy is moving towards), ``"random"``, ``"first"`` in column order.

Ties in a score keep column order. With ``k`` pairs per prompt, a prompt gets ``min(k, #wrong)``
pairs with distinct negatives; positives repeat (cycling through the ranked positives) when there
are fewer positives than pairs. Every result has ``k`` slots per prompt; slots without a pair are
masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

__all__ = [
    "CORRECT",
    "NEGATIVE_PICKS",
    "POSITIVE_PICKS",
    "UNVERIFIABLE",
    "WRONG",
    "NegativePick",
    "PairSelection",
    "PositivePick",
    "first_positive_index",
    "gather_by_group",
    "select_negatives",
    "select_pairs",
    "select_positives",
    "verdict_codes",
]

CORRECT = 1
WRONG = 0
UNVERIFIABLE = -1

PositivePick = Literal["first", "hardest", "random"]
NegativePick = Literal["hardest", "random", "first"]
POSITIVE_PICKS: tuple[str, ...] = ("first", "hardest", "random")
NEGATIVE_PICKS: tuple[str, ...] = ("hardest", "random", "first")


@dataclass(frozen=True)
class PairSelection:
    """Which rollouts form each prompt's pairs (``k`` slots per prompt).

    Attributes:
        pos_index: ``[P, k]`` long, the positive's column per slot (0 where the prompt has no positive).
        neg_index: ``[P, k]`` long, the negative's column per slot (0 where the slot has no negative).
        valid: ``[P, k]`` bool, the slot is a pair (a positive and a distinct negative exist).
        has_positive: ``[P]`` bool, the prompt has a rule-correct rollout.
        num_wrong: ``[P]`` long, the prompt's rule-wrong rollouts.
    """

    pos_index: Tensor
    neg_index: Tensor
    valid: Tensor
    has_positive: Tensor
    num_wrong: Tensor


def verdict_codes(verdicts: Sequence[Sequence[Optional[bool]]], width: Optional[int] = None) -> Tensor:
    """Verdict codes ``[P, G]`` (int8) from per-rollout verdicts (True, False or None).

    Rows shorter than the longest (or than ``width``) are padded with :data:`UNVERIFIABLE`, so
    ragged groups never yield a pair from the padding.

    Args:
        verdicts: one row per prompt.
        width: the number of columns (default: the longest row).

    Raises:
        ValueError: a row is longer than ``width``.
    """
    g = max((len(row) for row in verdicts), default=0) if width is None else width
    codes = torch.full((len(verdicts), g), UNVERIFIABLE, dtype=torch.int8)
    for i, row in enumerate(verdicts):
        if len(row) > g:
            raise ValueError(f"verdict row {i} has {len(row)} entries, more than width={g}")
        for j, v in enumerate(row):
            if v is True:
                codes[i, j] = CORRECT
            elif v is False:
                codes[i, j] = WRONG
    return codes


def _correct_and_wrong(verdicts: Tensor) -> tuple[Tensor, Tensor]:
    if verdicts.dim() != 2 or verdicts.shape[1] == 0:
        raise ValueError(f"verdicts must be [num_groups, G] with G > 0, got shape {tuple(verdicts.shape)}")
    if verdicts.dtype == torch.bool:
        return verdicts, ~verdicts
    return verdicts == CORRECT, verdicts == WRONG


def _check_k(k: int) -> None:
    if k < 1:
        raise ValueError(f"pairs per prompt must be >= 1, got {k}")


def _ranked(candidates: Tensor, scores: Optional[Tensor], pick: str, lowest_first: bool, what: str,
            generator: Optional[torch.Generator]) -> tuple[Tensor, Tensor]:
    """Columns ``[P, G]`` ordered candidates first (by ``pick``), and the candidate count ``[P]``.

    ``pick`` is "first" (column order), "hardest" (by score: ascending when ``lowest_first``) or
    "random"; non-candidates sort last. Ties keep column order (stable sort).
    """
    p, g = candidates.shape
    if pick == "first":
        key = torch.zeros(p, g, dtype=torch.float64, device=candidates.device)
    elif pick == "hardest":
        if scores is None:
            raise ValueError(f"{what}_pick='hardest' needs the reward model's scores of the rollouts")
        if tuple(scores.shape) != (p, g):
            raise ValueError(f"scores must have the verdicts' shape {(p, g)}, got {tuple(scores.shape)}")
        s = scores.detach().to(torch.float64)
        if not bool(torch.isfinite(s[candidates]).all()):
            raise ValueError(f"{what}_pick='hardest' needs a finite score for every candidate rollout")
        key = s if lowest_first else -s
    elif pick == "random":
        key = torch.rand(p, g, generator=generator, dtype=torch.float64).to(candidates.device)
    else:
        choices = POSITIVE_PICKS if what == "positive" else NEGATIVE_PICKS
        raise ValueError(f"unknown {what}_pick {pick!r}; expected one of {choices}")
    key = torch.where(candidates, key, torch.full_like(key, float("inf")))
    order = torch.sort(key, dim=1, stable=True).indices
    return order, candidates.sum(dim=1)


def select_positives(verdicts: Tensor, scores: Optional[Tensor] = None, k: int = 1, pick: PositivePick = "first",
                     generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """Up to ``k`` positives per prompt, repeating them (cycling) when there are fewer than ``k``.

    Args:
        verdicts: ``[P, G]`` verdict codes or bool (see the module docstring).
        scores: ``[P, G]`` RM scores; needed for ``pick="hardest"`` (finite for every correct rollout).
        k: slots per prompt.
        pick: "first", "hardest" (lowest score first) or "random".
        generator: source of the "random" order.

    Returns:
        ``(index, has_positive)``: ``index`` ``[P, k]`` long (slot ``j`` holds the ``(j mod n)``-th ranked
        positive of the ``n`` a prompt has; 0 where ``n`` is 0); ``has_positive`` ``[P]`` bool.

    Raises:
        ValueError: bad shapes, ``k < 1``, an unknown pick, or "hardest" without usable scores.
    """
    correct, _ = _correct_and_wrong(verdicts)
    _check_k(k)
    order, count = _ranked(correct, scores, pick, lowest_first=True, what="positive", generator=generator)
    slot = torch.arange(k, device=order.device).expand(order.shape[0], k)
    col = torch.gather(order, 1, slot % count.clamp(min=1)[:, None])
    has_positive = count > 0
    return torch.where(has_positive[:, None], col, torch.zeros_like(col)).long(), has_positive


def select_negatives(verdicts: Tensor, scores: Optional[Tensor] = None, k: int = 1, pick: NegativePick = "hardest",
                     generator: Optional[torch.Generator] = None) -> tuple[Tensor, Tensor]:
    """Up to ``k`` distinct rule-wrong rollouts per prompt.

    Args:
        verdicts: ``[P, G]`` verdict codes or bool.
        scores: ``[P, G]`` RM scores; needed for ``pick="hardest"`` (finite for every wrong rollout).
        k: slots per prompt.
        pick: "hardest" (highest score first), "random" or "first".
        generator: source of the "random" order.

    Returns:
        ``(index, valid)``, both ``[P, k]``: slot ``j`` holds the ``j``-th ranked wrong rollout and is
        valid iff ``j`` < the prompt's number of wrong rollouts (index 0 otherwise).

    Raises:
        ValueError: bad shapes, ``k < 1``, an unknown pick, or "hardest" without usable scores.
    """
    _, wrong = _correct_and_wrong(verdicts)
    _check_k(k)
    order, count = _ranked(wrong, scores, pick, lowest_first=False, what="negative", generator=generator)
    g = order.shape[1]
    if k > g:
        order = torch.cat([order, order.new_zeros(order.shape[0], k - g)], dim=1)
    slot = torch.arange(k, device=order.device).expand(order.shape[0], k)
    valid = slot < count[:, None]
    return torch.where(valid, order[:, :k], torch.zeros_like(order[:, :k])).long(), valid


def select_pairs(verdicts: Tensor, scores: Optional[Tensor] = None, k: int = 1, positive_pick: PositivePick = "first",
                 negative_pick: NegativePick = "hardest",
                 generator: Optional[torch.Generator] = None) -> PairSelection:
    """Pairs from the policy's own rollouts: slot ``j`` pairs the ``j``-th ranked negative with the
    ``(j mod n_pos)``-th ranked positive.

    A prompt gets ``min(k, #wrong)`` valid pairs if it has a positive, none otherwise. With both picks
    "random", the positives' order is drawn from ``generator`` before the negatives'.

    Args:
        verdicts: ``[P, G]`` verdict codes or bool.
        scores: ``[P, G]`` RM scores (for the "hardest" picks).
        k: pairs per prompt (``pairs_per_prompt``), >= 1.
        positive_pick: see :func:`select_positives`.
        negative_pick: see :func:`select_negatives`.
        generator: source of the "random" orders.

    Raises:
        ValueError: as :func:`select_positives` / :func:`select_negatives`.
    """
    pos_index, has_positive = select_positives(verdicts, scores, k, positive_pick, generator)
    neg_index, neg_valid = select_negatives(verdicts, scores, k, negative_pick, generator)
    valid = neg_valid & has_positive[:, None]
    _, wrong = _correct_and_wrong(verdicts)
    return PairSelection(pos_index=pos_index, neg_index=torch.where(valid, neg_index, torch.zeros_like(neg_index)),
                         valid=valid, has_positive=has_positive, num_wrong=wrong.sum(dim=1))


def first_positive_index(rule_correct: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the first correct rollout in each group (the reference implementation's positive).

    The same as ``select_positives(rule_correct, k=1, pick="first")`` with the slot dimension dropped.

    Args:
        rule_correct: ``[num_groups, G]`` bool, or numeric rule scores / verdict codes where exactly ``1``
            means correct.

    Returns:
        ``(index, has_positive)``: ``index`` ``[num_groups]`` long, the first correct column (0 for a
        group without one); ``has_positive`` ``[num_groups]`` bool.

    Raises:
        ValueError: ``rule_correct`` is not 2-D or has groups of size 0.
    """
    index, has_positive = select_positives(rule_correct, k=1, pick="first")
    return index[:, 0], has_positive


def gather_by_group(values: Tensor, index: Tensor) -> Tensor:
    """Pick entries per group: ``values[i, index[i]]`` (or ``values[i, index[i, j]]`` for ``[P, k]`` indices).

    Args:
        values: ``[num_groups, G, ...]`` per-rollout values (e.g. RM scores).
        index: ``[num_groups]`` or ``[num_groups, k]`` long columns (from :func:`first_positive_index`,
            :func:`select_positives`, :func:`select_pairs`).

    Returns:
        ``[num_groups, ...]`` or ``[num_groups, k, ...]``.

    Raises:
        ValueError: shapes do not fit or an index is out of range.
    """
    if values.dim() < 2 or index.dim() not in (1, 2) or index.shape[0] != values.shape[0]:
        raise ValueError(f"need values [num_groups, G, ...] and index [num_groups] or [num_groups, k], got "
                         f"{tuple(values.shape)} and {tuple(index.shape)}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= values.shape[1]):
        raise ValueError(f"index out of range [0, {values.shape[1]})")
    rows = torch.arange(values.shape[0], device=values.device)
    if index.dim() == 2:
        rows = rows[:, None].expand_as(index)
    return values[rows, index.long()]
