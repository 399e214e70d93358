"""Cooper's reward-model update: per prompt a verified-correct positive against a verified-wrong
negative, trained with the pairwise loss ``-logsigmoid(s_pos - s_neg)``; prompts without a valid
pair are masked out.

Pairs are built on each model-parallel group's leader (where the verifier and the assistant
client live; positives and the policy-rollout negatives are picked by
:mod:`cooper_mcore.algo.pairs` from the rule verdicts and the pre-update RM scores), broadcast to
the group, tokenised as the reward model reads them and trained with
:func:`cooper_mcore.train.reward_model.pairwise_train_step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from cooper_mcore.collectives import broadcast_object_in_model_parallel_group, is_group_leader
from cooper_mcore.config.schema import CooperConfig, RMUpdateConfig
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.negatives.pairs import build_pairs, check_negative_failures, make_negative_generator, pair_stats
from cooper_mcore.negatives.protocols import ChatBatchClient
from cooper_mcore.rl.results import PairCounts, RMUpdate
from cooper_mcore.rl.scoring import rm_batch, rm_texts
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.train.reward_model import pairwise_train_step
from cooper_mcore.types import PreferencePair, RolloutGroup
from cooper_mcore.verify.protocols import BatchVerifier


def make_pairs(groups: Sequence[RolloutGroup], logits: torch.Tensor, cfg: RMUpdateConfig,
               verifier: Optional[BatchVerifier], assistant: Optional[ChatBatchClient],
               seed: int) -> list[PreferencePair]:
    """This step's preference pairs, the same on every rank of the model-parallel group, with
    ``rm.on_assistant_failure`` applied (pairs whose assistant request failed are masked, or the
    run stops).

    Raises:
        cooper_mcore.negatives.pairs.AssistantUnavailable: an assistant request failed after its
            retries and ``rm.on_assistant_failure`` is ``stop``.
    """
    pairs = None
    if is_group_leader():
        negatives = make_negative_generator(cfg.negatives, verifier, client=assistant, seed=seed,
                                            negative_pick=cfg.negative_pick, assistant_rounds=cfg.assistant_rounds,
                                            assistant_prompt=cfg.assistant_prompt,
                                            rewrite_kinds=tuple(cfg.rewrite_kinds),
                                            rewrite_forms=cfg.rewrite_forms)
        pairs = build_pairs(groups, negatives, logits, pairs_per_prompt=cfg.pairs_per_prompt,
                            positive_pick=cfg.positive_pick, seed=seed)
    pairs = broadcast_object_in_model_parallel_group(pairs)
    check_negative_failures(pairs, cfg.on_assistant_failure, cfg.assistant_url)
    return pairs


def pair_counts(pairs: Sequence[PreferencePair]) -> PairCounts:
    """The ``pairs/*`` counts of a step's pairs."""
    stats = pair_stats(pairs)
    return PairCounts(valid=stats["valid"], no_positive=stats["no_positive"], no_negative=stats["no_negative"],
                      assistant_failed=stats["failed"])


def update_reward_model(rm: ModelState, pairs: Sequence[PreferencePair], cfg: CooperConfig,
                        batching: MicroBatching) -> RMUpdate:
    """One pairwise optimizer step of the reward model on ``pairs`` (masked where invalid); a
    skipped (non-finite) update does not advance the schedule, as in megatron."""
    chosen = rm_batch(rm, rm_texts(cfg, [(p.prompt, p.chosen or "") for p in pairs]))
    rejected = rm_batch(rm, rm_texts(cfg, [(p.prompt, p.rejected or "") for p in pairs]))
    valid = torch.tensor([p.valid for p in pairs], dtype=torch.bool)
    m = pairwise_train_step(rm.ddp, rm.optimizer, chosen, rejected, valid, cfg.train.micro_batch_size,
                            anchor_weight=cfg.rm.anchor_weight, batching=batching)
    update = RMUpdate(loss=m["loss"], pairwise_loss=m["pairwise_loss"], anchor_loss=m["anchor_loss"],
                      pair_acc=m["pair_acc"], threshold_acc=m["threshold_acc"], nonfinite=bool(m["nonfinite"]),
                      pair_counts=pair_counts(pairs), moe_aux_loss=m.get("moe_aux_loss"))
    if not update.nonfinite:
        rm.scheduler.step(1)
    return update
