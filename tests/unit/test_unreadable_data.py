"""Data whose references the rule verifier cannot read says so: a warning at start naming the share and
the data file (:mod:`cooper_mcore.rl.references`), and a run that gets no rule verdict for
``train.max_steps_without_signal`` steps in a row stops with one line, exit code 2, its checkpoint kept
(the tiny preset, in process)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from cooper_mcore.cli import main as cli_main
from cooper_mcore.data.datasets import read_prompts, write_prompts
from cooper_mcore.data.mathgen import unreadable_reference
from cooper_mcore.demo.assets import build_tiny_assets
from cooper_mcore.rl import references
from cooper_mcore.rl.references import check_references, unreadable_share
from cooper_mcore.types import Prompt
from cooper_mcore.verify.rule import RuleVerifier
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)

#: references of 14 and whether the rule verifier can read them
REFERENCES = [("14", True), ("\\frac{1}{2}", True), ("\\text{14.}", False), ("fourteen", False),
              ("\\boxed{14.}", False), ("I don't know", False)]


@pytest.fixture(scope="module")
def verifier():
    with RuleVerifier(timeout_s=10.0, num_workers=1) as v:
        yield v


def _prompts(answers: list[str]) -> list[Prompt]:
    return [Prompt(id=f"p{i}", question="3*4+2=", answer=a) for i, a in enumerate(answers)]


def test_the_share_of_references_the_rule_cannot_read(verifier):
    share, unreadable = unreadable_share(verifier, _prompts([a for a, _ in REFERENCES]))
    assert share == pytest.approx(4 / 6)
    assert [p.answer for p in unreadable] == [a for a, readable in REFERENCES if not readable]
    with pytest.raises(ValueError, match="no prompts"):
        unreadable_share(verifier, [])


def test_the_start_check_warns_above_half_and_names_the_data(verifier, caplog, monkeypatch):
    unreadable = [a for a, readable in REFERENCES if not readable]
    with caplog.at_level(logging.INFO, logger="cooper_mcore.rl.references"):
        assert check_references(verifier, _prompts(unreadable + ["14"]), "data/train.jsonl") == pytest.approx(0.8)
        assert check_references(verifier, _prompts(["14", "15", "16", "fourteen"]), "d.jsonl") == 0.25
        assert check_references(verifier, _prompts(["14", "15"]), "ok.jsonl") == 0.0  # all read: nothing said
        assert check_references(verifier, [], "empty.jsonl") == 0.0
        monkeypatch.setattr(references, "CHECKED_PROMPTS", 2)  # only the data file's first prompts are checked
        assert check_references(verifier, _prompts(["14", "15", "fourteen"]), "head.jsonl") == 0.0
    records = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(records) == 2
    assert records[0][0] == logging.WARNING and "4 of the first 5 prompts (80%) of data.train_path data/train.jsonl" \
        in records[0][1] and "p0: '\\\\text{14.}'" in records[0][1]
    assert records[1][0] == logging.INFO
    assert "1 of the first 4 prompts (25%) of data.train_path d.jsonl" in records[1][1]


def test_a_run_on_references_the_rule_cannot_read_warns_then_stops(tmp_path, caplog):
    """reward.mode=rule on the tiny preset, every reference ``\\\\text{N.}``: a warning before step 1 (100%, the
    file), then after 2 steps without a verdict one error line, exit code 2, the checkpoint of step 2 kept."""
    assets = build_tiny_assets(str(tmp_path / "assets"), n_train=32, n_eval=4, sft_steps=0)
    prompts, _ = read_prompts(assets["train"])
    write_prompts([dataclasses.replace(p, answer=unreadable_reference(int(p.answer))) for p in prompts],
                  assets["train"])
    out = tmp_path / "run"
    args = ["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--out", str(out),
            f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"data.train_path={assets['train']}", f"data.eval_path={assets['eval']}", "logging.wandb=false",
            "reward.mode=rule", "train.steps=3", "train.max_steps_without_signal=2", "eval.every=0",
            "checkpoint.every=0", "rollout.max_new_tokens=4"]
    with caplog.at_level(logging.INFO):
        assert cli_main(args) == 2
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    start = [m for lvl, m in messages if lvl == logging.WARNING and "cannot read the reference" in m]
    assert len(start) == 1 and f"32 of the first 32 prompts (100%) of data.train_path {assets['train']}" in start[0]
    (stop,) = [m for lvl, m in messages if lvl == logging.ERROR]
    assert stop.startswith("stopping: 2 steps in a row without a rule verdict on any rollout (100% of the last step's")
    assert "reward.mode=rule has no reward to train on" in stop and assets["train"] in stop and "\n" not in stop
    assert str(out / "checkpoints" / "step_2") in stop and (out / "checkpoints" / "step_2").is_dir()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["rule/gold_unreadable"], x["rule/unverifiable"]) for x in lines] == [(1, 1.0, 1.0),
                                                                                               (2, 1.0, 1.0)]
