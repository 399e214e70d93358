"""The rollout engine's log-probabilities against the trainer's: how far apart they are, and the
truncated importance-sampling weights that correct the policy loss for the difference.

The engine samples the rollouts with its own kernels (bf16, another attention, another reduction
order), so its per-token log-probabilities differ from the trainer's ``old_logp`` for the same
weights by rounding; much larger differences mean the engine does not hold the policy's weights.
Truncated importance sampling (TIS, as in verl and slime) weights each token's policy loss by
``min(pi_old_trainer / pi_engine, cap)``, so that the update is the one for the distribution the
tokens were actually sampled from, with the ratio capped to bound the variance.

Conventions as :mod:`cooper_mcore.algo.losses`: ``[b, t]`` tensors with a response mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cooper_mcore.algo.losses import LOG_RATIO_CLAMP, _check_same_shape, _masked_extreme, kl_penalty

__all__ = ["MISMATCH_SUMS", "logprob_mismatch_sums", "truncated_is_weights"]

#: the keys of :func:`logprob_mismatch_sums`, in a fixed order (one all-reduce of them all)
MISMATCH_SUMS = ("tokens", "abs_diff_sum", "kl_sum", "tis_weight_sum", "tis_capped")


def truncated_is_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Per-token truncated importance-sampling weights ``min(exp(old_logp - engine_logp), cap)``.

    The log-ratio is clamped to ``[-20, 20]`` before ``exp`` (as the policy loss clamps its own).
    The weights are constants of the loss: no gradient flows through them.

    Args:
        old_logp: ``[b, t]`` the trainer's log-probabilities of the sampled tokens before the update.
        engine_logp: ``[b, t]`` the rollout engine's log-probabilities of the same tokens.
        mask: ``[b, t]`` response mask.
        cap: the truncation ``C`` (> 0).

    Returns:
        ``[b, t]`` weights, 1 outside the mask.

    Raises:
        ValueError: shapes differ, or ``cap <= 0``.
    """
    _check_same_shape(old_logp=old_logp, engine_logp=engine_logp, mask=mask)
    if not cap > 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    m = mask.bool()
    with torch.no_grad():
        log_ratio = torch.where(m, old_logp - engine_logp, old_logp.new_zeros(()))
        weights = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
        return torch.where(m, weights, weights.new_ones(()))


def logprob_mismatch_sums(engine_logp: Tensor, trainer_logp: Tensor, mask: Tensor,
                          tis_cap: float | None = None) -> tuple[dict[str, Tensor], Tensor]:
    """Sums over the response tokens that compare the engine's log-probabilities with the trainer's.

    Sums (not means) so that a caller adds them over micro-batches and ranks and divides once:

    * ``tokens``: response tokens;
    * ``abs_diff_sum``: ``sum |engine - trainer|``;
    * ``kl_sum``: the k3 estimate of KL(engine || trainer) from the engine's samples,
      ``r - 1 - log r`` with ``r = exp(trainer - engine)`` (clamped as :func:`kl_penalty`'s
      ``low_var_kl``; non-negative, 0 when they agree);
    * ``tis_weight_sum``: sum of the :func:`truncated_is_weights` with ``tis_cap`` (0 without);
    * ``tis_capped``: tokens whose weight the cap truncated (0 without ``tis_cap``).

    Args:
        engine_logp: ``[b, t]`` the engine's log-probabilities of the sampled tokens.
        trainer_logp: ``[b, t]`` the trainer's (before the update).
        mask: ``[b, t]`` response mask.
        tis_cap: the TIS cap, or None.

    Returns:
        ``(sums, max_abs_diff)``: the float64 sums by :data:`MISMATCH_SUMS` name, and the largest
        ``|engine - trainer|`` over the response tokens (0 without any), for a max-reduction.

    Raises:
        ValueError: shapes differ.
    """
    _check_same_shape(engine_logp=engine_logp, trainer_logp=trainer_logp, mask=mask)
    m = mask.bool()
    zero = trainer_logp.new_zeros(())
    with torch.no_grad():
        e = torch.where(m, engine_logp.float(), zero)
        t = torch.where(m, trainer_logp.float(), zero)
        diff = (e - t).abs()
        sums = {"tokens": m.sum(), "abs_diff_sum": diff.sum(),
                "kl_sum": torch.where(m, kl_penalty(e, t, "low_var_kl"), zero).sum(),
                "tis_weight_sum": zero, "tis_capped": zero}
        if tis_cap is not None:
            ratio = torch.exp((t - e).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            sums["tis_weight_sum"] = torch.where(m, truncated_is_weights(t, e, m, tis_cap), zero).sum()
            sums["tis_capped"] = (m & (ratio > tis_cap)).sum()
        return {k: sums[k].double() for k in MISMATCH_SUMS}, _masked_extreme(diff, m, largest=True).double()
