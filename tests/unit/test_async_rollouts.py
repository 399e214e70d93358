"""The rollout pipeline (cooper_mcore.rl.async_rollouts) in a world of one process with a fake engine
that records which weights it generated with: step s comes from version max(s - k, start) exactly, the
engine gets each version once and in order (again after an evaluation pushed a newer one), staleness
never exceeds the bound, and a checkpoint's kept rollouts and data position resume the same stream."""

from __future__ import annotations

import pytest
import torch

from cooper_mcore.data.iterator import PromptIterator
from cooper_mcore.rl.async_rollouts import (
    RolloutPipeline,
    RolloutsFailed,
    groups_from_json,
    groups_to_json,
    staleness_of,
)
from cooper_mcore.rollout.base import GenerateOutput, SamplingParams
from cooper_mcore.types import Prompt, RolloutGroup, Sample

pytestmark = pytest.mark.timeout(120)

PROMPTS = [Prompt(id=f"p{i}", question=f"{i}+0=", answer=str(i), token_ids=[i + 1]) for i in range(40)]


class VersionEngine:
    """Writes, for each prompt, the version of the weights it holds; records the versions pushed."""

    def __init__(self) -> None:
        self.weight_version = -1
        self.pushed: list[int] = []

    def update_weights(self, buckets, version):
        for bucket in buckets:
            assert all(float(t[0]) == version for _, t in bucket)  # the weights of that version, not another
        self.weight_version = version
        self.pushed.append(version)

    def shutdown(self):
        self.closed = True

    fail = False

    def generate(self, prompts, params):
        if self.fail:
            raise RuntimeError("the engine broke")
        return [GenerateOutput(token_ids=[self.weight_version], text=str(self.weight_version), logprobs=[0.0],
                               finish_reason="stop") for _ in prompts]


class NoVerifier:
    def verify_batch(self, golds, preds):
        return [type("V", (), {"correct": False, "answered": True, "status": "ok"})() for _ in golds]


def weights(version):
    return [("w", torch.full((2,), float(version)))]


def pipeline(engine, data, k, start=0, steps=8):
    return RolloutPipeline(engine, NoVerifier(), data, k, group_size=2, sampling=lambda s: SamplingParams(seed=s),
                           start=start, steps=steps, bucket_bytes=1 << 20)


def begin(p, version):
    """The trainer's side at start (or resume): the current policy published, the first prompts drawn."""
    p.publish(version, weights(version))
    p.feed()


def drive(p, first, last):
    """The trainer's side from step ``first``: take, 'train', publish the next version, feed."""
    seen = {}
    for step in range(first, last):
        groups, stats = p.take(step)
        seen[step] = ([s.weight_version for g in groups for s in g.samples], stats)
        begin(p, step + 1)
    return seen


@pytest.mark.parametrize("k", [0, 1, 2])
def test_step_s_comes_from_version_s_minus_k_and_each_version_is_pushed_once_in_order(world, k):
    engine = VersionEngine()
    p = pipeline(engine, PromptIterator(PROMPTS, 4), k)
    try:
        begin(p, 0)
        seen = drive(p, 0, 8)
    finally:
        p.close()
    for step, (versions, stats) in seen.items():
        assert set(versions) == {max(step - k, 0)}, (step, versions)
        assert stats.staleness_max == min(step, k) and stats.dropped_stale == 0
    assert engine.pushed == list(range(0, 8 - k))


def test_an_evaluation_gets_the_newest_policy_and_generation_goes_back_to_its_own(world):
    engine = VersionEngine()
    p = pipeline(engine, PromptIterator(PROMPTS, 4), 2)
    try:
        begin(p, 0)
        drive(p, 0, 3)  # version 3 published; steps 3 and 4 come from versions 1 and 2
        out = p.generate_with(3).generate([[1]], SamplingParams())
        assert out[0].token_ids == [3]
        versions = [s.weight_version for g in p.take(3)[0] for s in g.samples]
        assert set(versions) == {1}
        assert set(v for g in p.take(4)[0] for v in [s.weight_version for s in g.samples]) == {2}
    finally:
        p.close()


def test_a_failed_evaluation_lets_the_collectives_finish_then_stops_every_rank(world):
    engine = VersionEngine()
    p = pipeline(engine, PromptIterator(PROMPTS, 4), 1)
    try:
        begin(p, 0)
        drive(p, 0, 2)
        engine.fail = True
        out = p.generate_with(2).generate([[1], [2]], SamplingParams())
        assert [o.token_ids for o in out] == [[], []]  # empty completions: the evaluation's all-reduce goes on
        with pytest.raises(RolloutsFailed, match="the engine broke"):
            p.check()
    finally:
        p.close()


def test_a_checkpoint_keeps_the_rollouts_ahead_and_a_resume_continues_the_stream(world):
    engine = VersionEngine()
    data = PromptIterator(PROMPTS, 4)
    p = pipeline(engine, data, 2)
    try:
        begin(p, 0)
        drive(p, 0, 3)
        kept, position = p.pending(3), p.data_state(3)
        assert p.kept_steps(3) == len(kept) == 2
        later = drive(p, 3, 8)
    finally:
        p.close()
    data2 = PromptIterator(PROMPTS, 4)
    data2.load_state_dict(position)
    q = pipeline(VersionEngine(), data2, 2, start=3)
    try:
        q.restore(kept, 2)
        begin(q, 3)
        resumed = drive(q, 3, 8)
    finally:
        q.close()
    assert {s: v for s, (v, _) in resumed.items()} == {s: v for s, (v, _) in later.items()}


def test_staleness_of_counts_and_guards_the_bound():
    groups = [RolloutGroup(PROMPTS[0], [Sample("p0", [1], "", weight_version=v) for v in (3, 4)])]
    assert staleness_of(groups, 5, 2) == (1.5, 2)
    with pytest.raises(AssertionError):
        staleness_of(groups, 6, 2)


def test_groups_survive_json():
    groups = [RolloutGroup(PROMPTS[1], [Sample("p1", [5, 6], "x", logprobs=[-0.5, -1.0], rule_correct=True,
                                               rule_answered=True, weight_version=7)], gold_unreadable=True)]
    assert groups_from_json(groups_to_json(groups)) == groups
