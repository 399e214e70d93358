"""read_prompts / write_prompts: schema, malformed rows named by file and line, Parquet round trips."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cooper_mcore.data.datasets import read_prompts, write_prompts
from cooper_mcore.types import Prompt


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_fields_defaults_and_numbers(tmp_path):
    path = _write_lines(tmp_path / "p.jsonl", [
        json.dumps({"id": "a", "question": "1+1=", "answer": "2", "source": "toy", "extra": [1]}),
        "",  # blank lines are skipped and do not shift line numbers
        json.dumps({"question": "6*7=", "answer": 42}),
        json.dumps({"id": 7, "question": "half of 5?", "answer": 2.5, "source": None}),
    ])
    prompts, skipped = read_prompts(path)
    assert skipped == 0
    assert prompts == [
        Prompt(id="a", question="1+1=", answer="2", source="toy"),
        Prompt(id="p.jsonl:3", question="6*7=", answer="42", source=None),
        Prompt(id="7", question="half of 5?", answer="2.5", source=None),
    ]


def test_custom_keys(tmp_path):
    path = _write_lines(tmp_path / "gsm.jsonl", [json.dumps({"problem": "Q?", "solution": "A", "uid": "u1"})])
    prompts, _ = read_prompts(path, question_key="problem", answer_key="solution", id_key="uid", source_key=None)
    assert prompts == [Prompt(id="u1", question="Q?", answer="A")]
    with pytest.raises(ValueError, match=r"gsm.jsonl:line 1: missing field 'question'"):
        read_prompts(path)


@pytest.mark.parametrize("bad_line, why", [
    ('{"question": "q", "answer": "a"', "invalid JSON"),
    ('["question", "answer"]', "expected a JSON object, got list"),
    ('{"answer": "a"}', "missing field 'question'"),
    ('{"question": "q"}', "missing field 'answer'"),
    ('{"question": "   ", "answer": "a"}', "field 'question' is empty"),
    ('{"question": "q", "answer": ""}', "field 'answer' is empty"),
    ('{"question": 3, "answer": "a"}', "field 'question' must be a string, got int"),
    ('{"question": "q", "answer": true}', "field 'answer' must be a string or a number, got bool"),
    ('{"question": "q", "answer": ["a"]}', "field 'answer' must be a string or a number, got list"),
    ('{"question": "q", "answer": NaN}', "not a finite number"),
    ('{"question": "q", "answer": "a", "id": 1.5}', "field 'id' must be a string or an integer"),
    ('{"question": "q", "answer": "a", "source": 3}', "field 'source' must be a string"),
    ('{"question": "q", "answer": "a", "id": "first"}', "duplicate id 'first'"),
])
def test_malformed_row_names_file_and_line(tmp_path, bad_line, why):
    good = json.dumps({"id": "first", "question": "1+1=", "answer": "2"})
    path = _write_lines(tmp_path / "bad.jsonl", [good, "", good.replace("first", "second"), bad_line])
    with pytest.raises(ValueError) as err:
        read_prompts(path)
    assert f"{path}:line 4: " in str(err.value)
    assert why in str(err.value)


def test_skip_malformed_counts_and_logs(tmp_path, caplog):
    path = _write_lines(tmp_path / "mixed.jsonl", [
        json.dumps({"question": "a", "answer": "1"}),
        "not json",
        json.dumps({"question": "", "answer": "1"}),
        json.dumps({"question": "b", "answer": "2"}),
        json.dumps({"question": "c"}),
    ])
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.data.datasets"):
        prompts, skipped = read_prompts(path, skip_malformed=True)
    assert skipped == 3
    assert [(p.id, p.question) for p in prompts] == [("mixed.jsonl:1", "a"), ("mixed.jsonl:4", "b")]
    assert "mixed.jsonl:line 2" in caplog.text and "mixed.jsonl:line 5" in caplog.text


def test_missing_file_empty_file_and_unknown_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_prompts(str(tmp_path / "nope.jsonl"))
    empty = _write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="no valid prompts"):
        read_prompts(empty)
    all_bad = _write_lines(tmp_path / "allbad.jsonl", ["{}", "{}"])
    with pytest.raises(ValueError, match=r"no valid prompts \(2 malformed rows skipped\)"):
        read_prompts(all_bad, skip_malformed=True)
    csv = tmp_path / "p.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(ValueError, match="unknown data file type"):
        read_prompts(str(csv))


def test_a_directory_is_not_a_data_file(tmp_path):
    folder = tmp_path / "data.jsonl"  # even with a data file's suffix
    folder.mkdir()
    for path in (tmp_path, folder):
        with pytest.raises(ValueError, match=rf"^data file '{path}' is a directory, expected a \.jsonl or \.parquet "
                                             r"file \(give the path of one file: \.jsonl, \.json, \.ndjson, \.parquet, "
                                             r"\.pq\)$"):
            read_prompts(str(path))


def test_parquet_rows_and_typed_columns(tmp_path):
    path = str(tmp_path / "p.parquet")
    pq.write_table(pa.table({
        "question": ["2+2=", "3+3=", None, "5+5="],
        "answer": [4, 6, 8, 10],  # an int64 column: numbers become strings
        "source": ["s", None, "s", "s"],
    }), path)
    with pytest.raises(ValueError, match=r"p.parquet:row 2: missing field 'question'"):
        read_prompts(path)
    prompts, skipped = read_prompts(path, skip_malformed=True)
    assert skipped == 1
    assert prompts == [
        Prompt(id="p.parquet:0", question="2+2=", answer="4", source="s"),
        Prompt(id="p.parquet:1", question="3+3=", answer="6", source=None),
        Prompt(id="p.parquet:3", question="5+5=", answer="10", source="s"),
    ]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_write_read_round_trip(tmp_path, suffix):
    prompts = [Prompt(id=f"x{i}", question=f"{i}+{i}= {{braces}} \\boxed{{}}", answer=str(2 * i),
                      source=None if i % 2 else "gen") for i in range(5)]
    path = str(tmp_path / "sub" / f"out.{suffix}")
    assert write_prompts(prompts, path) == 5
    back, skipped = read_prompts(path)
    assert skipped == 0 and back == prompts
    if suffix == "parquet":  # an independent reader sees the same columns
        assert pq.read_table(path).column("id").to_pylist() == [p.id for p in prompts]
    else:
        with open(path, encoding="utf-8") as f:
            first = json.loads(f.readline())
        assert first == {"id": "x0", "question": prompts[0].question, "answer": "0", "source": "gen"}
