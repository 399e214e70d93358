"""Scoring the rollouts: the rule verifier's 0/1 verdicts and the reward model's logits.

The policy's reward is made from these by :mod:`cooper_mcore.rl.step`: the rule's 0/1 in rule
mode; in the RM modes the reward model alone (its logit through
:func:`cooper_mcore.algo.reward_transforms.reward_from_logits`), the rule verdicts only picking the
reward model's positives and feeding the metrics. The reward model
reads the VerifyRM input of each rollout (:func:`cooper_mcore.data.templates.rm_input`),
tokenised exactly as ``cooper train-rm`` tokenises its data, and is scored through the one scoring
path of :func:`cooper_mcore.train.reward_model.rm_scores`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cooper_mcore.config.schema import CooperConfig
from cooper_mcore.data.templates import rm_input
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.train.reward_model import RMBatch, make_batch, rm_scores
from cooper_mcore.types import Prompt, RolloutGroup


def rule_verdicts(groups: Sequence[RolloutGroup]) -> torch.Tensor:
    """``[P, G]`` 1.0 where the rule verifier marked a rollout correct, else 0.0."""
    return torch.tensor([[1.0 if s.rule_correct else 0.0 for s in g.samples] for g in groups])


def rule_rewards(groups: Sequence[RolloutGroup], unverifiable: float) -> torch.Tensor:
    """``[P, G]`` the rule reward: 1.0 for a rollout the rule verifier marked correct, 0.0 for one it
    marked wrong, ``unverifiable`` (``reward.unverifiable_reward``) for one it could not verify (a
    timeout, a crash, a reference it cannot read)."""
    value = {True: 1.0, False: 0.0, None: float(unverifiable)}
    return torch.tensor([[value[s.rule_correct] for s in g.samples] for g in groups])


def rm_texts(cfg: CooperConfig, items: Sequence[tuple[Prompt, str]]) -> list[str]:
    """The VerifyRM input of ``(prompt, completion)`` items; its ``<question>`` is the question as
    the policy reads it (``data.template``) or bare, per ``rm.question``. Scoring and the RM update
    use this one function, so the RM is trained on the text it scores."""
    template = cfg.data.template if cfg.rm.question_as_prompted else None
    return [rm_input(p.question, p.answer, c, question_template=template) for p, c in items]


def rm_batch(rm: ModelState, texts: Sequence[str]) -> RMBatch:
    """``texts`` tokenised as ``cooper train-rm`` does, right-padded to a multiple of 8."""
    return make_batch(rm.tokenizer, texts, max_length=rm.arch.max_position_embeddings, multiple_of=8)


def rollout_logits(rm: ModelState, groups: Sequence[RolloutGroup], cfg: CooperConfig,
                   batching: MicroBatching) -> torch.Tensor:
    """``[P, G]`` reward-model logits of every rollout, on every rank of the model (collective over
    its TP/PP groups)."""
    batch = rm_batch(rm, rm_texts(cfg, [(g.prompt, s.text) for g in groups for s in g.samples]))
    scores = rm_scores(rm.model, batch.input_ids, batch.lengths, cfg.train.micro_batch_size, batching)
    return scores.view(len(groups), -1)
