"""Hybrid annotation: judge-answer parsing, and agreement of the rule verifier with an LLM judge
served by the local test chat server."""

import json
import re
from dataclasses import dataclass
from typing import Optional

import pytest

from cooper_mcore.data.templates import RM_HEAD_CHARS, RM_TAIL_CHARS
from cooper_mcore.jobs.annotate import JUDGE_SYSTEM_PROMPT, annotate, judge_messages, parse_judgement
from cooper_mcore.llm_client import OpenAIChatClient
from tests.chat_server import ChatServer


@pytest.mark.parametrize("text,expected", [
    ("yes", True), ("No", False), ("Yes.", True), ("**No**", False), ("  YES, it matches", True),
    ("no - the final answer is 4, not 5; yes the steps are fine", False),  # the first word decides
    ("The completion's answer equals the reference, so: yes", True),
    ("Final answer: no", False), ("Verdict: **yes**", True), ("\\boxed{no}", False),
    ("I compared both.\nAnswer: yes", True),
    ("<think>Is 1/2 = 0.5? no wait, yes it is</think>\nyes", True),
    ("<think>The reference is 3 and the completion says 3, so no problem</think> No", False),
    ("<think>still thinking, no", None),  # unterminated reasoning: no verdict
    ("maybe", None), ("either no, hard to say: maybe yes maybe no", None),
    ("", None), (None, None), ("...", None), ("nope", None), ("yesterday", None),
])
def test_parse_judgement(text, expected):
    assert parse_judgement(text) is expected


def test_judge_messages():
    long = "a" * 600 + "b" * 500 + "c" * 1000
    system, user = judge_messages("What is {x}?", "\\frac{1}{2}", long)
    assert system == {"role": "system", "content": JUDGE_SYSTEM_PROMPT}
    assert user["role"] == "user"
    text = user["content"]
    assert "<question>\nWhat is {x}?\n</question>" in text  # braces are kept as they are
    assert "<reference_answer>\n\\frac{1}{2}\n</reference_answer>" in text
    completion = re.search(r"<completion>\n(.*)\n</completion>", text, re.S).group(1)
    assert completion == "a" * RM_HEAD_CHARS + "c" * RM_TAIL_CHARS
    assert "b" * 500 in judge_messages("q", "r", long, truncate=False)[1]["content"]


@dataclass
class _Outcome:
    correct: Optional[bool]


class StubVerifier:
    """Verdicts by completion text; records its calls."""

    def __init__(self, verdicts):
        self.verdicts = verdicts
        self.calls = []

    def verify_batch(self, golds, preds):
        self.calls.append((list(golds), list(preds)))
        return [_Outcome(self.verdicts[p]) for p in preds]


def _completion_of(body):
    return re.search(r"<completion>\n(.*)\n</completion>", body["messages"][-1]["content"], re.S).group(1)


# completion -> (rule verdict, judge reply)
CASES = {
    "c1": (True, "Yes"), "c2": (True, "no"), "c3": (True, "maybe"),
    "c4": (False, "yes"), "c5": (False, "No."), "c6": (False, ""),
    "c7": (None, "yes"), "c8": (None, "no"), "c9": (None, "<think>hmm"),
    "c10": (True, "<think>it's no... wait</think>\n**Yes**"), "c11": (False, "Final answer: no"),
}


def test_annotate_agreement_table_and_kept_rows(tmp_path):
    src = tmp_path / "in.jsonl"
    rows = [{"id": i, "question": f"q{i}", "ref": f"r{i}", "completion": c, "source": "s"}
            for i, c in enumerate(CASES)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, json.dumps({"question": "q", "ref": "r"}))  # malformed: no completion
    src.write_text("\n".join(lines) + "\n")
    verifier = StubVerifier({c: v for c, (v, _) in CASES.items()})
    out, audit = tmp_path / "out.jsonl", tmp_path / "audit.jsonl"
    with pytest.raises(ValueError, match=r"in\.jsonl:line 4: missing field 'completion'"):
        annotate(str(src), str(out), None, verifier, reference_key="ref")
    with ChatServer(canned=lambda body: CASES[_completion_of(body)][1]) as server, \
            OpenAIChatClient(server.url, "judge-model", api_key_env=None, max_retries=0) as client:
        stats = annotate(str(src), str(out), client, verifier, reference_key="ref", skip_malformed=True,
                         chunk_size=4, judgements_path=str(audit))
        requests = list(server.requests)
    assert stats["table"] == {"true": {"true": 2, "false": 1, "none": 1},
                              "false": {"true": 1, "false": 2, "none": 1},
                              "none": {"true": 1, "false": 1, "none": 1}}
    assert stats["rows"] == 11 and stats["skipped_malformed"] == 1
    assert stats["both_decided"] == 6 and stats["agreed"] == 4
    assert stats["agreement_rate"] == pytest.approx(4 / 6)
    assert (stats["kept"], stats["kept_correct"], stats["kept_incorrect"]) == (4, 2, 2)
    assert (stats["dropped_disagree"], stats["dropped_rule_unverifiable"], stats["dropped_judge_unparseable"]) \
        == (2, 3, 2)
    assert stats["judge_failed"] == 0
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert kept == [dict(rows[i], label=lab) for i, lab in ((0, True), (4, False), (9, True), (10, False))]
    # the verifier got gold = reference, pred = completion, in chunks of 4
    assert [len(p) for _, p in verifier.calls] == [4, 4, 3]
    assert verifier.calls[0] == (["r0", "r1", "r2", "r3"], ["c1", "c2", "c3", "c4"])
    assert len(requests) == 11
    body = next(r.body for r in requests if _completion_of(r.body) == "c5")
    assert body["model"] == "judge-model" and body["temperature"] == 0.0 and body["max_tokens"] == 16
    assert body["messages"] == judge_messages("q4", "r4", "c5")
    verdicts = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [v["kept"] for v in verdicts] == [c in ("c1", "c5", "c10", "c11") for c in CASES]
    assert verdicts[2] == {"index": 2, "rule": True, "judge": None, "judge_text": "maybe", "kept": False}


class _FailingJudge:
    def chat_batch(self, batch, temperature, max_tokens):
        return [None if i % 2 else "yes" for i in range(len(batch))]


def test_annotate_real_verifier_parquet_and_failed_requests(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from cooper_mcore.verify.rule import RuleVerifier

    src = tmp_path / "in.parquet"
    rows = [{"question": "1+1=", "reference": "2", "completion": "1+1=2 \\boxed{2}"},
            {"question": "2+2=", "reference": "4", "completion": "so \\boxed{4}"},
            {"question": "3+3=", "reference": "6", "completion": "\\boxed{5}"},
            {"question": "4+4=", "reference": "8", "completion": "\\boxed{9}"}]
    pq.write_table(pa.Table.from_pylist(rows), src)
    out = tmp_path / "out.parquet"
    with RuleVerifier(timeout_s=20.0, num_workers=1) as verifier:
        stats = annotate(str(src), str(out), _FailingJudge(), verifier)
    # rule: T, T, F, F; judge: yes, (failed), yes, (failed)
    assert stats["table"]["true"] == {"true": 1, "false": 0, "none": 1}
    assert stats["table"]["false"] == {"true": 1, "false": 0, "none": 1}
    assert stats["judge_failed"] == 2 and stats["kept"] == 1 and stats["agreement_rate"] == 0.5
    assert pq.read_table(out).to_pylist() == [dict(rows[0], label=True)]
    with pytest.raises(ValueError, match="must differ"):
        annotate(str(src), str(src), _FailingJudge(), verifier)
