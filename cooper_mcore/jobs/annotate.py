"""Hybrid labels for reward-model training: the rule verifier and an LLM judge must agree.

Each (question, reference, completion) row is judged twice:

* by the rule verifier (:class:`~cooper_mcore.verify.rule.RuleVerifier`,
  ``verify(gold=reference, pred=completion)``): True, False, or None when unverifiable;
* by an LLM judge behind an OpenAI-compatible chat endpoint
  (:class:`~cooper_mcore.llm_client.OpenAIChatClient`), asked a reference-based yes/no
  question (:func:`judge_messages`) and read by :func:`parse_judgement`: True ("yes"), False
  ("no"), or None when the answer cannot be read or the request failed.

A row is kept, with ``label`` = the common verdict, iff both verdicts are known and equal; every
other row is dropped and counted. The output keeps every input field and adds ``label`` (true or
false); JSONL or Parquet by the output's suffix, written under a temporary name and renamed
(:mod:`cooper_mcore.atomic`: an output path that is a device, a FIFO or a folder is refused before
any work).

Nothing to label is an error, never an empty output with exit 0: an input without rows raises
``ValueError`` (:func:`~cooper_mcore.data.datasets.read_records`); a judge none of whose answers
could be read (every request failed, came back without text, or said neither yes nor no: a wrong
model name, a reasoning judge cut off by ``max_tokens``, ...) raises :class:`JudgeUnavailable`
naming the endpoint, and nothing is written.

Rows are read like the RM training data of :mod:`cooper_mcore.jobs.verify_rm` (field names
configurable; a malformed row raises ``ValueError`` naming file and line, or is skipped and
counted with ``skip_malformed``). Rows are processed in chunks of ``chunk_size``: the judge's
requests (concurrent, bounded by the client) run in a thread while the verifier checks the same
chunk.

The statistics (:func:`annotate`'s return value) hold the table of (rule, judge) verdicts, e.g.
``table["true"]["false"]`` = rows the rule found correct and the judge wrong, the agreement rate
among rows where both gave a verdict, and the kept / dropped counts.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from cooper_mcore.atomic import atomic_path, check_output_path
from cooper_mcore.data.datasets import file_format, read_records, require_text
from cooper_mcore.data.templates import truncate_completion

logger = logging.getLogger(__name__)

VERDICTS = ("true", "false", "none")

JUDGE_SYSTEM_PROMPT = (
    "You are a careful grader of answers to problems. You are given a question, its reference answer "
    "and a completion (a candidate solution). Decide whether the final answer of the completion is "
    "equivalent to the reference answer. Judge only the final answer, not the reasoning; equivalent forms "
    "(e.g. 0.5 and 1/2, or a different but equal expression) count as a match. Reply with exactly one "
    'word: "yes" if the final answer matches the reference answer, otherwise "no".'
)


def judge_user_prompt(question: str, reference: str, completion: str) -> str:
    """The judge's user message (plain concatenation: the texts may contain braces)."""
    return (
        "<question>\n" + question + "\n</question>\n\n<reference_answer>\n" + reference
        + "\n</reference_answer>\n\n<completion>\n" + completion + "\n</completion>\n\n"
        "Does the final answer of the completion match the reference answer? Answer only yes or no."
    )


class JudgeUnavailable(RuntimeError):
    """The LLM judge failed after its retries and the run was told to stop (``on_judge_failure="stop"``),
    or not one judge answer of the whole input had text (the CLI reports it in one line, exit 2)."""


class ChatClient(Protocol):
    """What :func:`annotate` needs of a judge (e.g. ``OpenAIChatClient``)."""

    def chat_batch(self, batch: Sequence[Sequence[dict]], temperature: float = ...,
                   max_tokens: int = ...) -> list[Optional[str]]: ...


class Verifier(Protocol):
    """What :func:`annotate` needs of a rule verifier (e.g. ``RuleVerifier``)."""

    def verify_batch(self, golds: Sequence[str], preds: Sequence[str]) -> list[Any]: ...


def judge_messages(question: str, reference: str, completion: str, truncate: bool = True) -> list[dict[str, str]]:
    """The judge's chat for one triple (system + user message).

    Args:
        question / reference / completion: the triple.
        truncate: cut long completions as the reward model's input does (first 500 + last 1000
            characters of a completion longer than 1500), so the judge sees what the RM sees.
    """
    if truncate:
        completion = truncate_completion(completion)
    return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT},
            {"role": "user", "content": judge_user_prompt(question, reference, completion)}]


_THINK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
_WORD = re.compile(r"[a-z]+")
_VERDICT_LINE = re.compile(r"(?:final\s+answer|answer|verdict|judgement|judgment)\s*[:=\-]\s*\W*(yes|no)\b")
_BOXED = re.compile(r"\\boxed\{\s*\W*(yes|no)\W*\s*\}")


def parse_judgement(text: Optional[str]) -> Optional[bool]:
    """Read a judge's yes/no answer.

    Rules, in order (case-insensitive, after dropping ``<think>...</think>`` blocks): the first
    word is "yes" or "no"; else ``\\boxed{yes|no}``; else the last ``answer: yes|no`` (also
    "final answer", "verdict", "judgement"); else "yes" or "no" as the only one of the two that
    occurs as a word. Anything else (empty, both words, neither, or None) gives None.

    Returns:
        True for yes, False for no, None when unreadable.
    """
    if not text:
        return None
    body = _THINK.sub(" ", text).lower()
    if "<think>" in body:  # an unterminated reasoning block: no verdict after it
        return None
    words = _WORD.findall(body)
    if not words:
        return None
    if words[0] in ("yes", "no"):
        return words[0] == "yes"
    for pattern in (_BOXED, _VERDICT_LINE):
        found = pattern.findall(body)
        if found:
            return found[-1] == "yes"
    present = {w for w in words if w in ("yes", "no")}
    if len(present) == 1:
        return present.pop() == "yes"
    return None


def _key(v: Optional[bool]) -> str:
    return "none" if v is None else ("true" if v else "false")


def _read_rows(path: str, keys: tuple[str, str, str], skip_malformed: bool) -> tuple[list[dict], list[tuple], int]:
    def build(rec: dict, raw) -> tuple[dict, tuple[str, str, str]]:
        return rec, (require_text(rec, keys[0], raw.where),
                     require_text(rec, keys[1], raw.where, allow_numbers=True),
                     require_text(rec, keys[2], raw.where))

    items, skipped = read_records(path, build, skip_malformed, what="rows", unique_ids=False)
    return [rec for rec, _ in items], [t for _, t in items], skipped


def _write_rows(rows: list[dict], path: str) -> None:
    fmt = file_format(path)
    with atomic_path(path) as tmp:
        if fmt == "jsonl":
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        else:
            pq.write_table(pa.Table.from_pylist(rows), tmp)


def annotate(
    in_path: str,
    out_path: str,
    judge_client: ChatClient,
    verifier: Verifier,
    question_key: str = "question",
    reference_key: str = "reference",
    completion_key: str = "completion",
    label_key: str = "label",
    skip_malformed: bool = False,
    chunk_size: int = 512,
    temperature: float = 0.0,
    max_tokens: int = 16,
    truncate: bool = True,
    judgements_path: Optional[str] = None,
    on_judge_failure: str = "mask",
) -> dict[str, Any]:
    """Label triples where the rule verifier and the LLM judge agree (module docstring).

    Args:
        in_path: input rows (JSONL or Parquet).
        out_path: output file for the kept rows (JSONL or Parquet by suffix); must differ from ``in_path``.
        judge_client: an OpenAI-compatible chat client (``chat_batch``).
        verifier: a rule verifier (``verify_batch(golds, preds)`` with ``.correct`` outcomes).
        question_key / reference_key / completion_key: input field names.
        label_key: the output's label field (replaces an input field of that name).
        skip_malformed: skip and count malformed rows instead of raising.
        chunk_size: rows per judge/verifier round.
        temperature / max_tokens: judge sampling (raise ``max_tokens`` for reasoning judges).
        truncate: the judge sees completions truncated as the reward model does.
        judgements_path: if set, also write every row's verdicts (``index, rule, judge,
            judge_text, kept``) as JSONL, for auditing disagreements.
        on_judge_failure: a judge request that fails after the client's retries: ``"mask"`` drops
            that row (counted in ``judge_failed``) and goes on; ``"stop"`` raises at the end of
            that chunk, before anything is written.

    Returns:
        Statistics: ``rows`` (read), ``skipped_malformed``, ``table`` (``table[rule][judge]``
        counts, keys "true"/"false"/"none"), ``both_decided``, ``agreed``, ``agreement_rate``
        (agreed / both_decided, None if none), ``kept``, ``kept_correct``, ``kept_incorrect``,
        ``dropped_disagree``, ``dropped_rule_unverifiable``, ``dropped_judge_unparseable``,
        ``judge_failed`` (requests without an answer, included in ``judge`` None), ``out_path``.

    Raises:
        ValueError: bad arguments, an output path that is not a regular file, an input without
            (valid) rows, or a malformed row (unless skipped).
        JudgeUnavailable: with ``on_judge_failure="stop"``, a judge request failed for good (the
            message names the endpoint and how many requests of the chunk failed); or, whatever
            ``on_judge_failure``, no judge answer of the input could be read (nothing is written).
    """
    _check_arguments(in_path, out_path, judgements_path, chunk_size, on_judge_failure)
    rows, triples, skipped = _read_rows(in_path, (question_key, reference_key, completion_key), skip_malformed)
    tally = _Tally(table={r: dict.fromkeys(VERDICTS, 0) for r in VERDICTS})
    with ThreadPoolExecutor(1, thread_name_prefix="annotate-judge") as pool:
        for start in range(0, len(triples), chunk_size):
            chunk = triples[start:start + chunk_size]
            chats = [judge_messages(q, ref, c, truncate) for q, ref, c in chunk]
            answers_f = pool.submit(judge_client.chat_batch, chats, temperature, max_tokens)
            outcomes = verifier.verify_batch([ref for _, ref, _ in chunk], [c for _, _, c in chunk])
            answers = answers_f.result()
            _check_chunk(answers, outcomes, len(chunk), start, judge_client, on_judge_failure)
            tally.add(rows, start, answers, outcomes, label_key, audit=bool(judgements_path))
            logger.info("annotate: %d/%d rows judged, %d kept", min(start + chunk_size, len(triples)),
                        len(triples), len(tally.kept_rows))
    _check_judge_answered(tally, len(triples), judge_client, out_path)
    _write_rows(tally.kept_rows, out_path)
    if judgements_path:
        _write_rows(tally.audit, judgements_path)
    stats = tally.stats(len(triples), skipped, out_path)
    logger.info("annotate %s -> %s: %d rows, kept %d (%d correct), agreement %s", in_path, out_path, len(triples),
                stats["kept"], stats["kept_correct"],
                "n/a" if stats["agreement_rate"] is None else f"{stats['agreement_rate']:.3f}")
    return stats


def _check_arguments(in_path: str, out_path: str, judgements_path: Optional[str], chunk_size: int,
                     on_judge_failure: str) -> None:
    """Every argument error before any work (an unknown suffix, an output that is the input)."""
    if on_judge_failure not in ("mask", "stop"):
        raise ValueError(f"on_judge_failure must be 'mask' or 'stop', got {on_judge_failure!r}")
    if os.path.abspath(in_path) == os.path.abspath(out_path):
        raise ValueError(f"out_path must differ from in_path ({in_path!r})")
    file_format(out_path)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    for path in (out_path, judgements_path):
        if path:
            file_format(path)
            check_output_path(path)


def _judge_name(judge_client: ChatClient) -> str:
    endpoint = getattr(judge_client, "url", "?")
    model = getattr(judge_client, "model", None)
    return f"the LLM judge at {endpoint}{f' (model {model!r})' if model else ''}"


def _check_chunk(answers: Sequence[Optional[str]], outcomes: Sequence, n: int, start: int,
                 judge_client: ChatClient, on_judge_failure: str) -> None:
    """One result per row from both, and (with ``on_judge_failure="stop"``) no failed judge request."""
    if len(answers) != n or len(outcomes) != n:
        raise RuntimeError(f"judge/verifier returned {len(answers)}/{len(outcomes)} results for {n} rows")
    failed = sum(a is None for a in answers)
    if failed and on_judge_failure == "stop":
        raise JudgeUnavailable(
            f"LLM judge at {getattr(judge_client, 'url', '?')} failed for {failed} of {n} rows "
            f"(rows {start}-{start + n - 1}) after its retries; nothing was written. Use "
            "on_judge_failure='mask' (--on-judge-failure mask) to drop and count such rows instead")


def _check_judge_answered(tally: _Tally, n_rows: int, judge_client: ChatClient, out_path: str) -> None:
    """Raise when no judge answer had text; warn when it answered but never yes or no."""
    judge_name = _judge_name(judge_client)
    if tally.judge_failed + tally.judge_empty == n_rows:  # not one answer with text: the judge is not there
        raise JudgeUnavailable(
            f"{judge_name} gave no answer with text for any of the {n_rows} rows ({tally.judge_failed} requests "
            f"failed after their retries, {tally.judge_empty} answers had no text); nothing was written to "
            f"{out_path}. Check that the endpoint serves that model and answers chat completions (for a reasoning "
            "judge, raise max_tokens)")
    if not any(tally.table[r][j] for r in VERDICTS for j in ("true", "false")):
        logger.warning("%s answered, but never yes or no (%d rows): every row is dropped as unparseable and %s is "
                       "empty; check the judge's answers (--judgements) and its prompt", judge_name, n_rows,
                       out_path)


@dataclass
class _Tally:
    """The rule x judge table, the kept rows and the audit trail over the chunks judged so far."""

    table: dict[str, dict[str, int]]
    kept_rows: list[dict] = field(default_factory=list)
    audit: list[dict] = field(default_factory=list)
    judge_failed: int = 0
    judge_empty: int = 0

    def add(self, rows: Sequence[dict], start: int, answers: Sequence[Optional[str]], outcomes: Sequence,
            label_key: str, audit: bool) -> None:
        """Count one chunk's verdicts; keep (and label) the rows where the rule and the judge agree."""
        for j, (text, outcome) in enumerate(zip(answers, outcomes)):
            rule, judge = outcome.correct, parse_judgement(text)
            self.judge_failed += text is None
            self.judge_empty += text is not None and not text.strip()
            self.table[_key(rule)][_key(judge)] += 1
            kept = rule is not None and rule == judge
            if kept:
                row = dict(rows[start + j])
                row[label_key] = bool(rule)
                self.kept_rows.append(row)
            if audit:
                self.audit.append({"index": start + j, "rule": rule, "judge": judge, "judge_text": text,
                                   "kept": kept})

    def stats(self, n_rows: int, skipped: int, out_path: str) -> dict[str, Any]:
        """The statistics :func:`annotate` returns."""
        table = self.table
        decided = sum(table[r][j] for r in ("true", "false") for j in ("true", "false"))
        agreed = table["true"]["true"] + table["false"]["false"]
        return {
            "rows": n_rows,
            "skipped_malformed": skipped,
            "table": table,
            "both_decided": decided,
            "agreed": agreed,
            "agreement_rate": agreed / decided if decided else None,
            "kept": len(self.kept_rows),
            "kept_correct": table["true"]["true"],
            "kept_incorrect": table["false"]["false"],
            "dropped_disagree": decided - agreed,
            "dropped_rule_unverifiable": sum(table["none"].values()),
            "dropped_judge_unparseable": table["true"]["none"] + table["false"]["none"],
            "judge_failed": self.judge_failed,
            "out_path": out_path,
        }
