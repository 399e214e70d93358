"""The typed records of a Cooper step (cooper_mcore.rl.results): StepResult.to_metrics writes the
metric keys a step writes, with their values, from hand-built records; a skipped (non-finite) update
is a field that the schedule and the loop read."""

from __future__ import annotations

import dataclasses
import logging
import math
from types import SimpleNamespace

import pytest

from cooper_mcore.config.schema import RewardMode, load_config
from cooper_mcore.metric_names import SCHEMA
from cooper_mcore.rl import rm_update, step
from cooper_mcore.rl.loop import nonfinite_streak
from cooper_mcore.rl.results import (
    GRPOUpdate,
    PairCounts,
    PolicyUpdate,
    RMUpdate,
    RolloutStats,
    StepResult,
    no_rule_signal,
    no_signal_message,
    steps_without_signal,
)
from cooper_mcore.types import PreferencePair, Prompt

POLICY = PolicyUpdate(loss=0.5, kl=0.01, ratio_mean=1.02, clip_frac=0.125, entropy=2.5, grad_norm=3.0, skipped=1,
                      lr=1e-6)
RM = RMUpdate(loss=0.7, pairwise_loss=0.6, anchor_loss=0.2, pair_acc=0.75, threshold_acc=0.625, nonfinite=True,
              pair_counts=PairCounts(valid=3, no_positive=1, no_negative=2, assistant_failed=1))
ROLLOUTS = RolloutStats(reward_mean=0.625, rule_acc=0.5, rule_unverifiable=0.25, response_length=12.0,
                        rm_reward_correct=0.875, rm_reward_wrong=0.375, rule_gold_unreadable=0.125)
POLICY_KEYS = {"loss": 0.5, "kl": 0.01, "ratio/mean": 1.02, "clip_frac": 0.125, "entropy": 2.5, "grad_norm": 3.0,
               "lr": 1e-6}
ROLLOUT_KEYS = {"reward/mean": 0.625, "rule/acc": 0.5, "reward_rule_gap": 0.125, "response/length": 12.0,
                "rule/unverifiable": 0.25, "rule/gold_unreadable": 0.125}


def test_a_cooper_step_writes_every_key_with_its_value():
    metrics = StepResult(ROLLOUTS, POLICY, RM).to_metrics()
    assert metrics == {**POLICY_KEYS, **ROLLOUT_KEYS, "skipped/nonfinite": 2.0,  # the policy's one + the RM's
                       "rm/reward_correct": 0.875, "rm/reward_wrong": 0.375,
                       "rm/loss": 0.7, "rm/pairwise_loss": 0.6, "rm/anchor_loss": 0.2, "rm/pair_acc": 0.75,
                       "rm/threshold_acc": 0.625, "pairs/valid": 3.0, "pairs/no_positive": 1.0,
                       "pairs/no_negative": 2.0, "pairs/assistant_failed": 1.0}
    assert set(metrics) <= set(SCHEMA)
    assert all(isinstance(v, float) for v in metrics.values())


def test_static_rm_and_rule_steps_write_no_rm_update():
    static = StepResult(ROLLOUTS, POLICY).to_metrics()  # an RM scored the rollouts, none was trained
    assert static == {**POLICY_KEYS, **ROLLOUT_KEYS, "skipped/nonfinite": 1.0, "rm/reward_correct": 0.875,
                      "rm/reward_wrong": 0.375}
    rule_rollouts = RolloutStats(reward_mean=0.5, rule_acc=0.5, rule_unverifiable=0.0, response_length=3.0)
    rule = StepResult(rule_rollouts, POLICY).to_metrics()
    assert rule == {**POLICY_KEYS, "reward/mean": 0.5, "rule/acc": 0.5, "reward_rule_gap": 0.0,
                    "response/length": 3.0, "rule/unverifiable": 0.0, "rule/gold_unreadable": 0.0,
                    "skipped/nonfinite": 1.0}
    assert set(static) <= set(SCHEMA) and set(rule) <= set(SCHEMA)


def test_skipped_updates_count_the_policy_and_the_rm():
    clean = PolicyUpdate(**{**vars(POLICY), "skipped": 0})
    assert StepResult(ROLLOUTS, clean).skipped_updates == 0
    assert StepResult(ROLLOUTS, clean, RMUpdate(**{**vars(RM), "nonfinite": False})).skipped_updates == 0
    assert StepResult(ROLLOUTS, clean, RM).skipped_updates == 1
    assert StepResult(ROLLOUTS, POLICY, RM).skipped_updates == 2


def _grpo(loss: float, grad_norm: float, nonfinite: bool) -> GRPOUpdate:
    return GRPOUpdate(loss=loss, kl=0.0, ratio_mean=1.0, clip_frac=0.5 * loss, entropy=1.0, grad_norm=grad_norm,
                      nonfinite=nonfinite)


def test_a_policy_update_is_the_mean_of_its_mini_batch_updates():
    u = PolicyUpdate.mean_of([_grpo(1.0, 2.0, False), _grpo(3.0, 4.0, False)], lr=0.1)
    assert (u.loss, u.clip_frac, u.grad_norm, u.ratio_mean, u.skipped, u.lr) == (2.0, 1.0, 3.0, 1.0, 0, 0.1)
    skipped = PolicyUpdate.mean_of([_grpo(1.0, 2.0, False), _grpo(3.0, math.nan, True)], lr=0.1)
    assert skipped.skipped == 1 and math.isnan(skipped.grad_norm) and skipped.loss == 2.0


def test_mixture_of_experts_models_add_their_aux_losses():
    """``moe_aux_loss`` (mean over the mini-batch updates) and ``rm/moe_aux_loss`` only for MoE models."""
    updates = [dataclasses.replace(_grpo(1.0, 2.0, False), moe_aux_loss=a) for a in (0.01, 0.03)]
    policy = PolicyUpdate.mean_of(updates, lr=0.1)
    assert policy.moe_aux_loss == pytest.approx(0.02)
    rm = dataclasses.replace(RM, moe_aux_loss=0.05)
    metrics = StepResult(ROLLOUTS, policy, rm).to_metrics()
    assert metrics["moe_aux_loss"] == pytest.approx(0.02) and metrics["rm/moe_aux_loss"] == 0.05
    assert set(metrics) <= set(SCHEMA)
    assert "moe_aux_loss" not in StepResult(ROLLOUTS, POLICY, RM).to_metrics()  # dense: no key


class _Schedule:
    def __init__(self) -> None:
        self.steps = 0

    def step(self, n: int) -> None:
        self.steps += n


def test_a_skipped_policy_update_does_not_step_the_schedule(monkeypatch):
    """``update_policy`` reads each update's ``nonfinite`` field: only the finite update steps the schedule."""

    class Batch:
        def __len__(self):
            return 4

        def slice(self, start, end):
            return self

    updates = iter([_grpo(1.0, math.nan, True), _grpo(3.0, 2.0, False)])
    monkeypatch.setattr(step, "policy_update", lambda ddp, optimizer, batch, batching, loss: next(updates))
    schedule = _Schedule()
    run = SimpleNamespace(cfg=load_config(None, ["train.mini_batches=2"]), batching=None, policy=SimpleNamespace(
        ddp=None, optimizer=SimpleNamespace(param_groups=[{"lr": 0.25}]), scheduler=schedule))
    u = step.update_policy(run, Batch())
    assert schedule.steps == 1 and u.skipped == 1 and u.lr == 0.25 and u.loss == 2.0


@pytest.mark.parametrize("nonfinite", [True, False])
def test_a_skipped_rm_update_does_not_step_the_schedule(monkeypatch, nonfinite):
    """``update_reward_model`` returns the RM's step as a record; its ``nonfinite`` field decides the schedule."""
    seen = {}

    def pairwise_train_step(ddp, optimizer, chosen, rejected, valid, micro_batch_size, anchor_weight, batching):
        seen["valid"] = valid.tolist()
        return {"loss": 0.5, "pairwise_loss": 0.5, "anchor_loss": 0.0, "pair_acc": 1.0, "threshold_acc": 0.5,
                "num_valid": 1, "grad_norm": math.nan if nonfinite else 1.0, "skipped": False, "nonfinite": nonfinite}

    monkeypatch.setattr(rm_update, "pairwise_train_step", pairwise_train_step)
    monkeypatch.setattr(rm_update, "rm_batch", lambda rm, texts: texts)
    p = Prompt(id="p", question="1+1=", answer="2")
    pairs = [PreferencePair(p, "2", "3"), PreferencePair(p, None, None), PreferencePair(p, "2", None, failed=True)]
    schedule = _Schedule()
    rm = SimpleNamespace(ddp=None, optimizer=None, scheduler=schedule)
    u = rm_update.update_reward_model(rm, pairs, load_config(None, []), batching=None)
    assert u.nonfinite is nonfinite and schedule.steps == (0 if nonfinite else 1)
    assert seen["valid"] == [True, False, False]
    assert u.pair_counts == PairCounts(valid=1, no_positive=1, no_negative=1, assistant_failed=1)
    assert (u.loss, u.pair_acc, u.threshold_acc) == (0.5, 1.0, 0.5)


def test_the_loop_counts_steps_with_a_skipped_update_from_the_field(caplog):
    clean = StepResult(ROLLOUTS, PolicyUpdate(**{**vars(POLICY), "skipped": 0}))
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.rl.loop"):
        assert nonfinite_streak(1, StepResult(ROLLOUTS, POLICY, RM), step=4, limit=3) == 2
    assert "step 4: non-finite loss or gradient norm, 2 update(s) skipped (2 step(s) in a row, the limit is 3)" \
        in caplog.text
    assert nonfinite_streak(2, clean, step=5, limit=3) == 0


@pytest.mark.parametrize("unverifiable, rule_trains, expected", [
    (1.0, True, True),  # not one rollout of the world got a rule verdict, and the rule trains the run
    (1.0, False, False),  # static_rm: the frozen reward model trains it, the rule only measures
    (0.75, True, False),  # a quarter of the rollouts got a verdict: a signal, however weak
    (0.0, True, False),  # every rollout judged (all wrong, all right or a mix: a signal either way)
])
def test_no_rule_signal_is_no_verdict_at_all_where_the_rule_trains(unverifiable, rule_trains, expected):
    assert no_rule_signal(unverifiable, rule_trains) is expected


def test_the_modes_the_rule_trains():
    assert [m.rule_trains for m in (RewardMode.rule, RewardMode.static_rm, RewardMode.cooper)] == [True, False, True]


def test_steps_without_signal_count_in_a_row_from_the_world_line():
    silent = {"rule/unverifiable": 1.0, "rule/gold_unreadable": 1.0, "rule/acc": 0.0}
    judged = {"rule/unverifiable": 0.5, "rule/gold_unreadable": 0.5, "rule/acc": 0.0}  # all read ones wrong
    count = 0
    for line, want in ((silent, 1), (silent, 2), (judged, 0), (silent, 1)):
        count = steps_without_signal(count, line, rule_trains=True)
        assert count == want
    assert steps_without_signal(4, silent, rule_trains=False) == 0


def test_the_stop_line_says_why_what_it_costs_and_what_to_do():
    line = no_signal_message(5, {"rule/unverifiable": 1.0, "rule/gold_unreadable": 1.0}, uses_rm=False,
                             train_path="data/train.jsonl", checkpoint="run/checkpoints/step_5")
    assert line == ("stopping: 5 steps in a row without a rule verdict on any rollout (100% of the last step's prompts "
                    "have a reference the rule verifier cannot read): reward.mode=rule has no reward to train on; "
                    "checkpoint run/checkpoints/step_5 kept; check the references of data.train_path data/train.jsonl "
                    "(`cooper verify`), or set train.max_steps_without_signal=0 to train on")
    cooper = no_signal_message(3, {"rule/unverifiable": 1.0, "rule/gold_unreadable": 0.25}, uses_rm=True,
                               train_path="t.jsonl", checkpoint=None)
    assert "(25% of the last step's prompts have a reference the rule verifier cannot read, the other rollouts timed " \
           "out or failed in the verifier): the reward model gets no preference pair" in cooper
    assert "checkpoint (none) kept" in cooper and "\n" not in cooper
