"""The rollout engine checked against the trainer (cooper_mcore.rl.engine_check): its per-token
log-probabilities placed where the trainer's are, the step's agreement over the response tokens by
hand, the first-step guard, a Cooper step that checks the engine once and reports it every step,
and the SGLang engine's log-probabilities (a fake ``sglang.Engine``) reaching the policy batch."""

from __future__ import annotations

import contextlib
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from cooper_mcore.config.schema import AlgoConfig, load_config
from cooper_mcore.metric_names import SCHEMA
from cooper_mcore.metrics import PhaseTimer
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.parallel import single_process_world
from cooper_mcore.rl import step
from cooper_mcore.rl.engine_check import EngineMismatch, check_engine, engine_agreement
from cooper_mcore.rl.results import EngineAgreement, PolicyUpdate, RolloutStats, StepResult
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.sglang_engine import SGLangEngine
from cooper_mcore.train.tokens import build_token_batch
from cooper_mcore.types import Prompt, RolloutGroup, Sample
from tests.unit.test_sglang_engine import GENERATE_RESPONSE, FakeOfflineEngine

PROMPTS = [[1, 2, 3], [4, 5]]
RESPONSES = [[6, 7], [8, 9, 10]]
ENGINE = [[-0.5, -1.0], [-0.1, -0.2, -0.3]]


def test_engine_logprobs_sit_where_the_trainers_do():
    """Label-aligned: position t holds token t + 1's log-probability, so a response's k-th token is
    at ``len(prompt) - 1 + k``, exactly the loss mask's positions; slices and micro-batches keep them."""
    batch = build_token_batch(PROMPTS, RESPONSES, pad_id=0, response_logprobs=ENGINE)
    assert batch.engine_logp[0, 2:4].tolist() == [-0.5, -1.0] and batch.engine_logp[1, 1:4].tolist() == pytest.approx(
        [-0.1, -0.2, -0.3])
    assert torch.equal(batch.engine_logp != 0, batch.loss_mask.bool())
    assert torch.equal(batch.slice(1, 2).engine_logp, batch.engine_logp[1:2])
    with single_process_world():
        mbs = batch.micro_batches(MicroBatching(1))
    assert [mb.engine_logp.tolist() for mb in mbs] == [row[None].tolist() for row in batch.engine_logp]
    assert build_token_batch(PROMPTS, RESPONSES, pad_id=0).engine_logp is None
    with pytest.raises(ValueError, match="log-probabilities do not match the responses' tokens"):
        build_token_batch(PROMPTS, RESPONSES, pad_id=0, response_logprobs=[[-0.5], [-0.1, -0.2, -0.3]])


def _batch_with_trainer(trainer):
    batch = build_token_batch(PROMPTS, RESPONSES, pad_id=0, response_logprobs=ENGINE)
    batch.old_logp = torch.zeros_like(batch.loss_mask)
    batch.old_logp[0, 2:4] = torch.tensor(trainer[0])
    batch.old_logp[1, 1:4] = torch.tensor(trainer[1])
    return batch


def test_agreement_by_hand():
    # engine - trainer: 0.5, -0.5 | 0, 0.1, 0.3 (5 tokens)
    batch = _batch_with_trainer([[-1.0, -0.5], [-0.1, -0.3, -0.6]])
    a = engine_agreement(batch, tis_cap=1.2)
    assert a.diff_mean == pytest.approx(1.4 / 5) and a.diff_max == pytest.approx(0.5)
    d = [0.5, -0.5, 0.0, 0.1, 0.3]  # k3: exp(-d) + d - 1
    assert a.kl == pytest.approx(sum(math.exp(-x) + x - 1 for x in d) / 5, rel=1e-6)
    weights = [min(math.exp(-x), 1.2) for x in d]  # exp(0.5) = 1.65 is capped
    assert a.tis_weight_mean == pytest.approx(sum(weights) / 5, rel=1e-6) and a.tis_capped_frac == pytest.approx(0.2)
    plain = engine_agreement(batch, tis_cap=None)
    assert plain.tis_weight_mean is None and plain.to_metrics().keys() == {
        "rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/logprob_kl"}
    assert set(a.to_metrics()) <= set(SCHEMA) and len(a.to_metrics()) == 5
    batch.engine_logp = None
    assert engine_agreement(batch, tis_cap=None) is None


def test_the_first_step_stops_when_the_engine_is_not_the_policy(caplog):
    far = EngineAgreement(diff_mean=2.75, diff_max=9.5, kl=3.0)
    with pytest.raises(EngineMismatch) as info:
        check_engine(far, AlgoConfig(), step=1, first=True)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in message
    assert message.startswith("step 1: the rollout engine's log-probabilities differ from the trainer's by 2.75 nats")
    assert "algo.logprob_diff_guard=0.5" in message and "the engine's weights are not the policy's" in message
    check_engine(far, AlgoConfig(), step=2, first=False)  # later steps report, never stop
    check_engine(far, AlgoConfig(logprob_diff_guard=None), step=1, first=True)  # off
    check_engine(far, AlgoConfig(logprob_diff_guard=3.0), step=1, first=True)  # a looser bound
    check_engine(EngineAgreement(diff_mean=0.02, diff_max=1.5, kl=1e-3), AlgoConfig(), step=1, first=True)
    # a tight guard: the message has the digits that show the difference above it
    with pytest.raises(EngineMismatch, match=r"by 0\.000310 nats per response token \(max 0\.00120; "
                                             r"algo\.logprob_diff_guard=0\.0001\)"):
        check_engine(EngineAgreement(diff_mean=3.1e-4, diff_max=1.2e-3, kl=1e-7), AlgoConfig(logprob_diff_guard=1e-4),
                     step=1, first=True)
    with pytest.raises(ValueError, match="algo.tis_cap needs the rollout engine's per-token log-probabilities"):
        check_engine(None, AlgoConfig(tis_cap=2.0), step=3, first=False)
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.rl.engine_check"):
        check_engine(None, AlgoConfig(), step=1, first=True)
        check_engine(None, AlgoConfig(), step=2, first=False)
    assert len([r for r in caplog.records if "returned no log-probabilities" in r.message]) == 1


def _step_run(monkeypatch, engine_logprobs, overrides=()):
    """A run whose engine, policy passes and update are stand-ins: the step's own code between them runs."""
    cfg = load_config(None, ["reward.mode=rule", "rollout.group_size=2", *overrides])
    prompt = Prompt(id="p", question="1+1=", answer="2", token_ids=[1, 2, 3])
    samples = [Sample(prompt_id="p", token_ids=r, text="", logprobs=lp, rule_correct=c)
               for r, lp, c in zip(RESPONSES, engine_logprobs, (True, False))]
    trainer = [[-0.5, -1.0], [-0.1, -0.2, -0.3]]  # the engine's ENGINE, minus the shift below
    seen = {}

    def fill_logprobs(run, batch, routes=None):
        batch.old_logp = torch.zeros_like(batch.loss_mask)
        batch.old_logp[0, 2:4] = torch.tensor(trainer[0])
        batch.old_logp[1, 2:5] = torch.tensor(trainer[1])

    def update_policy(run, batch, routes=None):
        seen["batch"] = batch
        return PolicyUpdate(loss=0.0, kl=0.0, ratio_mean=1.0, clip_frac=0.0, entropy=1.0, grad_norm=1.0, skipped=0,
                            lr=1e-6)

    monkeypatch.setattr(step, "generate_groups", lambda *a: [RolloutGroup(prompt, samples)])
    monkeypatch.setattr(step, "fill_logprobs", fill_logprobs)
    monkeypatch.setattr(step, "update_policy", update_policy)
    colocation = SimpleNamespace(generating=lambda version, timer: contextlib.nullcontext(None))
    run = SimpleNamespace(cfg=cfg, step=0, engine_checked=False, colocation=colocation, verifier=None, rm=None,
                          sampling=lambda seed: SamplingParams(), rollout_sampling=lambda step: SamplingParams(),
                          policy=SimpleNamespace(tokenizer={"pad_token_id": 0}))
    return run, seen


@pytest.mark.parametrize("shift,stops", [(0.0, False), (1.0, True)])
def test_a_step_checks_the_engine_on_its_first_step_and_reports_it_on_every_step(monkeypatch, shift, stops):
    """An engine whose log-probabilities are 1 nat off stops the first step; one that agrees is
    reported (``rollout/logprob_*``), and its log-probabilities reach the policy's update."""
    engine = [[x - shift for x in row] for row in ENGINE]
    run, seen = _step_run(monkeypatch, engine)
    with single_process_world():
        if stops:
            with pytest.raises(EngineMismatch, match="differ from the trainer's by 1.00 nats"):
                step.cooper_step(run, [], PhaseTimer())
            run.engine_checked, run.step = True, 1  # a later step of the same process only reports it
        result = step.cooper_step(run, [], PhaseTimer())
    metrics = result.to_metrics()
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(shift, abs=1e-6)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(shift, abs=1e-6)
    assert run.engine_checked and "rollout/tis_weight_mean" not in metrics
    assert seen["batch"].engine_logp[0, 2:4].tolist() == pytest.approx(engine[0])


def test_a_step_with_tis_needs_the_engines_logprobs(monkeypatch):
    run, _ = _step_run(monkeypatch, [ENGINE[0], None], ["algo.tis_cap=2.0"])
    with single_process_world(), pytest.raises(ValueError, match="algo.tis_cap needs the rollout engine"):
        step.cooper_step(run, [], PhaseTimer())
    run, seen = _step_run(monkeypatch, ENGINE, ["algo.tis_cap=2.0"])
    with single_process_world():
        metrics = step.cooper_step(run, [], PhaseTimer()).to_metrics()
    assert metrics["rollout/tis_weight_mean"] == pytest.approx(1.0) and metrics["rollout/tis_capped_frac"] == 0.0


def test_step_results_carry_the_agreement():
    rollouts = RolloutStats(reward_mean=0.5, rule_acc=0.5, rule_unverifiable=0.0, response_length=3.0,
                            engine=EngineAgreement(diff_mean=0.01, diff_max=0.2, kl=1e-4, tis_weight_mean=0.99,
                                                   tis_capped_frac=0.001))
    policy = PolicyUpdate(loss=0.0, kl=0.0, ratio_mean=1.0, clip_frac=0.0, entropy=1.0, grad_norm=1.0, skipped=0,
                          lr=0.1)
    metrics = StepResult(rollouts, policy).to_metrics()
    assert {k: metrics[k] for k in metrics if k.startswith("rollout/")} == {
        "rollout/logprob_diff_mean": 0.01, "rollout/logprob_diff_max": 0.2, "rollout/logprob_kl": 1e-4,
        "rollout/tis_weight_mean": 0.99, "rollout/tis_capped_frac": 0.001}
    assert set(metrics) <= set(SCHEMA)


def test_sglang_logprobs_reach_the_policy_batch():
    """The trainer's sampling asks SGLang for log-probabilities (``return_logprob``); each output's
    ``meta_info.output_token_logprobs`` become the batch's engine log-probabilities of its response."""
    run = SimpleNamespace(cfg=load_config(None, []))
    params = step.Run.sampling(run, seed=5)
    assert params.logprobs is True
    fake = FakeOfflineEngine()
    outs = SGLangEngine(engine=fake, tp_size=1).generate([[1, 2, 3], [4, 5], [6]], params)
    assert fake.calls[0][1]["return_logprob"] is True
    batch = build_token_batch([[1, 2, 3], [4, 5], [6]], [o.token_ids for o in outs], pad_id=0,
                              response_logprobs=[o.logprobs for o in outs])
    for row, (prompt, raw) in enumerate(zip((3, 2, 1), GENERATE_RESPONSE)):
        expected = [e[0] for e in raw["meta_info"]["output_token_logprobs"]]
        got = batch.engine_logp[row, prompt - 1:prompt - 1 + len(expected)].tolist()
        assert got == pytest.approx(expected), row
