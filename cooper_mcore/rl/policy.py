"""The GRPO update of the policy: the clipped surrogate (optionally weighted by truncated importance
sampling against the rollout engine), the KL to the frozen reference and the entropy bonus, as a
token mean over the whole mini-batch.

The per-token terms are the pure functions of :mod:`cooper_mcore.algo` (``policy_loss``,
``kl_penalty``). The update uses megatron-core's per-token loss mode: each micro-batch returns
the *sum* of its masked token losses and its token count, and megatron divides the gradients by
the total count over all micro-batches and data-parallel ranks. The loss is therefore the token
mean over the whole mini-batch (the paper's ``token-mean`` aggregation), and splitting it into
1x8 or 8x1 micro-batches gives the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer

from cooper_mcore.algo import kl_penalty, masked_sum, policy_loss, truncated_is_weights
from cooper_mcore.algo.vocab import DEFAULT_CHUNK_TOKENS
from cooper_mcore.collectives import broadcast_from_last_stage
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.models.forward import sequence_multiple
from cooper_mcore.rl.results import GRPOUpdate
from cooper_mcore.train.moe_aux import AuxLossCounts
from cooper_mcore.train.step import train_step
from cooper_mcore.train.tokens import TokenBatch, token_logprobs_and_entropy

#: the per-token terms summed over the micro-batches, as the fields of :class:`GRPOUpdate` (``loss``
#: is also what :func:`~cooper_mcore.train.step.train_step` checks for finiteness)
TERMS = ("loss", "kl", "ratio_mean", "clip_frac", "entropy")


@dataclass
class GRPOLoss:
    """The loss settings of one update.

    Attributes:
        clip_low / clip_high: the ratio's clip range ``[1 - clip_low, 1 + clip_high]``.
        clip_ratio_c: dual clip: the loss of a token with a negative advantage is capped at
            ``-A * clip_ratio_c`` (verl's and the reference implementation's 3.0), so that a token
            the policy has made much likelier since sampling (a later mini-batch's) cannot set the
            update's direction; None turns it off.
        kl_coef: weight of the per-token KL to the reference (0: no KL term).
        kl_kind: KL estimator (:func:`cooper_mcore.algo.kl_penalty`).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        tis_cap: truncated importance sampling: each token's policy loss (the clipped surrogate, not
            the KL or entropy terms, as verl and slime) is weighted by
            ``min(exp(old_logp - engine_logp), tis_cap)``; None: off.
        chunk_tokens: positions per chunk when the log-probabilities and the entropy are read from
            the logits (:func:`cooper_mcore.algo.chunked_logprobs_entropy`).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    entropy_coef: float = 0.0
    tis_cap: Optional[float] = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS


def grpo_token_loss(logits: torch.Tensor, mb: TokenBatch,
                    loss: GRPOLoss) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO loss ``[b, s]`` of one micro-batch (0 outside the response) and the detached
    per-token :data:`TERMS` for the metrics.

    The log-probabilities and the entropy come from one chunked pass over the logits (no fp32 copy
    of the whole micro-batch's logits); the entropy is differentiable only with an entropy bonus,
    otherwise a metric without autograd state. ``ratio_mean`` and ``clip_frac`` are
    ``policy_loss``'s own per-token statistics (:class:`~cooper_mcore.algo.PolicyLossStats`): its
    ratio, and its clipped tokens, which get no policy gradient (the PPO clip or the dual clip).
    """
    logp, ent = token_logprobs_and_entropy(logits, mb.labels, "grad" if loss.entropy_coef else "metric",
                                           loss.chunk_tokens)
    tok, stats = policy_loss(logp, mb.old_logp, mb.advantages, mb.loss_mask,
                             clip_low=loss.clip_low, clip_high=loss.clip_high, clip_ratio_c=loss.clip_ratio_c)
    if loss.tis_cap is not None:
        assert mb.engine_logp is not None, "truncated importance sampling needs the engine's log-probabilities"
        tok = tok * truncated_is_weights(mb.old_logp, mb.engine_logp, mb.loss_mask, loss.tis_cap)
    kl = kl_penalty(logp, mb.ref_logp, loss.kl_kind) if loss.kl_coef else torch.zeros_like(logp)
    total = tok + loss.kl_coef * kl
    if loss.entropy_coef:
        total = total - loss.entropy_coef * ent
    with torch.no_grad():
        terms = {"loss": total.detach(), "kl": kl.detach(), "ratio_mean": stats.ratio,
                 "clip_frac": stats.clipped.float(), "entropy": ent.detach()}
    return total, terms


def policy_update(ddp: DistributedDataParallel, optimizer: MegatronOptimizer, batch: TokenBatch,
                  batching: MicroBatching, loss: GRPOLoss) -> GRPOUpdate:
    """One optimizer step of GRPO on ``batch`` (token-mean loss over the whole batch), in the
    micro-batches ``batching`` makes (fixed, by a token budget, or packed).

    Requires ``calculate_per_token_loss`` (``wrap_for_training(..., per_token_loss=True)``).

    Returns:
        The update's means over this rank's response tokens, its gradient norm, the routers'
        load-balancing loss (mixture-of-experts policies), and whether it was skipped because the
        loss or the gradient norm was not finite (``nonfinite``; ``grad_norm`` is then NaN;
        see :func:`~cooper_mcore.train.step.guarded_step`).

    Raises:
        ValueError: ``kl_coef > 0`` without reference log-probabilities, or ``tis_cap`` without the
            engine's.
    """
    if loss.kl_coef and batch.ref_logp is None:
        raise ValueError("kl_coef > 0 needs reference log-probabilities")
    if loss.tis_cap is not None and batch.engine_logp is None:
        raise ValueError("algo.tis_cap needs the rollout engine's per-token log-probabilities")
    assert ddp.config.calculate_per_token_loss, "wrap the policy with per-token loss"
    assert batch.advantages is not None and batch.old_logp is not None

    def step(data_iterator, model):
        mb = next(data_iterator)
        logits = mb.micro.forward(model)

        def loss_fn(output):
            total, terms = grpo_token_loss(output, mb, loss)
            n = mb.loss_mask.sum()
            sums = {k: masked_sum(v, mb.loss_mask).detach() for k, v in terms.items()}
            sums["tokens"] = n.detach()
            return masked_sum(total, mb.loss_mask), n.int(), sums

        return logits, loss_fn

    mbs = batch.micro_batches(batching, sequence_multiple(ddp), parallel_state.get_data_parallel_group())
    shapes = [mb.micro.shape for mb in mbs]
    counts = AuxLossCounts(float(sum(mb.loss_mask.sum() for mb in mbs)), sum(mb.micro.num_tokens for mb in mbs))
    result = train_step(ddp, optimizer, step, iter(mbs), len(mbs), max(s for _, s in shapes),
                        max(b for b, _ in shapes), variable_shapes=len(set(shapes)) > 1, aux_counts=counts)
    values = torch.zeros(len(TERMS), dtype=torch.float64)
    if result.metrics:  # the last pipeline stage
        tokens = float(sum(r["tokens"] for r in result.metrics))
        values = torch.tensor([float(sum(r[k] for r in result.metrics)) / max(tokens, 1.0) for k in TERMS],
                              dtype=torch.float64)
    values = broadcast_from_last_stage(values)  # every stage reports the same metrics
    means = {k: float(v) for k, v in zip(TERMS, values.tolist())}
    return GRPOUpdate(**means, grad_norm=result.grad_norm, nonfinite=not result.updated,
                      moe_aux_loss=result.moe_aux_loss)
