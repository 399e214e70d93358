"""Pure tensor math of a Cooper step (torch only): GRPO advantages, the PPO policy loss, KL penalty,
aggregation, entropy, reward-model losses and positive selection for preference pairs."""

from cooper_mcore.algo.advantages import broadcast_to_tokens, group_advantages
from cooper_mcore.algo.losses import (
    aggregate,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    reward_from_logits,
    rm_bce_loss,
    rm_pairwise_loss,
)
from cooper_mcore.algo.pairs import first_positive_index, gather_by_group

__all__ = [
    "aggregate",
    "broadcast_to_tokens",
    "entropy_from_logits",
    "first_positive_index",
    "gather_by_group",
    "group_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "reward_from_logits",
    "rm_bce_loss",
    "rm_pairwise_loss",
]
