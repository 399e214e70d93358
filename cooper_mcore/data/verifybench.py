"""Reward-model evaluation data in the VerifyBench format.

Each row (a JSONL line or a Parquet row) is one completion of a question, judged by humans
against a reference answer:

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
    optional_text,
    read_records,
    require_text,
)
from cooper_mcore.data.templates import rm_input

logger = logging.getLogger(__name__)


@dataclass
class VerifyBenchItem:
    """One judged completion.

    Attributes:
        id: stable identifier.
        question: the problem statement.
        answer: the reference answer.
        completion: the completion to verify.
        gold_correct: the human verdict.
        answer_type: coarse answer category, if given.
        answer_subtype: fine answer category, if given.
    """

    id: str
    question: str
    answer: str
    completion: str
    gold_correct: bool
    answer_type: Optional[str] = None
    answer_subtype: Optional[str] = None

    def rm_text(self, truncate: bool = True) -> str:
        """The reward model's input for this item (:func:`cooper_mcore.data.templates.rm_input`)."""
        return rm_input(self.question, self.answer, self.completion, truncate=truncate)


def _require_bool(record: dict[str, Any], key: str, where: str) -> bool:
    if key not in record or record[key] is None:
        raise MalformedRow(f"{where}: missing field {key!r}")
    value = record[key]
    if not isinstance(value, bool):
        raise MalformedRow(f"{where}: field {key!r} must be true or false, got {type(value).__name__} {value!r}")
    return value


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
) -> tuple[list[VerifyBenchItem], int]:
    """Read VerifyBench-format items from a JSONL or Parquet file.

    Args:
        path: the data file.
        question_key, answer_key, completion_key, label_key: required fields' names.
        answer_type_key, answer_subtype_key, id_key: optional fields' names (None: not read).
        skip_malformed: skip (and log) malformed rows instead of raising.

    Returns:
        ``(items, skipped)`` in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a malformed row (unless skipped), naming the file and line/row; no valid item.
    """
    def build(rec: dict, raw) -> VerifyBenchItem:
        return VerifyBenchItem(
            id=optional_text(rec, id_key, raw.where, allow_int=True) or raw.default_id,
            question=require_text(rec, question_key, raw.where),
            answer=require_text(rec, answer_key, raw.where, allow_numbers=True),
            completion=require_text(rec, completion_key, raw.where),
            gold_correct=_require_bool(rec, label_key, raw.where),
            answer_type=optional_text(rec, answer_type_key, raw.where),
            answer_subtype=optional_text(rec, answer_subtype_key, raw.where),
        )

    return read_records(path, build, skip_malformed, what="items")


def summarize(items: list[VerifyBenchItem]) -> dict[str, dict[str, int]]:
    """Counts of items and of gold-correct items per ``answer_type`` (None counted as "unknown")."""
    total: Counter[str] = Counter()
    correct: Counter[str] = Counter()
    for it in items:
        kind = it.answer_type or "unknown"
        total[kind] += 1
        correct[kind] += int(it.gold_correct)
    return {kind: {"items": total[kind], "gold_correct": correct[kind]} for kind in sorted(total)}
