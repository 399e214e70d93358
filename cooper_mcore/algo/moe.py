"""Mixture-of-experts routing math (torch only): the load-balancing loss as megatron-core defines it,
and the factor that gives its gradient the right weight under the per-token loss mode.

megatron's router adds ``coef * E * sum_i f_i P_i`` per sparse layer and micro-batch
(``switch_load_balancing_loss_func``, ``transformer/moe/moe_utils.py``), where ``f_i`` is the share
of the ``T * k`` routing slots that went to expert ``i`` and ``P_i`` the mean router probability
of expert ``i`` over the ``T`` tokens. With ``calculate_per_token_loss`` it back-propagates
``aux * T_mb`` (the micro-batch's routed tokens) and ``finalize_model_grads`` divides every
gradient by the step's loss count (response tokens for GRPO, pairs for the RM, summed over
micro-batches and data-parallel ranks). The aux term's weight then depends on how many tokens the
loss counts: :func:`aux_loss_coeff_scale` undoes that, so the aux gradient is that of the
routed-token-weighted mean of the micro-batches' aux losses, whatever the loss counts.
"""

from __future__ import annotations

import torch


def load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, coef: float) -> torch.Tensor:
    """``coef * E * sum_i f_i * P_i`` of one layer and one micro-batch (megatron's ``aux_loss``).

    Args:
        scores: ``[T, E]`` router probabilities of every token (softmax over all experts).
        routing_map: ``[T, E]`` bool, the ``topk`` experts each token is counted for (the top
            ``topk`` of ``scores``, what megatron's ``compute_routing_scores_for_aux_loss`` gives).
        topk: experts per token.
        coef: the loss coefficient (HF's ``router_aux_loss_coef``).

    Returns:
        The loss, a 0-d float32 tensor.
    """
    assert scores.shape == routing_map.shape and scores.dim() == 2, (scores.shape, routing_map.shape)
    tokens, experts = scores.shape
    f = routing_map.float().sum(0) / (tokens * topk)
    p = scores.float().sum(0) / tokens
    return coef * experts * (f * p).sum()


def aux_loss_coeff_scale(loss_units: float, routed_tokens: float) -> float:
    """The factor on the aux coefficient that makes the aux gradient the routed-token-weighted mean.

    megatron back-propagates ``sum_mb aux_mb * T_mb / loss_units``; times ``loss_units /
    routed_tokens`` that is ``sum_mb T_mb * aux_mb / sum_mb T_mb`` (over the step's micro-batches and
    data-parallel ranks): for equal micro-batches, the mean aux loss, as megatron intends without
    per-token loss (``1 / (num_microbatches * dp)``).

    Args:
        loss_units: what the step's loss is divided by, summed over micro-batches and data-parallel
            ranks (response tokens, pairs, rows).
        routed_tokens: tokens the routers see (padding included), summed the same way.

    Raises:
        ValueError: ``routed_tokens`` is not positive.
    """
    if routed_tokens <= 0:
        raise ValueError(f"routed_tokens must be > 0, got {routed_tokens}")
    return max(float(loss_units), 0.0) / float(routed_tokens)
