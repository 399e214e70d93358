"""Means and standard errors of the demo's verdict (plain floats, no framework).

Every figure of the verdict is a mean over held-out items (problems, benchmark pairs, completions)
from one or more seeds. Two kinds of standard error:

* :func:`paired_mean_se`: per item values aligned across seeds (a per-problem accuracy difference
  between two runs, a benchmark item right after minus right before): averaged over the seeds item
  by item, then the mean over the items and its standard error ``sd / sqrt(n)`` (sample sd). The
  pairing removes what the items share (a problem's difficulty).
* :func:`separation_se`: an RM's separation on labeled completions, the share of the correct ones
  it accepts minus the share of the wrong ones it accepts (TPR - FPR), with the binomial standard
  error ``sqrt(tpr (1 - tpr) / n_correct + fpr (1 - fpr) / n_wrong)``; several seeds' estimates
  are combined by :func:`mean_se` (their mean, ``sqrt(sum se^2) / S``), and a change between two
  independent estimates by :func:`difference_se`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Estimate", "difference_se", "mean_se", "paired_mean_se", "separation_se"]


@dataclass(frozen=True)
class Estimate:
    """A mean and its standard error (NaN where it cannot be estimated)."""

    value: float
    se: float


def paired_mean_se(per_seed: Sequence[Sequence[float]]) -> Estimate:
    """The mean over items of per-item values averaged over seeds, and its standard error.

    Args:
        per_seed: per seed, one value per item (the same items in the same order in every seed).

    Returns:
        ``mean_i (mean_s x[s][i])`` and ``sd_i(...) / sqrt(n)`` (sample sd; NaN for one item, both
        NaN for none).

    Raises:
        ValueError: the seeds hold different numbers of items, or there is no seed.
    """
    if not per_seed:
        raise ValueError("paired_mean_se needs at least one seed")
    n = len(per_seed[0])
    if any(len(s) != n for s in per_seed):
        raise ValueError(f"every seed must hold the same items, got {[len(s) for s in per_seed]} values")
    if n == 0:
        return Estimate(float("nan"), float("nan"))
    items = [sum(s[i] for s in per_seed) / len(per_seed) for i in range(n)]
    mean = sum(items) / n
    if n == 1:
        return Estimate(mean, float("nan"))
    var = sum((x - mean) ** 2 for x in items) / (n - 1)
    return Estimate(mean, math.sqrt(var / n))


def separation_se(correct: Sequence[bool], accepted: Sequence[bool]) -> Estimate:
    """TPR - FPR of a judge's verdicts (``accepted``) on labeled items (``correct``), and its binomial
    standard error; NaN when either label is missing."""
    if len(correct) != len(accepted):
        raise ValueError(f"{len(correct)} labels for {len(accepted)} verdicts")
    pos = [a for c, a in zip(correct, accepted) if c]
    neg = [a for c, a in zip(correct, accepted) if not c]
    if not pos or not neg:
        return Estimate(float("nan"), float("nan"))
    tpr, fpr = sum(pos) / len(pos), sum(neg) / len(neg)
    return Estimate(tpr - fpr, math.sqrt(tpr * (1 - tpr) / len(pos) + fpr * (1 - fpr) / len(neg)))


def mean_se(estimates: Sequence[Estimate]) -> Estimate:
    """The mean of independent estimates (one per seed) and its standard error ``sqrt(sum se^2) / S``."""
    if not estimates:
        raise ValueError("mean_se needs at least one estimate")
    s = len(estimates)
    return Estimate(sum(e.value for e in estimates) / s, math.sqrt(sum(e.se ** 2 for e in estimates)) / s)


def difference_se(after: Estimate, before: Estimate) -> Estimate:
    """``after - before`` of two independent estimates, with ``sqrt(se_a^2 + se_b^2)``."""
    return Estimate(after.value - before.value, math.sqrt(after.se ** 2 + before.se ** 2))
