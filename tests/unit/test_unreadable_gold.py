"""A reference the rule verifier cannot read makes the item unverifiable everywhere, never a confident
wrong: no positive, no accepted negative (from every CPU negative generator and the assistant), the rule
reward ``reward.unverifiable_reward``, and the ``rule/gold_unreadable`` metric counting the prompts.

The references are ones math-verify itself misjudges: it calls a correct ``\\boxed{14}`` wrong against
``\\text{14.}`` (the demo's unreadable form: a name ``14.``) and against ``fourteen`` (a product of letters),
and matches neither with any completion here (the same text would be matched: ``test_verifier.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from math_verify import parse, verify

from cooper_mcore.config.schema import load_config
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.negatives.assistant import LLMAssistant
from cooper_mcore.negatives.pairs import (
    AnswerPerturbation,
    ChainRewrite,
    PolicyWrongNegatives,
    RandomOtherResponse,
    build_pairs,
)
from cooper_mcore.rl.results import RolloutStats
from cooper_mcore.rl.rollouts import generate_groups
from cooper_mcore.rl.scoring import rule_rewards
from cooper_mcore.rl.step import rollout_stats
from cooper_mcore.rollout.base import GenerateOutput, SamplingParams
from cooper_mcore.types import Prompt
from cooper_mcore.verify.rule import RuleVerifier

pytestmark = pytest.mark.timeout(180)

COMPLETIONS = ["3*4=12,12+2=14 \\boxed{14}", "3*4=12,12+2=15 \\boxed{15}", "3*4=12,12+2=14 \\boxed{14.}"]
PROMPTS = [Prompt(id="as_text", question="3*4+2=", answer="\\text{14.}", token_ids=[0]),
           Prompt(id="in_words", question="3*4+2=", answer="fourteen", token_ids=[1]),
           Prompt(id="readable", question="3*4+2=", answer="14", token_ids=[2])]


class FakeEngine:
    """Writes :data:`COMPLETIONS` in turn for every prompt."""

    weight_version = 0

    def generate(self, prompts, params):
        return [GenerateOutput(token_ids=[5, 6], text=COMPLETIONS[i % len(COMPLETIONS)], logprobs=None,
                               finish_reason="stop") for i, _ in enumerate(prompts)]


class WrongWriter:
    """An assistant client that always answers with a wrong solution."""

    def chat_batch(self, batch, temperature=0.7, max_tokens=512):
        return ["3*4=12,12+2=15 \\boxed{15}" for _ in batch]


@pytest.fixture(scope="module")
def verifier():
    with RuleVerifier(timeout_s=10.0, num_workers=1) as v:
        yield v


@pytest.fixture(scope="module")
def groups(world, verifier):
    return generate_groups(FakeEngine(), verifier, PROMPTS, len(COMPLETIONS), SamplingParams(), version=0)


def test_math_verify_itself_misjudges_these_references():
    for gold in ("\\text{14.}", "fourteen"):
        assert verify(parse(gold, parsing_timeout=None), parse(COMPLETIONS[0], parsing_timeout=None),
                      timeout_seconds=None) is False


def test_the_groups_are_unverifiable_and_flagged(groups):
    assert [g.gold_unreadable for g in groups] == [True, True, False]
    assert [[s.rule_correct for s in g.samples] for g in groups] == [[None] * 3, [None] * 3, [True, False, False]]


def test_rule_reward_is_the_configured_one(groups):
    assert load_config().reward.unverifiable_reward == 0.0
    assert rule_rewards(groups, 0.25).tolist() == [[0.25] * 3, [0.25] * 3, [1.0, 0.0, 0.0]]
    assert rule_rewards(groups, 0.0).tolist() == [[0.0] * 3, [0.0] * 3, [1.0, 0.0, 0.0]]


def test_the_metric_counts_the_prompts(groups):
    stats = rollout_stats(groups, torch.zeros(3, 3), SimpleNamespace(rm=None))
    assert stats.rule_gold_unreadable == pytest.approx(2 / 3)
    assert stats.rule_unverifiable == pytest.approx(6 / 9)
    metrics = stats.to_metrics()
    assert metrics[K.RULE_GOLD_UNREADABLE] == pytest.approx(2 / 3)
    assert RolloutStats(0.0, 0.0, 0.0, 1.0).to_metrics()[K.RULE_GOLD_UNREADABLE] == 0.0


@pytest.mark.parametrize("make", [
    lambda v: PolicyWrongNegatives(negative_pick="first"),
    lambda v: ChainRewrite(v, seed=0),
    lambda v: ChainRewrite(v, seed=0, forms="rollouts"),
    lambda v: AnswerPerturbation(v, seed=0),
    lambda v: RandomOtherResponse(seed=0, verifier=v),
], ids=["policy", "rewrite", "rewrite_rollout_forms", "perturb", "random"])
def test_no_positive_and_no_pair(groups, verifier, make):
    """The unreadable prompts get no positive and so no pair; the readable one its pairs (but from a
    random other response, which here answers the same question and may be correct)."""
    negatives = make(verifier)
    pairs = build_pairs(groups, negatives, torch.zeros(3, 3), pairs_per_prompt=2)
    by_prompt = {p.prompt.id: [] for p in pairs}
    for p in pairs:
        by_prompt[p.prompt.id].append(p)
    for pid in ("as_text", "in_words"):
        assert all(p.chosen is None and p.rejected is None and not p.valid for p in by_prompt[pid])
    assert all(p.chosen == COMPLETIONS[0] for p in by_prompt["readable"])
    if not isinstance(negatives, RandomOtherResponse):
        assert any(p.valid for p in by_prompt["readable"])


@pytest.mark.parametrize("make", [
    lambda v: ChainRewrite(v, seed=0),
    lambda v: ChainRewrite(v, seed=0, forms="rollouts"),
    lambda v: AnswerPerturbation(v, seed=0),
    lambda v: RandomOtherResponse(seed=0, verifier=v),
    lambda v: LLMAssistant(WrongWriter(), v),
], ids=["rewrite", "rewrite_rollout_forms", "perturb", "random", "assistant"])
def test_no_negative_is_accepted_against_an_unreadable_reference(groups, verifier, make):
    """Asked directly for a negative of the correct solution, no generator accepts one for a reference it
    cannot read; the readable prompt gets one from those that always write one (a random other
    response may happen to be correct)."""
    generator = make(verifier)
    if hasattr(generator, "set_groups"):
        generator.set_groups(groups)
    negatives = generator.generate([(p, COMPLETIONS[0]) for p in PROMPTS])
    assert negatives[:2] == [None, None]
    if not isinstance(generator, RandomOtherResponse):
        assert negatives[2] is not None


def test_rm_rewards_of_right_and_wrong_rollouts_leave_the_unverifiable_out(groups):
    """``rm/reward_correct`` and ``rm/reward_wrong`` average the RM's reward over rollouts the rule read as
    right and as wrong: the rollouts of an unreadable reference are in neither."""
    rewards = torch.tensor([[0.9, 0.9, 0.9], [0.8, 0.8, 0.8], [1.0, 0.2, 0.4]])
    stats = rollout_stats(groups, rewards, SimpleNamespace(rm=object()))
    assert stats.rm_reward_correct == pytest.approx(1.0)
    assert stats.rm_reward_wrong == pytest.approx(0.3)  # (0.2 + 0.4) / 2
