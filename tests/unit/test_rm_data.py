"""Judged-triple readers (VerifyBench format) against the shipped fixture and malformed variants."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cooper_mcore.data.rm_data import RMExample, read_verifybench, summarize

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "verifybench_tiny.jsonl"


def test_fixture_reads_against_raw_json():
    items, skipped = read_verifybench(str(FIXTURE))
    raw = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert skipped == 0 and len(items) == len(raw) == 12
    for it, r in zip(items, raw):
        assert (it.id, it.question, it.completion, it.label) == (
            r["id"], r["question"], r["completion"], r["gold_correct"])
        assert it.reference == str(r["answer"])
        assert (it.answer_type, it.answer_subtype) == (r["answer_type"], r["answer_subtype"])
    assert items[1].reference == "10"  # the fixture has a JSON number as its reference answer
    assert summarize(items) == {
        "expression": {"items": 3, "gold_correct": 2},
        "multiple_choice": {"items": 3, "gold_correct": 1},
        "numeric": {"items": 3, "gold_correct": 2},
        "string": {"items": 3, "gold_correct": 1},
    }
    assert items[0].rm_text() == (
        f"<question>{raw[0]['question']}</question>\n<reference_answer>391</reference_answer>\n"
        f"<completion>{raw[0]['completion']}</completion>"
    )


@pytest.mark.parametrize("row, why", [
    ({"question": "q", "answer": "a", "completion": "c"}, "missing field 'gold_correct'"),
    ({"question": "q", "answer": "a", "completion": "c", "gold_correct": "yes"}, "must be true or false, got str"),
    ({"question": "q", "answer": "a", "completion": "c", "gold_correct": 1}, "must be true or false, got int"),
    ({"question": "q", "answer": "a", "gold_correct": True}, "missing field 'completion'"),
    ({"question": "q", "answer": "a", "completion": "c", "gold_correct": True, "answer_type": 5},
     "field 'answer_type' must be a string"),
])
def test_malformed_rows(tmp_path, row, why):
    good = {"question": "q", "answer": "a", "completion": "c", "gold_correct": False}
    path = tmp_path / "vb.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        read_verifybench(str(path))
    assert f"{path}:line 2: " in str(err.value) and why in str(err.value)
    items, skipped = read_verifybench(str(path), skip_malformed=True)
    assert skipped == 1
    assert items == [RMExample(id="vb.jsonl:1", question="q", reference="a", completion="c", label=False)]


def test_parquet_and_custom_keys(tmp_path):
    path = str(tmp_path / "vb.parquet")
    pq.write_table(pa.table({
        "problem": ["1+1", "2+2"], "gold": ["2", "4"], "output": ["2", "5"], "label": [True, False],
    }), path)
    items, _ = read_verifybench(path, question_key="problem", answer_key="gold", completion_key="output",
                                label_key="label")
    assert [(i.id, i.reference, i.completion, i.label, i.answer_type) for i in items] == [
        ("vb.parquet:0", "2", "2", True, None), ("vb.parquet:1", "4", "5", False, None)]
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_verifybench(str(tmp_path / "missing.jsonl"))
