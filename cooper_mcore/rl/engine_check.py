"""The rollout engine checked against the trainer every step.

The engine returns the log-probability of each token it sampled (temperature 1, as the trainer
computes them); the trainer computes the same tokens' ``old_logp`` before its update. Rounding
(bf16 kernels, another reduction order) keeps them apart by a little; an engine that does not hold
the policy's weights (a weight push that failed or mapped a tensor wrongly, or an engine started
from another model) puts them far apart. Every step reports the difference over the world
(``rollout/logprob_diff_*``, ``rollout/logprob_kl``), and the first step a process runs stops the
run when the mean difference is above ``algo.logprob_diff_guard``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from cooper_mcore.algo import logprob_mismatch_sums
from cooper_mcore.algo.mismatch import MISMATCH_SUMS
from cooper_mcore.collectives import all_reduce
from cooper_mcore.config.schema import AlgoConfig
from cooper_mcore.rl.results import EngineAgreement
from cooper_mcore.train.tokens import TokenBatch

logger = logging.getLogger(__name__)


class EngineMismatch(ValueError):
    """The engine's log-probabilities are too far from the trainer's: its weights are not the policy's."""


def engine_agreement(batch: TokenBatch, tis_cap: Optional[float]) -> Optional[EngineAgreement]:
    """The engine against the trainer on ``batch`` (``old_logp`` filled), over the world.

    Collective over the world (every rank calls it, with or without the engine's log-probabilities):
    the sums of :func:`~cooper_mcore.algo.logprob_mismatch_sums` are added over the ranks (ranks of
    one model-parallel group hold the same rollouts, so each rollout counts the same number of
    times in numerator and denominator) and the largest difference is the world's.

    Returns:
        The agreement, or None when a rank's engine gave no log-probabilities (or no rank has a
        response token).
    """
    assert batch.old_logp is not None, "the trainer's log-probabilities come first"
    sums = torch.zeros(len(MISMATCH_SUMS) + 1, dtype=torch.float64)  # + ranks without engine log-probs
    top = torch.zeros(1, dtype=torch.float64)
    if batch.engine_logp is None:
        sums[-1] = 1.0
    else:
        parts, top[0] = logprob_mismatch_sums(batch.engine_logp, batch.old_logp, batch.loss_mask, tis_cap)
        sums[:-1] = torch.stack([parts[k] for k in MISMATCH_SUMS])
    sums = all_reduce(sums).cpu()
    top = all_reduce(top, dist.ReduceOp.MAX).cpu()
    total = dict(zip(MISMATCH_SUMS, sums[:-1].tolist()))
    if sums[-1] > 0 or total["tokens"] == 0:
        return None
    n = total["tokens"]
    return EngineAgreement(
        diff_mean=total["abs_diff_sum"] / n, diff_max=float(top[0]), kl=total["kl_sum"] / n,
        tis_weight_mean=total["tis_weight_sum"] / n if tis_cap is not None else None,
        tis_capped_frac=total["tis_capped"] / n if tis_cap is not None else None)


def check_engine(agreement: Optional[EngineAgreement], algo: AlgoConfig, step: int, first: bool) -> None:
    """Stop when TIS is asked for without the engine's log-probabilities, or, on the first step this
    process runs, when the mean difference is above ``algo.logprob_diff_guard`` (None: no check).
    Every rank gets the same agreement, so every rank decides the same.

    Raises:
        EngineMismatch: the first step's mean difference is above the guard.
        ValueError: ``algo.tis_cap`` is set and the engine gave no log-probabilities.
    """
    if agreement is None:
        if algo.tis_cap is not None:
            raise ValueError("algo.tis_cap needs the rollout engine's per-token log-probabilities, and the engine "
                             "returned none")
        if first:
            logger.warning("step %d: the rollout engine returned no log-probabilities: it is not checked against "
                           "the trainer", step)
        return
    guard = algo.logprob_diff_guard
    if first and guard is not None and agreement.diff_mean > guard:
        raise EngineMismatch(
            f"step {step}: the rollout engine's log-probabilities differ from the trainer's by "
            f"{agreement.diff_mean:#.3g} nats per response token (max {agreement.diff_max:#.3g}; "
            f"algo.logprob_diff_guard={guard}): the engine's weights are not the policy's (a weight push that "
            "failed or mapped a tensor wrongly, or model.policy_hf is not the model model.policy_ckpt holds)")
