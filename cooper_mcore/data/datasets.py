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
lines are skipped. A malformed row (bad JSON, not an object, a missing or wrongly typed field,
an empty question or answer, a duplicate id) raises a :class:`ValueError` naming the file and
line (or row), or is skipped, logged and counted when ``skip_malformed=True``.

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

from cooper_mcore.types import Prompt

T = TypeVar("T")

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


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
        ValueError: unknown suffix, or a Parquet file that cannot be read.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    fmt = file_format(path)
    base = os.path.basename(path)
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where, default_id = f"{path}:line {lineno}", f"{base}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    yield RawRow(where, default_id, None, f"invalid JSON ({e.msg} at column {e.colno})")
                    continue
                if not isinstance(record, dict):
                    yield RawRow(where, default_id, None, f"expected a JSON object, got {type(record).__name__}")
                    continue
                yield RawRow(where, default_id, record)
        return
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types (ArrowInvalid, OSError, ...)
        raise ValueError(f"{path}: cannot read Parquet file: {e}") from e
    for row, record in enumerate(table.to_pylist()):
        yield RawRow(f"{path}:row {row}", f"{base}:{row}", record)


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
    return value


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
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return len(rows)
