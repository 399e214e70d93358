"""Typed records passed between the stages of a Cooper step.

prompts -> rollouts -> verification and reward scores -> advantages -> policy update ->
preference pairs -> reward-model update. Each stage takes and returns these, never dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class Prompt:
    """One training or evaluation problem.

    Attributes:
        id: stable identifier (from the data, or ``<file>:<line>``).
        question: the problem statement.
        answer: the reference (gold) answer.
        source: optional dataset name.
        text: the prompt as given to the policy (after the template); empty until templated.
        token_ids: ``text`` tokenised; empty until tokenised.
    """

    id: str
    question: str
    answer: str
    source: Optional[str] = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Sample:
    """One completion of a prompt.

    Attributes:
        prompt_id: the :class:`Prompt` it answers.
        token_ids: the completion's tokens (without the prompt).
        text: the completion decoded.
        logprobs: per-token log-probabilities under the engine's weights, if asked for.
        finish_reason: "stop" (EOS or a stop string) or "length".
        rule_correct: the rule verifier's verdict; None if not verified or unverifiable.
        rule_answered: whether the rule verifier read the completion's final answer as a value
            (False: it found none it could read, so a False ``rule_correct`` means "unread", not
            "a different answer"); None when unknown.
        reward: the reward of the policy's update (the rule's 0/1, or the reward model's), set by
            the step (:func:`cooper_mcore.rl.step.record_rewards`); None before.
        weight_version: the policy weight version that generated it.
        routed_experts: with rollout routing replay, the experts the engine routed each position of
            ``prompt + completion`` (but the last token) to, int16 ``[positions, layers * top_k]``
            (:attr:`cooper_mcore.rollout.base.GenerateOutput.routed_experts`).
    """

    prompt_id: str
    token_ids: list[int]
    text: str
    logprobs: Optional[list[float]] = None
    finish_reason: str = "stop"
    rule_correct: Optional[bool] = None
    rule_answered: Optional[bool] = None
    reward: Optional[float] = None
    weight_version: int = 0
    routed_experts: Optional[torch.Tensor] = None


@dataclass
class RolloutGroup:
    """The G samples of one prompt (GRPO normalises advantages within a group).

    Attributes:
        prompt: the prompt.
        samples: its completions.
        gold_unreadable: the rule verifier cannot read the prompt's reference answer, so every sample
            is unverifiable (no positive, no negative; the rule reward ``reward.unverifiable_reward``).
    """

    prompt: Prompt
    samples: list[Sample]
    gold_unreadable: bool = False


@dataclass
class PreferencePair:
    """A reward-model training pair for one prompt.

    Attributes:
        prompt: the problem.
        chosen: a completion the rule verifier marked correct.
        rejected: a completion verified wrong (assistant-written or other); None if none.
        source: where ``rejected`` came from ("assistant", "policy", "perturb", "rewrite", "random").
        failed: no ``rejected`` because its generator failed (the assistant endpoint did not
            answer after its retries), as opposed to none being found.
        chosen_index: the rollout (column in its group) ``chosen`` is, if any.
        rejected_index: the rollout ``rejected`` is when it is one of the policy's own rollouts;
            None for written negatives (assistant, rewrite, perturb) and other prompts' rollouts.
    """

    prompt: Prompt
    chosen: Optional[str]
    rejected: Optional[str]
    source: str = ""
    failed: bool = False
    chosen_index: Optional[int] = None
    rejected_index: Optional[int] = None

    @property
    def valid(self) -> bool:
        """A pair takes part in the loss only with both sides present."""
        return self.chosen is not None and self.rejected is not None
