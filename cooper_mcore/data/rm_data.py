"""Judged (question, reference, completion) triples: the reward model's training and evaluation data.

Two row formats, read into one record type (:class:`RMExample`):

* **labeled** (``cooper train-rm`` / ``eval-rm`` / ``annotate`` output): ``question``,
  ``reference`` (string or number), ``completion``, ``label`` (bool or 0/1), optional ``id`` and
  ``answer_type``;
* **VerifyBench** (the paper's RM benchmark; fields below).

:func:`read_eval_examples` tells them apart by the first row. Each row (a JSONL line or a
Parquet row) is one completion of a question, judged against a reference answer:

============== =================== =======================================================
field          type                meaning
============== =================== =======================================================
question       non-empty string    the problem statement
answer         string or number    the reference answer (numbers are turned into strings)
completion     non-empty string    the model output to verify
gold_correct   bool                whether ``completion`` is correct w.r.t. ``answer``
answer_type    string, optional    e.g. "numeric", "expression", "multiple_choice", "string"
answer_subtype string, optional    a finer category
id             string or integer   optional; defaults to ``<basename>:<line>`` / ``<basename>:<row>``
============== =================== =======================================================

Field names are configurable; malformed rows follow the rules of
:mod:`cooper_mcore.data.datasets` (``ValueError`` naming file and line/row, or a counted skip).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from cooper_mcore.data.datasets import (
    MalformedRow,
    iter_raw_rows,
    optional_text,
    read_records,
    require_text,
)
from cooper_mcore.data.templates import rm_input

logger = logging.getLogger(__name__)

DATA_FORMATS = ("auto", "labeled", "verifybench")


@dataclass
class RMExample:
    """One judged completion.

    Attributes:
        id: stable identifier.
        question: the problem statement.
        reference: the reference answer.
        completion: the completion to judge.
        label: whether the completion is correct (VerifyBench's ``gold_correct``).
        answer_type: coarse answer category, if given (evaluation reports accuracy per type).
        answer_subtype: fine answer category, if given.
    """

    id: str
    question: str
    reference: str
    completion: str
    label: bool
    answer_type: Optional[str] = None
    answer_subtype: Optional[str] = None

    def rm_text(self, truncate: bool = True) -> str:
        """The reward model's input (:func:`cooper_mcore.data.templates.rm_input`)."""
        return rm_input(self.question, self.reference, self.completion, truncate=truncate)


def _label(record: dict[str, Any], key: str, where: str, allow_01: bool) -> bool:
    """A boolean field (and 0/1 when ``allow_01``)."""
    if key not in record or record[key] is None:
        raise MalformedRow(f"{where}: missing field {key!r}")
    value = record[key]
    if isinstance(value, bool):
        return value
    if allow_01 and isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    want = "true/false or 0/1" if allow_01 else "true or false"
    raise MalformedRow(f"{where}: field {key!r} must be {want}, got {type(value).__name__} {value!r}")


def _read(path: str, keys: dict[str, Optional[str]], allow_01: bool, skip_malformed: bool,
          what: str) -> tuple[list[RMExample], int]:
    def build(rec: dict, raw) -> RMExample:
        return RMExample(
            id=optional_text(rec, keys["id"], raw.where, allow_int=True) or raw.default_id,
            question=require_text(rec, keys["question"], raw.where),
            reference=require_text(rec, keys["reference"], raw.where, allow_numbers=True),
            completion=require_text(rec, keys["completion"], raw.where),
            label=_label(rec, keys["label"], raw.where, allow_01),
            answer_type=optional_text(rec, keys["answer_type"], raw.where),
            answer_subtype=optional_text(rec, keys["answer_subtype"], raw.where),
        )

    return read_records(path, build, skip_malformed, what=what)


def read_rm_examples(
    path: str,
    question_key: str = "question",
    reference_key: str = "reference",
    completion_key: str = "completion",
    label_key: str = "label",
    id_key: Optional[str] = "id",
    answer_type_key: Optional[str] = "answer_type",
    skip_malformed: bool = False,
) -> tuple[list[RMExample], int]:
    """Read labeled reward-model triples (the labeled format in the module docstring).

    Returns:
        ``(examples, skipped)`` in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed row (unless skipped), naming the file and line/row; no valid row.
    """
    keys = {"question": question_key, "reference": reference_key, "completion": completion_key,
            "label": label_key, "id": id_key, "answer_type": answer_type_key, "answer_subtype": None}
    return _read(path, keys, allow_01=True, skip_malformed=skip_malformed, what="rows")


def read_verifybench(
    path: str,
    question_key: str = "question",
    answer_key: str = "answer",
    completion_key: str = "completion",
    label_key: str = "gold_correct",
    answer_type_key: Optional[str] = "answer_type",
    answer_subtype_key: Optional[str] = "answer_subtype",
    id_key: Optional[str] = "id",
    skip_malformed: bool = False,
) -> tuple[list[RMExample], int]:
    """Read VerifyBench-format items from a JSONL or Parquet file.

    Args:
        path: the data file.
        question_key, answer_key, completion_key, label_key: required fields' names.
        answer_type_key, answer_subtype_key, id_key: optional fields' names (None: not read).
            The answer becomes the example's ``reference``, ``gold_correct`` its ``label``.
        skip_malformed: skip (and log) malformed rows instead of raising.

    Returns:
        ``(items, skipped)`` in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed row (unless skipped), naming the file and line/row; no valid item.
    """
    keys = {"question": question_key, "reference": answer_key, "completion": completion_key, "label": label_key,
            "id": id_key, "answer_type": answer_type_key, "answer_subtype": answer_subtype_key}
    return _read(path, keys, allow_01=False, skip_malformed=skip_malformed, what="items")


def summarize(items: list[RMExample]) -> dict[str, dict[str, int]]:
    """Counts of items and of correct items per ``answer_type`` (None counted as "unknown")."""
    total: Counter[str] = Counter()
    correct: Counter[str] = Counter()
    for it in items:
        kind = it.answer_type or "unknown"
        total[kind] += 1
        correct[kind] += int(it.label)
    return {kind: {"items": total[kind], "gold_correct": correct[kind]} for kind in sorted(total)}


def detect_format(path: str) -> str:
    """``"verifybench"`` if the first decodable row has ``gold_correct``, ``"labeled"`` if it has ``label``.

    Raises:
        ValueError: neither field, or no decodable row.
    """
    for raw in iter_raw_rows(path):
        if raw.record is None:
            continue
        if "gold_correct" in raw.record:
            return "verifybench"
        if "label" in raw.record:
            return "labeled"
        raise ValueError(f"{raw.where}: cannot tell the data format (no 'gold_correct' or 'label' field); "
                         "pass data_format='labeled' or 'verifybench'")
    raise ValueError(f"{path}: no readable row")


def read_eval_examples(
    path: str, data_format: str = "auto", skip_malformed: bool = False
) -> tuple[list[RMExample], int]:
    """Evaluation triples from a labeled or a VerifyBench-format file.

    Args:
        path: the data file.
        data_format: ``"labeled"``, ``"verifybench"`` or ``"auto"`` (:func:`detect_format`).
        skip_malformed: skip and count malformed rows.

    Returns:
        ``(examples, skipped)``.
    """
    if data_format not in DATA_FORMATS:
        raise ValueError(f"unknown data_format {data_format!r}; choose from {DATA_FORMATS}")
    if data_format == "auto":
        data_format = detect_format(path)
    if data_format == "labeled":
        return read_rm_examples(path, skip_malformed=skip_malformed)
    return read_verifybench(path, skip_malformed=skip_malformed)
