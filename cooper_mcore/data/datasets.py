"""Prompt datasets read from local JSONL or Parquet files.

Schema (one JSON object per line, or one Parquet row):

=========== ======================= ==========================================================
field       type                    meaning
=========== ======================= ==========================================================
question    non-empty string        the problem statement (required)
answer      string or number        the reference answer (required, non-empty); numbers such
                                    as ``42`` or ``2.5`` are turned into strings
id          string or integer       optional; defaults to ``<file basename>:<line>`` (JSONL,
                                    1-based line) or ``<file basename>:<row>`` (Parquet,
                                    0-based row index); must be unique within the file
source      string                  optional dataset name
=========== ======================= ==========================================================

The field names are configurable (``question_key`` ...), other fields are ignored, blank JSONL
lines are skipped; JSONL is UTF-8 (a byte-order mark on the first line is allowed), one object per
``\\n``-terminated line. A malformed row (invalid UTF-8 or JSON, a key repeated in one object,
not an object, a missing or wrongly typed field, an empty question or answer, text with unpaired
surrogates, a non-finite number, a duplicate id; a Parquet row that cannot be decoded) raises a
:class:`ValueError` naming the file and line (or row), or is skipped, logged and counted when
``skip_malformed=True``.

The row reader and field checks here are shared with :mod:`cooper_mcore.data.verifybench`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from cooper_mcore.types import Prompt

T = TypeVar("T")

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
_PARQUET_BATCH_ROWS = 4096


class MalformedRow(ValueError):
    """A row that does not follow the schema; the message names the file and line or row."""


@dataclass
class RawRow:
    """One row as read from a file, before validation.

    Attributes:
        where: human-readable location, e.g. ``data.jsonl:line 7`` or ``data.parquet:row 3``.
        default_id: ``<basename>:<line>`` (JSONL, 1-based) or ``<basename>:<row>`` (Parquet, 0-based).
        record: the decoded object, or None if the row could not be decoded.
        error: why the row could not be decoded (None when ``record`` is set).
    """

    where: str
    default_id: str
    record: Optional[dict[str, Any]]
    error: Optional[str] = None


def file_format(path: str) -> str:
    """``"jsonl"`` or ``"parquet"`` from the file's suffix.

    Raises:
        ValueError: the suffix is neither.
    """
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise ValueError(
        f"{path}: unknown data file type; expected one of {JSONL_SUFFIXES + PARQUET_SUFFIXES}"
    )


def iter_raw_rows(path: str) -> Iterator[RawRow]:
    """Read the rows of a JSONL or Parquet file without validating their fields.

    Args:
        path: a ``.jsonl``/``.json``/``.ndjson`` (JSON lines) or ``.parquet``/``.pq`` file.

    Yields:
        One :class:`RawRow` per non-blank line or Parquet row, in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is a directory, has an unknown suffix, or is a Parquet file that cannot be read.
    """
    if os.path.isdir(path):
        raise ValueError(f"data file {path!r} is a directory, expected a .jsonl or .parquet file "
                         f"(give the path of one file: {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    fmt = file_format(path)
    base = os.path.basename(path)
    if fmt == "jsonl":
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                where, default_id = f"{path}:line {lineno}", f"{base}:{lineno}"
                record, error = decode_json_line(line, first=lineno == 1)
                if record is None and error is None:
                    continue  # blank line
                yield RawRow(where, default_id, record, error)
        return

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types (ArrowInvalid, OSError, ...)
        raise ValueError(f"{path}: cannot read Parquet file: {e}") from e
    row = 0
    for batch in table.to_batches(max_chunksize=_PARQUET_BATCH_ROWS):
        try:
            records = batch.to_pylist()
        except Exception:  # noqa: BLE001 - e.g. invalid UTF-8 in a string column: find the row(s)
            records = [_parquet_row(batch, i) for i in range(batch.num_rows)]
        for record in records:
            if isinstance(record, str):
                yield RawRow(f"{path}:row {row}", f"{base}:{row}", None, record)
            else:
                yield RawRow(f"{path}:row {row}", f"{base}:{row}", record)
            row += 1


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"duplicate key {key!r} in a JSON object")
        out[key] = value
    return out


def decode_json_line(line: bytes, first: bool = False) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """Decode one JSONL line into an object.

    Args:
        line: the raw bytes of the line (with or without its newline).
        first: the file's first line (a UTF-8 byte-order mark is then allowed).

    Returns:
        ``(record, None)`` for a JSON object; ``(None, why)`` for a line that is not valid UTF-8,
        not valid JSON (including duplicate keys, nesting too deep, integers too long to convert)
        or not an object; ``(None, None)`` for a blank line.
    """
    if first and line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 ({e.reason} at byte {e.start + 1})"
    if not text.strip():
        return None, None
    try:
        record = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return None, "invalid JSON (nested too deeply)"
    except ValueError as e:  # _DuplicateKey, or an integer beyond Python's digit limit
        return None, f"invalid JSON ({e})"
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    return record, None


def _parquet_row(batch: Any, i: int) -> Any:
    """Row ``i`` of a record batch as a dict, or the reason it cannot be converted (a str)."""
    try:
        return batch.slice(i, 1).to_pylist()[0]
    except Exception as e:  # noqa: BLE001 - pyarrow/Python conversion errors of one row
        return f"cannot decode the row ({type(e).__name__}: {str(e)[:200]})"


def _present(record: dict[str, Any], key: Optional[str]) -> bool:
    return key is not None and record.get(key) is not None


def require_text(record: dict[str, Any], key: str, where: str, allow_numbers: bool = False) -> str:
    """The non-empty string at ``record[key]``.

    Args:
        record: the decoded row.
        key: the field name.
        where: location for error messages.
        allow_numbers: accept finite ints/floats (not bools) and return ``str(value)``.

    Raises:
        MalformedRow: missing, null, wrongly typed or empty (whitespace only).
    """
    if key not in record or record[key] is None:
        raise MalformedRow(f"{where}: missing field {key!r}")
    value = record[key]
    if allow_numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise MalformedRow(f"{where}: field {key!r} is {value}, not a finite number")
        return str(value)
    if not isinstance(value, str):
        kinds = "a string or a number" if allow_numbers else "a string"
        raise MalformedRow(f"{where}: field {key!r} must be {kinds}, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise MalformedRow(f"{where}: field {key!r} is empty")
    return _encodable(value, key, where)


def optional_text(record: dict[str, Any], key: Optional[str], where: str, allow_int: bool = False) -> Optional[str]:
    """The string at ``record[key]``, or None when the key is disabled, absent or null.

    Raises:
        MalformedRow: present with another type (ints are accepted when ``allow_int``).
    """
    if not _present(record, key):
        return None
    value = record[key]
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        kinds = "a string or an integer" if allow_int else "a string"
        raise MalformedRow(f"{where}: field {key!r} must be {kinds}, got {type(value).__name__} {value!r}")
    return _encodable(value, key, where)


def _encodable(value: str, key: str, where: str) -> str:
    """``value`` if it is valid Unicode text (JSON's ``\\ud800`` escapes can make lone surrogates,
    which no tokenizer or UTF-8 writer accepts)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MalformedRow(f"{where}: field {key!r} is not valid Unicode text ({e.reason} at "
                           f"character {e.start})") from None
    return value


def check_unique_id(seen: dict[str, str], row_id: str, where: str) -> None:
    """Record ``row_id`` as seen at ``where``.

    Raises:
        MalformedRow: the id was already used by an earlier row.
    """
    if row_id in seen:
        raise MalformedRow(f"{where}: duplicate id {row_id!r} (first used at {seen[row_id]})")
    seen[row_id] = where


def read_prompts(
    path: str,
    question_key: str = "question",
    answer_key: str = "answer",
    id_key: Optional[str] = "id",
    source_key: Optional[str] = "source",
    skip_malformed: bool = False,
) -> tuple[list[Prompt], int]:
    """Read prompts from a JSONL or Parquet file (schema in the module docstring).

    Args:
        path: the data file.
        question_key: field holding the question.
        answer_key: field holding the reference answer.
        id_key: field holding the id (None: always use ``<basename>:<line>``).
        source_key: field holding the source name (None: no source).
        skip_malformed: skip (and log) malformed rows instead of raising.

    Returns:
        ``(prompts, skipped)``: the prompts in file order (``text``/``token_ids`` empty) and the
        number of malformed rows skipped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed row (with ``skip_malformed=False``), naming file and line/row;
            or a file without any valid prompt.
    """
    def build(rec: dict[str, Any], raw: RawRow) -> Prompt:
        return Prompt(id=optional_text(rec, id_key, raw.where, allow_int=True) or raw.default_id,
                      question=require_text(rec, question_key, raw.where),
                      answer=require_text(rec, answer_key, raw.where, allow_numbers=True),
                      source=optional_text(rec, source_key, raw.where))

    return read_records(path, build, skip_malformed, what="prompts")


def read_records(
    path: str,
    build: Callable[[dict[str, Any], RawRow], T],
    skip_malformed: bool = False,
    what: str = "rows",
    unique_ids: bool = True,
) -> tuple[list[T], int]:
    """The row loop shared by every reader: ``build(record, raw)`` makes one item (raising
    :class:`MalformedRow` for a bad row); malformed rows raise a ValueError naming file and
    line/row, or are counted and skipped with ``skip_malformed``; duplicate ``id`` attributes
    are malformed; a file without any valid row is an error.

    Returns:
        ``(items, skipped)`` in file order.
    """
    items: list[T] = []
    seen: dict[str, str] = {}
    skipped = 0
    for raw in iter_raw_rows(path):
        try:
            if raw.record is None:
                raise MalformedRow(f"{raw.where}: {raw.error}")
            item = build(raw.record, raw)
            if unique_ids and getattr(item, "id", None) is not None:
                check_unique_id(seen, item.id, raw.where)
        except MalformedRow as e:
            if not skip_malformed:
                raise
            skipped += 1
            logger.warning("skipping malformed row: %s", e)
            continue
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no valid {what} ({skipped} malformed rows skipped)")
    if skipped:
        logger.warning("%s: read %d %s, skipped %d malformed rows", path, len(items), what, skipped)
    return items, skipped


def write_prompts(prompts: Iterable[Prompt], path: str) -> int:
    """Write prompts as a file :func:`read_prompts` reads back (JSONL or Parquet by suffix).

    Only ``id``, ``question``, ``answer`` and ``source`` (when set) are written.

    Args:
        prompts: the prompts.
        path: output file; its suffix picks the format; parent folders are created.

    Returns:
        The number of prompts written.
    """
    rows: list[dict[str, Optional[str]]] = [
        {"id": p.id, "question": p.question, "answer": p.answer, "source": p.source} for p in prompts
    ]
    fmt = file_format(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({k: v for k, v in row.items() if v is not None}, ensure_ascii=False) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return len(rows)
