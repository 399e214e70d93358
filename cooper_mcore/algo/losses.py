"""Per-token losses of a Cooper step: the PPO clipped policy surrogate, the KL penalty to the frozen
reference policy, masked aggregation, entropy, and the reward-model losses (Cooper's pairwise loss and
the VerifyRM binary cross-entropy), with the optional calibration anchor of the pairwise loss.

Conventions: token tensors are ``[b, t]`` (sequences x positions) with a response mask of the same
shape (bool or 0/1 numbers; nonzero = response token). Per-token losses are 0 wherever the mask is 0,
even when the inputs there are inf or NaN. Stats are detached scalars.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "PAIR_LOSS_EPS",
    "aggregate",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "PolicyLossStats",
    "rm_bce_loss",
    "rm_pair_losses",
    "rm_pairwise_loss",
]

#: log-ratios are clamped to this range before ``exp`` (as verl does), so that a stale or padded
#: position cannot overflow to inf.
LOG_RATIO_CLAMP = 20.0
#: the low-variance (k3) KL estimate is clamped to ``[-KL_CLAMP, KL_CLAMP]``.
KL_CLAMP = 10.0
KL_ESTIMATORS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
AGGREGATION_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum")
#: the pairwise loss is ``sum over valid pairs / (number of valid pairs + PAIR_LOSS_EPS)`` (the reference's).
PAIR_LOSS_EPS = 1e-6
BCE_REDUCTIONS = ("mean", "sum", "none")


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shapes must match, got {shapes}")


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    """Max (or min) of ``x`` where ``mask`` is True; 0 when nothing is masked in."""
    if x.numel() == 0:
        return x.new_zeros(())
    fill = x.new_full((), float("-inf") if largest else float("inf"))
    picked = torch.where(mask, x, fill)
    value = picked.max() if largest else picked.min()
    return torch.where(mask.any(), value, x.new_zeros(()))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over the positions where ``mask`` is nonzero (masked-out NaN/inf are ignored).

    Args:
        x: ``[...]`` values.
        mask: same shape as ``x``; bool or 0/1 numbers.
        dim: sum over this dimension only; all of them when None.

    Returns:
        A scalar, or ``x`` reduced over ``dim``.

    Raises:
        ValueError: ``x`` and ``mask`` differ in shape.
    """
    _check_same_shape(x=x, mask=mask)
    kept = torch.where(mask.bool(), x, x.new_zeros(()))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is nonzero; 0 where there are none.

    Args:
        x: ``[...]`` values.
        mask: same shape as ``x``; bool or 0/1 numbers.
        dim: average over this dimension only; all of them when None.

    Returns:
        A scalar, or ``x`` reduced over ``dim``.

    Raises:
        ValueError: ``x`` and ``mask`` differ in shape.
    """
    total = masked_sum(x, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def aggregate(loss: Tensor, mask: Tensor, mode: str = "token-mean") -> Tensor:
    """Reduce a per-token loss to a scalar.

    Modes:
        ``token-mean``: sum over response tokens / number of response tokens (0 if there are none).
        ``token-sum``: sum over response tokens (the trainer divides by a global token count itself).
        ``seq-mean-token-mean``: each sequence's token mean, averaged over the sequences that have at
        least one response token.
        ``seq-mean-token-sum``: each sequence's token sum, averaged over those sequences.

    Args:
        loss: ``[b, t]`` per-token loss.
        mask: ``[b, t]`` response mask.
        mode: one of ``AGGREGATION_MODES``.

    Returns:
        A scalar.

    Raises:
        ValueError: unknown ``mode``, shapes differ, or a ``seq-*`` mode gets a tensor that is not 2-D.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGGREGATION_MODES}")
    _check_same_shape(loss=loss, mask=mask)
    if mode == "token-mean":
        return masked_mean(loss, mask)
    if mode == "token-sum":
        return masked_sum(loss, mask)
    if loss.dim() != 2:
        raise ValueError(f"{mode} needs [b, t] tensors, got shape {tuple(loss.shape)}")
    per_seq = masked_mean(loss, mask, dim=-1) if mode == "seq-mean-token-mean" else masked_sum(loss, mask, dim=-1)
    has_tokens = mask.bool().any(dim=-1)
    return masked_mean(per_seq, has_tokens)


@dataclass(frozen=True, eq=False)
class PolicyLossStats(Mapping[str, Tensor]):
    """The detached statistics of :func:`policy_loss`: per token, and (as a mapping) their means.

    The per-token tensors let a caller that splits a batch into micro-batches sum them over each
    micro-batch's response tokens and divide by the tokens of them all (a token mean over the
    whole batch); the mapping holds this call's means over its own response tokens.

    Attributes:
        ratio: ``[b, t]`` importance ratio ``exp(logp - old_logp)``, the log-ratio clamped as the
            loss clamps it; 1 outside the mask.
        clipped: ``[b, t]`` bool: the tokens whose loss is clipped, so that they get no gradient (the
            PPO clip or the dual clip); False outside the mask.
        means: the scalar statistics by name (documented at :func:`policy_loss`), read through the
            mapping: ``stats["clip_frac"]``.
    """

    ratio: Tensor
    clipped: Tensor
    means: dict[str, Tensor]

    def __getitem__(self, key: str) -> Tensor:
        return self.means[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.means)

    def __len__(self) -> int:
        return len(self.means)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """PPO clipped surrogate per token, with optional clip-higher (DAPO) and dual-clip.

    ``ratio = exp(logp - old_logp)``; ``loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``.
    With ``clip_ratio_c`` (> 1) the loss of tokens with ``A < 0`` is further capped at ``-A * clip_ratio_c``
    (dual-clip). The log-ratio is clamped to ``[-20, 20]`` before ``exp``.

    Args:
        logp: ``[b, t]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logp: ``[b, t]`` log-probs under the policy that sampled them.
        advantages: ``[b, t]`` per-token advantages, or ``[b]`` per-sequence (broadcast over tokens).
        mask: ``[b, t]`` response mask.
        clip_low: ``eps_low``; the ratio's lower bound is ``1 - clip_low``.
        clip_high: ``eps_high``; the upper bound is ``1 + clip_high`` (``> clip_low`` for clip-higher).
        clip_ratio_c: dual-clip constant (verl uses 3.0); None turns dual-clip off.

    Returns:
        ``(loss, stats)``: ``loss`` is ``[b, t]``, 0 where ``mask`` is 0. ``stats`` (a
        :class:`PolicyLossStats`): the per-token ``ratio`` and ``clipped``, and as a mapping their means
        over the response tokens (detached scalars): ``clip_frac`` (tokens whose loss is clipped, so that they get no
        gradient: the PPO clip is active, its clipped term strictly larger, or the dual clip caps them),
        made of the disjoint ``clip_frac_low`` / ``clip_frac_high`` (PPO clip, ratio below / above the
        range) and ``dual_clip_frac`` (``A < 0`` and ratio above ``clip_ratio_c``); ``ratio_mean``,
        ``ratio_max``, ``ratio_min`` (max/min are 0 with no response tokens), ``approx_kl`` (mean of
        ``old_logp - logp``).

    Raises:
        ValueError: shapes do not fit, or clip values out of range.
    """
    advantages = _checked_policy_inputs(logp, old_logp, advantages, mask, clip_low, clip_high, clip_ratio_c)
    m = mask.bool()
    zero = logp.new_zeros(())
    # Padding is zeroed before any arithmetic, so that NaN/inf there cannot reach the loss or the gradient.
    adv = torch.where(m, advantages.to(logp.dtype), zero)
    log_ratio = torch.where(m, logp - old_logp, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped

    dual_active = torch.zeros_like(m)
    if clip_ratio_c is not None:
        cap = -adv * clip_ratio_c
        dual_active = (adv < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)

    loss = torch.where(m, loss, zero)

    return loss, _policy_loss_stats(ratio, log_ratio, m, clip_active, dual_active, clip_low, clip_high)


def _checked_policy_inputs(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                           clip_high: float, clip_ratio_c: float | None) -> Tensor:
    """Check :func:`policy_loss`'s shapes and clip values; return the advantages as ``[b, t]``."""
    _check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    if advantages.dim() == 1 and logp.dim() == 2 and advantages.shape[0] == logp.shape[0]:
        advantages = advantages[:, None].expand_as(logp)
    _check_same_shape(logp=logp, advantages=advantages)
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None), got {clip_ratio_c}")
    return advantages


@torch.no_grad()
def _policy_loss_stats(ratio: Tensor, log_ratio: Tensor, m: Tensor, clip_active: Tensor, dual_active: Tensor,
                       clip_low: float, clip_high: float) -> PolicyLossStats:
    """:func:`policy_loss`'s statistics over the response tokens ``m`` (detached)."""
    r = ratio.detach().float()
    fm = m.float()
    cut = (clip_active | dual_active) & m
    means = {
        "clip_frac": masked_mean(cut.float(), fm),
        "clip_frac_low": masked_mean((clip_active & (r < 1.0 - clip_low)).float(), fm),
        "clip_frac_high": masked_mean((clip_active & (r > 1.0 + clip_high)).float(), fm),
        "dual_clip_frac": masked_mean(dual_active.float(), fm),
        "ratio_mean": masked_mean(r, fm),
        "ratio_max": _masked_extreme(r, m, largest=True),
        "ratio_min": _masked_extreme(r, m, largest=False),
        "approx_kl": masked_mean(-log_ratio.detach().float(), fm),
    }
    return PolicyLossStats(ratio=r, clipped=cut, means=means)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    With ``d = logp - ref_logp``:
        ``k1`` (alias ``kl``): ``d``.
        ``k2`` (alias ``mse``): ``0.5 * d**2``.
        ``k3`` (alias ``low_var_kl``): ``exp(-d) + d - 1``, with ``-d`` clamped to ``[-20, 20]`` and the
        result clamped to ``[-10, 10]``; non-negative.
        ``abs``: ``|d|``.

    Args:
        logp: ``[...]`` log-probs under the policy (with grad).
        ref_logp: same shape, under the frozen reference model.
        kind: one of ``KL_ESTIMATORS``.

    Returns:
        Per-token KL, same shape as ``logp``.

    Raises:
        ValueError: unknown ``kind`` or mismatched shapes.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_ESTIMATORS}")
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    d = logp - ref_logp
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind == "abs":
        return d.abs()
    log_r = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-KL_CLAMP, KL_CLAMP)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last (vocabulary) dimension, computed stably in float32.

    ``H = -sum(p * log p)`` with ``log p = z - logsumexp(z)`` (no cancellation between two large numbers, so
    large logits keep full precision); ``-inf`` logits (masked vocabulary entries) contribute 0.
    Half-precision inputs are upcast to float32 (a float32 copy of the logits is made).

    Args:
        logits: ``[..., V]`` unnormalized logits.

    Returns:
        ``[...]`` float32 (float64 for float64 input) entropies in nats.

    Raises:
        ValueError: ``logits`` is 0-dimensional or has an empty last dimension.
    """
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V > 0, got shape {tuple(logits.shape)}")
    z = logits if logits.dtype == torch.float64 else logits.float()
    log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(log_p)
    return -(p * log_p.masked_fill(torch.isneginf(z), 0.0)).sum(dim=-1)


def rm_pair_losses(
    s_pos: Tensor, s_neg: Tensor, valid: Tensor, anchor_weight: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair reward-model loss: Cooper's Bradley-Terry term plus an optional calibration anchor.

    ``loss_i = -logsigmoid(s_pos_i - s_neg_i) + anchor_weight * (BCE(s_pos_i, 1) + BCE(s_neg_i, 0)) / 2``
    with ``BCE(s, 1) = -logsigmoid(s)`` and ``BCE(s, 0) = -logsigmoid(-s)``. The pairwise term is
    invariant to a shift of all scores, so on its own it lets the scores drift (the ranking improves
    while ``sigmoid(s) > 0.5`` stops meaning "correct"); the anchor is the mean BCE of the pair's two
    rows against their own labels (chosen 1, rejected 0) and pins the scores to the 0.5 threshold.
    ``anchor_weight=0`` is the paper's loss.

    Invalid pairs give exactly 0 with zero gradient (their scores are replaced before any arithmetic,
    so NaN there cannot leak). The trainer sums this over the valid pairs of all micro-batches and
    ranks and divides by their number (:func:`rm_pairwise_loss` does that for one batch).

    Args:
        s_pos: ``[n]`` raw RM logits of the chosen responses.
        s_neg: ``[n]`` raw RM logits of the rejected responses.
        valid: ``[n]`` bool (or 0/1) pair mask.
        anchor_weight: weight of the BCE anchor, >= 0.

    Returns:
        ``(loss, stats)``: ``loss`` ``[n]``; ``stats`` (detached sums over valid pairs, so that they add up
        over micro-batches): ``num_valid``, ``pairwise_sum`` (the Bradley-Terry terms), ``anchor_sum`` (the
        unweighted anchor terms, computed whatever the weight), ``correct_sum`` (pairs with
        ``s_pos > s_neg``), ``threshold_correct_sum`` (rows on the right side of 0: ``s_pos > 0`` and
        ``s_neg <= 0``, counted per row, 2 per pair at most), ``chosen_sum``, ``rejected_sum``.

    Raises:
        ValueError: the three are not 1-D of one length, or ``anchor_weight < 0``.
    """
    _check_same_shape(s_pos=s_pos, s_neg=s_neg, valid=valid)
    if s_pos.dim() != 1:
        raise ValueError(f"s_pos, s_neg and valid must be 1-D [n], got shape {tuple(s_pos.shape)}")
    if not anchor_weight >= 0.0:
        raise ValueError(f"anchor_weight must be >= 0, got {anchor_weight}")
    v = valid.bool()
    zero = s_pos.new_zeros(())
    pos = torch.where(v, s_pos, zero)
    neg = torch.where(v, s_neg, zero)
    pairwise = -F.logsigmoid(pos - neg)
    anchor = 0.5 * (-F.logsigmoid(pos) - F.logsigmoid(-neg))
    loss = pairwise + anchor_weight * anchor if anchor_weight else pairwise
    loss = torch.where(v, loss, zero)
    with torch.no_grad():
        fv = v.to(pairwise.dtype)
        stats = {
            "num_valid": fv.sum(),
            "pairwise_sum": (pairwise.detach() * fv).sum(),
            "anchor_sum": (anchor.detach() * fv).sum(),
            "correct_sum": ((pos > neg).to(fv.dtype) * fv).sum(),
            "threshold_correct_sum": (((pos > 0).to(fv.dtype) + (neg <= 0).to(fv.dtype)) * fv).sum(),
            "chosen_sum": (pos.detach() * fv).sum(),
            "rejected_sum": (neg.detach() * fv).sum(),
        }
    return loss, stats


def rm_pairwise_loss(
    s_pos: Tensor, s_neg: Tensor, valid: Tensor, anchor_weight: float = 0.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Cooper's reward-model loss averaged over valid pairs, with the optional calibration anchor.

    ``loss = sum_valid(rm_pair_losses(...)) / (num_valid + 1e-6)`` (:data:`PAIR_LOSS_EPS`, the reference's
    denominator); with ``anchor_weight=0`` that is ``sum_valid(-logsigmoid(s_pos - s_neg)) / (num_valid +
    1e-6)``. With no valid pair the loss is exactly 0 with zero gradient (invalid pairs never contribute,
    even if their scores are NaN).

    Args:
        s_pos: ``[n]`` raw RM logits of the positive (chosen) responses.
        s_neg: ``[n]`` raw RM logits of the negative (rejected) responses.
        valid: ``[n]`` bool (or 0/1) pair mask.
        anchor_weight: weight of the BCE anchor (see :func:`rm_pair_losses`); 0 is the paper's loss.

    Returns:
        ``(loss, stats)``: scalar loss; ``stats`` (over valid pairs; 0 with none): ``pair_acc`` (fraction
        with ``s_pos > s_neg``), ``num_valid``, ``margin_mean`` (mean ``s_pos - s_neg``), ``pairwise`` and
        ``anchor`` (means of the two terms, the anchor unweighted), ``threshold_acc`` (fraction of the
        ``2 * num_valid`` rows classified right by ``logit > 0``), ``mean_chosen``, ``mean_rejected``.

    Raises:
        ValueError: the three are not 1-D of one length, or ``anchor_weight < 0``.
    """
    loss, sums = rm_pair_losses(s_pos, s_neg, valid, anchor_weight)
    n = sums["num_valid"]
    total = loss.sum() / (n.to(loss.dtype) + PAIR_LOSS_EPS)
    with torch.no_grad():
        d = n.clamp(min=1.0)
        stats = {
            "pair_acc": (sums["correct_sum"] / d).float(),
            "num_valid": n.float(),
            "margin_mean": ((sums["chosen_sum"] - sums["rejected_sum"]) / d).float(),
            "pairwise": (sums["pairwise_sum"] / d).float(),
            "anchor": (sums["anchor_sum"] / d).float(),
            "threshold_acc": (sums["threshold_correct_sum"] / (2 * d)).float(),
            "mean_chosen": (sums["chosen_sum"] / d).float(),
            "mean_rejected": (sums["rejected_sum"] / d).float(),
        }
    return total, stats


def rm_bce_loss(logits: Tensor, labels: Tensor, reduction: str = "mean") -> tuple[Tensor, dict[str, Tensor]]:
    """VerifyRM loss: binary cross-entropy with logits against 0/1 correctness labels.

    Args:
        logits: ``[n]`` (any shape) raw RM logits.
        labels: same shape, 0/1 labels (bool, int or float; soft labels are accepted by the loss).
        reduction: "mean" (default; 0 with grad for an empty batch), "sum" (for micro-batches whose sums
            the trainer divides by a global count) or "none" (per-row, same shape as ``logits``).

    Returns:
        ``(loss, stats)``: the loss reduced as asked; ``stats``: ``acc`` (fraction with
        ``(sigmoid(logit) > 0.5) == (label >= 0.5)``, i.e. logit > 0 predicts 1), ``pos_frac`` (fraction of
        labels that are 1); both 0 for an empty batch.

    Raises:
        ValueError: ``logits`` and ``labels`` differ in shape, or an unknown ``reduction``.
    """
    _check_same_shape(logits=logits, labels=labels)
    if reduction not in BCE_REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {BCE_REDUCTIONS}")
    if logits.numel() == 0:
        zero = logits.sum() * 0.0
        loss = logits * 0.0 if reduction == "none" else zero
        return loss, {"acc": zero.detach().float(), "pos_frac": zero.detach().float()}
    target = labels.to(logits.dtype)
    loss = F.binary_cross_entropy_with_logits(logits, target, reduction=reduction)
    with torch.no_grad():
        pos = labels.float() >= 0.5
        stats = {
            "acc": ((logits.detach() > 0) == pos).float().mean(),
            "pos_frac": pos.float().mean(),
        }
    return loss, stats
