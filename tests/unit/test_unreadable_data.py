"""Data whose references the rule verifier cannot read says so: a warning at start naming the share and
the data file (:mod:`cooper_mcore.rl.references`), and a run that gets no rule verdict for
``train.max_steps_without_signal`` steps in a row stops with one line, exit code 2, its checkpoint kept
(that run, the tiny preset through `cooper train`, is a case of the bad-input tier:
``tests/badinput/training.py``)."""

from __future__ import annotations

import logging

import pytest

from cooper_mcore.rl import references
from cooper_mcore.rl.references import check_references, unreadable_share
from cooper_mcore.types import Prompt
from cooper_mcore.verify.rule import RuleVerifier

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
