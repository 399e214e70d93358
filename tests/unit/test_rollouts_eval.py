"""Rollouts and held-out evaluation (cooper_mcore.rl.rollouts) in a world of one process with a fake
engine: the rule verifier's ``answered`` reaches the samples, and evaluation by an oracle counts the
oracle's verdicts as ``correct`` and the rule's as ``rule_correct``, and saves both per completion."""

from __future__ import annotations

import json
import os
import re

import pytest

from cooper_mcore.config.checks import config_problems, validate
from cooper_mcore.config.schema import load_config
from cooper_mcore.rl.rollouts import EvalResult, eval_samples_path, evaluate, generate_groups
from cooper_mcore.rollout.base import GenerateOutput, SamplingParams
from cooper_mcore.types import Prompt
from cooper_mcore.verify.oracle import ArithmeticOracle
from cooper_mcore.verify.rule import RuleVerifier

pytestmark = pytest.mark.timeout(180)

# per prompt, the completions the fake engine writes in turn (k = 3)
COMPLETIONS = {
    0: ["7 + 7 = \\boxed{14}", "7 + 7 = \\boxed{14.}", "7 + 7 = \\boxed{15}"],  # rule 1/3, oracle 2/3
    1: ["2 * 5 = \\boxed{10.}", "2 * 5 = \\boxed{10}", "no idea"],  # rule 1/3, oracle 2/3
}
PROMPTS = [Prompt(id="p0", question="What is 7 + 7?", answer="14", token_ids=[0]),
           Prompt(id="p1", question="What is 2 * 5?", answer="10", token_ids=[1])]


class FakeEngine:
    """Writes each prompt's canned completions in turn (the prompt is its first token id)."""

    weight_version = 0

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def generate(self, prompts, params):
        outs = []
        for ids in prompts:
            n = self.seen.get(ids[0], 0)
            self.seen[ids[0]] = n + 1
            text = COMPLETIONS[ids[0]][n % len(COMPLETIONS[ids[0]])]
            outs.append(GenerateOutput(token_ids=[5, 6], text=text, logprobs=None, finish_reason="stop"))
        return outs


@pytest.fixture(scope="module")
def verifier():
    with RuleVerifier(timeout_s=10.0, num_workers=1) as v:
        yield v


def test_generate_groups_sets_rule_answered(world, verifier):
    groups = generate_groups(FakeEngine(), verifier, PROMPTS, 3, SamplingParams(), version=2)
    got = [[(s.rule_correct, s.rule_answered) for s in g.samples] for g in groups]
    assert got == [[(True, True), (False, False), (False, True)], [(False, False), (True, True), (False, False)]]


def test_evaluate_with_an_oracle_counts_both_and_saves_the_samples(world, verifier, tmp_path):
    path = eval_samples_path(str(tmp_path), 4)
    assert path == os.path.join(str(tmp_path), "eval_samples", "step_4.jsonl")  # dp 1: no replica suffix
    result = evaluate(FakeEngine(), verifier, PROMPTS, 3, SamplingParams(), oracle=ArithmeticOracle(),
                      samples_path=path)
    assert result == EvalResult(correct=4, total=6, rule_correct=2)
    assert result.accuracy == pytest.approx(4 / 6) and result.rule_accuracy == pytest.approx(2 / 6)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert [list(r) for r in rows] == [["prompt_id", "question", "reference", "completion", "rule_correct",
                                        "correct"]] * 6
    assert rows[1] == {"prompt_id": "p0", "question": "What is 7 + 7?", "reference": "14",
                       "completion": "7 + 7 = \\boxed{14.}", "rule_correct": False, "correct": True}
    assert [(r["prompt_id"], r["completion"]) for r in rows] == [(p.id, c) for p in PROMPTS
                                                                 for c in COMPLETIONS[int(p.id[1])]]
    assert [(r["rule_correct"], r["correct"]) for r in rows] == [(True, True), (False, True), (False, False),
                                                                 (False, True), (True, True), (False, False)]
    assert os.listdir(os.path.dirname(path)) == ["step_4.jsonl"]  # written atomically: no temporary left


def test_evaluate_without_an_oracle_counts_the_rule(world, verifier, tmp_path):
    path = str(tmp_path / "samples.jsonl")
    result = evaluate(FakeEngine(), verifier, PROMPTS, 3, SamplingParams(), samples_path=path)
    assert result == EvalResult(correct=2, total=6, rule_correct=2)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert all(r["correct"] == r["rule_correct"] for r in rows) and sum(r["correct"] for r in rows) == 2
    assert evaluate(FakeEngine(), verifier, PROMPTS, 1, SamplingParams()) == EvalResult(1, 2, 1)  # nothing saved


def test_eval_settings_load_and_a_bad_checker_is_refused(tmp_path):
    assert (load_config().eval.verifier, load_config().eval.save_samples) == ("rule", False)
    preset = tmp_path / "p.yaml"
    preset.write_text("eval:\n  verifier: arithmetic_oracle\n  save_samples: true\n")
    cfg = load_config(str(preset))
    assert (cfg.eval.verifier, cfg.eval.save_samples) == ("arithmetic_oracle", True)
    cfg = load_config(None, ["eval.verifier=arithmetic_oracle", "eval.save_samples=true"])
    assert (cfg.eval.verifier, cfg.eval.save_samples) == ("arithmetic_oracle", True)
    bad = load_config(None, ["eval.verifier=oracle"])
    message = "eval.verifier must be one of ('rule', 'arithmetic_oracle'), got 'oracle'"
    assert message in config_problems(bad, 1)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(bad, 1)
    with pytest.raises(ValueError, match="save_samples"):
        load_config(None, ["eval.save_samples=maybe"])


def test_the_oracle_is_built_on_leaders_for_integer_golds_only(world):
    from cooper_mcore.rl.setup import build_eval_oracle

    on = load_config(None, ["eval.every=1", "eval.verifier=arithmetic_oracle", "data.eval_path=held_out.jsonl"])
    assert isinstance(build_eval_oracle(on, PROMPTS), ArithmeticOracle)  # a world of one: this rank leads
    assert build_eval_oracle(load_config(None, ["eval.every=1"]), PROMPTS) is None  # the rule verifier
    assert build_eval_oracle(load_config(None, ["eval.verifier=arithmetic_oracle"]), PROMPTS) is None  # no eval
    odd = [*PROMPTS, Prompt(id="p2", question="Half of 1?", answer="\\frac{1}{2}")]
    with pytest.raises(ValueError, match=r"integer gold answers.*'p2' of held_out.jsonl.*eval.verifier=rule"):
        build_eval_oracle(on, odd)


class FakeRun:
    """What :func:`cooper_mcore.rl.loop.run_evaluation` reads of a Run."""

    def __init__(self, out: str, verifier, oracle, *overrides: str) -> None:
        self.cfg = load_config(None, [f"out={out}", "eval.every=1", "eval.k=3", *overrides])
        self.step, self.verifier, self.oracle, self.eval_prompts = 3, verifier, oracle, PROMPTS

    def eval_sampling(self) -> SamplingParams:
        return SamplingParams()


def test_run_evaluation_logs_the_rule_beside_the_oracle(world, verifier, tmp_path):
    from cooper_mcore.rl.loop import run_evaluation
    from cooper_mcore.rl.run_folder import RUN_FILES

    run = FakeRun(str(tmp_path), verifier, ArithmeticOracle(), "eval.verifier=arithmetic_oracle",
                  "eval.save_samples=true")
    metrics = run_evaluation(run, FakeEngine())
    assert metrics == {"eval/acc": pytest.approx(4 / 6), "eval/rule_acc": pytest.approx(2 / 6)}
    assert os.listdir(tmp_path / "eval_samples") == ["step_3.jsonl"]
    assert "eval_samples" in RUN_FILES  # --overwrite deletes them with the rest of the old run
    plain = FakeRun(str(tmp_path / "plain"), verifier, None)
    assert run_evaluation(plain, FakeEngine()) == {"eval/acc": pytest.approx(2 / 6)}
    assert not (tmp_path / "plain").exists()  # eval.save_samples is off by default
