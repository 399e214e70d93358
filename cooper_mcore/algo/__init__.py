"""Pure tensor math of a Cooper step (torch only): GRPO advantages, the PPO policy loss, KL penalty,
aggregation, entropy, log-probabilities from (vocab-parallel) logits in chunks, the rollout engine's
log-probabilities against the trainer's (truncated importance sampling), the policy's reward from RM
logits, reward-model losses, preference-pair selection and the mixture-of-experts load-balancing loss."""

from cooper_mcore.algo.advantages import broadcast_to_tokens, group_advantages
from cooper_mcore.algo.losses import (
    PolicyLossStats,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    rm_bce_loss,
    rm_pair_losses,
    rm_pairwise_loss,
)
from cooper_mcore.algo.mismatch import logprob_mismatch_sums, truncated_is_weights
from cooper_mcore.algo.moe import aux_loss_coeff_scale, load_balancing_loss
from cooper_mcore.algo.pairs import (
    PairSelection,
    first_positive_index,
    gather_by_group,
    select_negatives,
    select_pairs,
    select_positives,
    verdict_codes,
)
from cooper_mcore.algo.reward_transforms import reward_from_logits, round_to_bf16
from cooper_mcore.algo.vocab import VocabShard, chunked_logprobs_entropy

__all__ = [
    "PairSelection",
    "PolicyLossStats",
    "VocabShard",
    "aggregate",
    "aux_loss_coeff_scale",
    "broadcast_to_tokens",
    "chunked_logprobs_entropy",
    "entropy_from_logits",
    "first_positive_index",
    "gather_by_group",
    "group_advantages",
    "kl_penalty",
    "load_balancing_loss",
    "logprob_mismatch_sums",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "reward_from_logits",
    "rm_bce_loss",
    "rm_pair_losses",
    "rm_pairwise_loss",
    "round_to_bf16",
    "select_negatives",
    "select_pairs",
    "select_positives",
    "truncated_is_weights",
    "verdict_codes",
]
