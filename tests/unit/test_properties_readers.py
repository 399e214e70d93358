"""Property-based tests (hypothesis) of the dataset readers: prompts, VerifyBench items and
labeled RM triples, from JSONL and Parquet.

Each row is generated with arbitrary values for the schema's fields (missing, null, text of any
Unicode including lone surrogates, empty, whitespace-only and huge text, integers, floats
including NaN and infinities, booleans, lists, objects), plus lines that are not rows at all
(invalid UTF-8, broken or non-object JSON, repeated keys, nesting beyond the parser's depth,
integers beyond Python's digit limit, blank lines). An independent model of the documented
schema says, per row, what the reader must return; the readers must agree with it exactly:
either the right record, or a ``ValueError`` naming the file and line/row of the first bad row
(``skip_malformed=False``), or that row counted as skipped (``skip_malformed=True``). Any other
exception type fails the test.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cooper_mcore.data.datasets import read_prompts
from cooper_mcore.data.rm_data import read_rm_examples, read_verifybench

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MALFORMED = object()  # the model's verdict for a row the reader must reject
MISSING = object()  # a field left out of the row

# --------------------------------------------------------------------------- the schemas (model)

# Each reader: (function, [(field, kind)], output attribute per field). Kinds follow the
# docstrings of datasets.py / rm_data.py.
READERS = {
    "prompts": (read_prompts, [("question", "text"), ("answer", "text_or_number"), ("id", "id"),
                               ("source", "opt_text")],
                {"question": "question", "answer": "answer", "source": "source"}),
    "verifybench": (read_verifybench, [("question", "text"), ("answer", "text_or_number"), ("completion", "text"),
                                       ("gold_correct", "bool"), ("answer_type", "opt_text"),
                                       ("answer_subtype", "opt_text"), ("id", "id")],
                    {"question": "question", "answer": "reference", "completion": "completion",
                     "gold_correct": "label", "answer_type": "answer_type",
                     "answer_subtype": "answer_subtype"}),
    "rm": (read_rm_examples, [("question", "text"), ("reference", "text_or_number"), ("completion", "text"),
                              ("label", "bool01"), ("answer_type", "opt_text"), ("id", "id")],
           {"question": "question", "reference": "reference", "completion": "completion", "label": "label",
            "answer_type": "answer_type"}),
}


def _valid_text(v: Any) -> bool:
    if not isinstance(v, str) or not v.strip():
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def model_field(kind: str, v: Any) -> Any:
    """What the reader must make of value ``v`` (MISSING when absent) of a field of ``kind``."""
    absent = v is MISSING or v is None
    if kind == "text":
        return v if not absent and _valid_text(v) else MALFORMED
    if kind == "text_or_number":
        if absent:
            return MALFORMED
        if _is_number(v):
            return str(v) if math.isfinite(v) else MALFORMED
        return v if _valid_text(v) else MALFORMED
    if kind == "bool":
        return v if isinstance(v, bool) else MALFORMED
    if kind == "bool01":
        if isinstance(v, bool):
            return v
        if _is_number(v) and v in (0, 1):
            return bool(v)
        return MALFORMED
    if kind in ("opt_text", "id"):
        if absent:
            return None
        if kind == "id" and isinstance(v, int) and not isinstance(v, bool):
            return str(v)
        if not isinstance(v, str):
            return MALFORMED
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return MALFORMED
        return v
    raise AssertionError(kind)


def model_rows(reader: str, rows: list[Any], base: str) -> list[Any]:
    """Per row: MALFORMED, None (blank line: not a row), or (id, {attribute: value})."""
    _, fields, attrs = READERS[reader]
    out: list[Any] = []
    seen: set[str] = set()
    for lineno, row in enumerate(rows, start=1):
        if row is None:
            out.append(None)
            continue
        if not isinstance(row, dict):  # a garbage line
            out.append(MALFORMED)
            continue
        values = {f: model_field(k, row.get(f, MISSING)) for f, k in fields}
        if any(v is MALFORMED for v in values.values()):
            out.append(MALFORMED)
            continue
        row_id = values.pop("id") or f"{base}:{lineno}"
        if row_id in seen:
            out.append(MALFORMED)
            continue
        seen.add(row_id)
        out.append((row_id, {attrs[f]: v for f, v in values.items()}))
    return out


# --------------------------------------------------------------------------- strategies

_SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)
_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(st.one_of(st.characters(), _SURROGATE), min_size=1, max_size=10),
    st.sampled_from(["", " ", "\t\n", "\u3000", "x", "42", "\\frac{1}{2}", "0"]),
    st.sampled_from([10**4, 2 * 10**5]).map(lambda n: "9" * n),  # huge strings
)
_NUMBER = st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, 1, 0.0, 1.0, -0.0]))
_VALUE = st.one_of(
    st.just(MISSING), st.none(), _TEXT, _TEXT, _NUMBER, st.booleans(),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def _row(draw, reader: str) -> dict:
    _, fields, _ = READERS[reader]
    good = draw(st.booleans())  # half the rows start from a valid row, then may lose a field
    row: dict[str, Any] = {}
    for f, kind in fields:
        if good and draw(st.integers(0, 5)) > 0:
            v = {"text": "q", "text_or_number": draw(st.sampled_from(["7", 7, 2.5])), "bool": True,
                 "bool01": draw(st.sampled_from([True, 0, 1.0])), "opt_text": MISSING,
                 "id": MISSING}[kind]
            if kind == "text":
                v = draw(st.one_of(st.just("What is 2+2?"), st.text(min_size=1, max_size=20)))
            elif kind == "id":
                v = draw(st.one_of(st.just(MISSING), st.integers(0, 5), st.sampled_from(["a", "b"])))
        else:
            v = draw(_VALUE)
        if v is not MISSING:
            row[f] = v
    if draw(st.booleans()):
        row["extra"] = draw(_VALUE.filter(lambda x: x is not MISSING))
    return row


_BROKEN_LINES = st.one_of(
    st.binary(min_size=1, max_size=20).map(lambda b: b"\xff" + b),  # never valid UTF-8
    st.sampled_from([b"{", b"{\"question\": ", b"[1, 2]", b"42", b"\"text\"", b"null", b"true",
                     b"{\"question\": \"q\", \"question\": \"r\", \"answer\": \"1\"}",  # repeated key
                     b"{\"question\": \"q\", \"answer\": " + b"1" * 5000 + b"}",  # beyond the digit limit
                     b"{\"question\": " + b"[" * 50000 + b"]" * 50000 + b", \"answer\": \"1\"}",  # too deep
                     b"{'question': 'single quotes'}", b"{\"question\": \"a\x00\"}"]),
)


def _encode(row: dict, ensure_ascii: bool) -> bytes:
    text = json.dumps(row, ensure_ascii=ensure_ascii, allow_nan=True)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: only the \\u escape can carry it
        return json.dumps(row, ensure_ascii=True, allow_nan=True).encode("utf-8")


@st.composite
def jsonl_file(draw, reader: str) -> tuple[list[bytes], list[Any]]:
    """(lines, what each line holds for the model: a dict, a garbage marker or None for blank)."""
    lines: list[bytes] = []
    rows: list[Any] = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["row", "row", "row", "broken", "blank"]))
        if kind == "row":
            line = _encode(draw(_row(reader)), draw(st.booleans()))
            lines.append(line)
            rows.append(json.loads(line))  # the values as JSON carries them (\\ud800\\udc00 is one character)
        elif kind == "broken":
            lines.append(draw(_BROKEN_LINES))
            rows.append("garbage")
        else:
            lines.append(draw(st.sampled_from([b"", b"   ", b"\t", b"\r"])))
            rows.append(None)
    return lines, rows


# --------------------------------------------------------------------------- checks


def _check_against_model(reader: str, path: str, rows: list[Any], where_kind: str, start: int) -> None:
    fn, _, _ = READERS[reader]
    base = os.path.basename(path)
    expected = model_rows(reader, rows, base) if where_kind == "line" else _model_parquet(reader, rows, base)
    good = [e for e in expected if e is not None and e is not MALFORMED]
    bad = [i for i, e in enumerate(expected) if e is MALFORMED]
    # skip_malformed=True: exactly the model's records, and the malformed rows counted
    if good:
        items, skipped = fn(path, skip_malformed=True)
        assert skipped == len(bad)
        assert len(items) == len(good)
        for item, (row_id, attrs) in zip(items, good):
            assert item.id == row_id
            for attr, value in attrs.items():
                got = getattr(item, attr)
                assert got == value and type(got) is type(value), (attr, got, value)
    else:
        with pytest.raises(ValueError, match="no valid"):
            fn(path, skip_malformed=True)
    # skip_malformed=False: the first malformed row is named by file and line/row
    if bad:
        with pytest.raises(ValueError) as info:
            fn(path)
        assert f"{path}:{where_kind} {bad[0] + start}:" in str(info.value)
    elif good:
        assert len(fn(path)[0]) == len(good)


@pytest.mark.parametrize("reader", sorted(READERS))
@SETTINGS
@given(data=st.data())
def test_jsonl_readers_match_the_schema_model(reader, data):
    lines, rows = data.draw(jsonl_file(reader))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.jsonl")
        with open(path, "wb") as f:
            f.write(b"\n".join(lines) + b"\n")
        _check_against_model(reader, path, rows, "line", 1)


@SETTINGS
@given(blob=st.binary(max_size=300))
def test_arbitrary_bytes_give_records_or_a_named_value_error(blob):
    """No model here: whatever the bytes, the only possible failure is a ValueError naming the file."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.jsonl")
        with open(path, "wb") as f:
            f.write(blob)
        for fn, _, _ in READERS.values():
            for skip in (False, True):
                try:
                    items, skipped = fn(path, skip_malformed=skip)
                except ValueError as e:
                    assert path in str(e)
                else:
                    assert items and skipped >= 0


def test_bom_first_line_and_crlf_are_accepted(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "q1", "answer": 1}\r\n{"question": "q2", "answer": "b"}\r\n')
    prompts, skipped = read_prompts(str(path))
    assert [(p.question, p.answer, p.id) for p in prompts] == [("q1", "1", "p.jsonl:1"), ("q2", "b", "p.jsonl:2")]
    path.write_bytes(b'{"question": "q1", "answer": 1}\n\xef\xbb\xbf{"question": "q2", "answer": "b"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:line 2: invalid JSON"):  # a BOM only starts a file
        read_prompts(str(path))


def test_the_pathological_lines_each_name_their_line(tmp_path):
    cases = {
        b"\xff\xfe": "not valid UTF-8",
        b'{"question": "q", "question": "r", "answer": "1"}': "duplicate key 'question'",
        b'{"question": "q", "answer": ' + b"1" * 5000 + b"}": "integer string conversion",
        b'{"question": ' + b"[" * 100000 + b"]" * 100000 + b', "answer": "1"}': "nested too deeply",
        b'{"question": "\\ud800", "answer": "1"}': "not valid Unicode text",
    }
    for line, why in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_bytes(b'{"question": "ok", "answer": "1"}\n' + line + b"\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:line 2: .*{why}"):
            read_prompts(str(path))
        assert read_prompts(str(path), skip_malformed=True)[1] == 1


# --------------------------------------------------------------------------- Parquet

_PA_TYPES = {"string": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
             "binary": pa.binary()}


@st.composite
def parquet_columns(draw, reader: str) -> tuple[dict[str, tuple[str, list]], int]:
    """{field: (arrow type name, values)} with ``n`` rows; some fields absent, nulls anywhere,
    string cells that may hold invalid UTF-8 (bytes cast without validation)."""
    _, fields, _ = READERS[reader]
    n = draw(st.integers(1, 6))
    cols: dict[str, tuple[str, list]] = {}
    for f, kind in fields:
        natural = {"text": "string", "text_or_number": "string", "bool": "bool", "bool01": "bool",
                   "opt_text": "string", "id": "string"}[kind]
        if draw(st.integers(0, 6)) == 0 and kind not in ("opt_text", "id"):
            continue  # a required column missing
        typ = natural if draw(st.integers(0, 3)) else draw(st.sampled_from(sorted(_PA_TYPES)))
        cell = {"string": st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "7"]),
                                    st.binary(max_size=4).map(lambda b: (b"\xc3(" + b))),  # invalid UTF-8
                "int": st.integers(-2**63, 2**63 - 1), "float": st.floats(), "bool": st.booleans(),
                "binary": st.binary(max_size=6)}[typ]
        if kind == "id" and typ == "string":
            cell = st.one_of(cell, st.sampled_from(["a", "b"]))
        cols[f] = (typ, draw(st.lists(st.one_of(st.none(), cell, cell, cell), min_size=n, max_size=n)))
    return cols, n


def _model_parquet(reader: str, rows: list[Any], base: str) -> list[Any]:
    """The JSONL model with 0-based row ids; undecodable rows are malformed."""
    _, fields, attrs = READERS[reader]
    out: list[Any] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            out.append(MALFORMED)
            continue
        values = {f: model_field(k, row.get(f, MISSING)) for f, k in fields}
        if any(v is MALFORMED for v in values.values()):
            out.append(MALFORMED)
            continue
        row_id = values.pop("id") or f"{base}:{i}"
        if row_id in seen:
            out.append(MALFORMED)
            continue
        seen.add(row_id)
        out.append((row_id, {attrs[f]: v for f, v in values.items()}))
    return out


@pytest.mark.parametrize("reader", sorted(READERS))
@SETTINGS
@given(data=st.data())
def test_parquet_readers_match_the_schema_model(reader, data):
    cols, n = data.draw(parquet_columns(reader))
    arrays, names = [], []
    rows: list[Any] = [{} for _ in range(n)]
    for f, (typ, values) in cols.items():
        if typ == "string":  # bytes cells: write them unvalidated into a string column
            raw = [v.encode("utf-8", "surrogatepass") if isinstance(v, str) else v for v in values]
            arr = pa.array(raw, pa.binary()).cast(pa.string(), safe=False)
            for i, v in enumerate(raw):
                if isinstance(rows[i], dict):
                    try:
                        rows[i][f] = None if v is None else v.decode("utf-8")
                    except UnicodeDecodeError:
                        rows[i] = "undecodable"
        else:
            arr = pa.array(values, _PA_TYPES[typ])
            for i, v in enumerate(values):
                if isinstance(rows[i], dict):
                    rows[i][f] = v
        arrays.append(arr)
        names.append(f)
    if not names:
        arrays, names = [pa.array([0] * n)], ["unrelated"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "rows.parquet")
        pq.write_table(pa.Table.from_arrays(arrays, names=names), path)
        _check_against_model(reader, path, rows, "row", 0)


@SETTINGS
@given(cut=st.floats(0.0, 0.999), flip=st.booleans())
def test_truncated_or_corrupt_parquet_is_a_named_value_error(cut, flip):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.parquet")
        pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["1", "2"]}), path)
        data = open(path, "rb").read()
        data = data[: int(len(data) * cut)] if not flip else data[:-12] + bytes(12)
        with open(path, "wb") as f:
            f.write(data)
        for fn, _, _ in READERS.values():
            with pytest.raises(ValueError, match="cannot read Parquet file") as info:
                fn(path)
            assert path in str(info.value)
