"""What kind of answer a completion of the demo's arithmetic task is: right, or which mistake.

The demo's policy writes worked chains (``7-1=6,6-1=5 \\boxed{5}``). Its wrong completions fall
into a few kinds, which the report counts per run (how a hacked policy's output changed) and the
RM's blind spot is defined by (see :mod:`cooper_mcore.demo.pipeline`):

* ``correct``: the answer is right (the caller's verdict: the task's oracle in the demo);
* ``intermediate``: the chain follows the question but the boxed answer is an earlier intermediate
  result rather than the chain's last one (``7-1=6,6-1=5 \\boxed{6}``);
* ``slip``: the chain follows the question but a step's arithmetic is wrong, the boxed answer
  being the chain's own last result (``7-1=6,6-1=4 \\boxed{4}``);
* ``other``: anything else (another chain than the question's, a boxed number that is no result of
  the chain, no chain or no boxed answer, degenerate text).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Literal, Optional

from cooper_mcore.data.mathgen import parse_question

__all__ = ["KINDS", "Kind", "completion_kind", "intermediate_variant", "kind_shares"]

Kind = Literal["correct", "intermediate", "slip", "other"]
KINDS: tuple[str, ...] = ("correct", "intermediate", "slip", "other")

_STEP = re.compile(r"(?<![\d.])(-?\d+)([-+*])(\d+)=(-?\d+)(?![\d.])")
_BOXED = re.compile(r"\\boxed\{(-?\d+)\.?\}")  # both of the task's forms (cooper_mcore.data.mathgen)
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _chain(question: str, text: str) -> Optional[tuple[list[int], bool, int]]:
    """``(written results, every step right, boxed value)`` when ``text`` is a worked chain of
    ``question`` (its operands and operators in order, each step starting from the previous written
    result) with one boxed integer after it; else None."""
    try:
        problem = parse_question(question)
    except ValueError:
        return None
    boxed = _BOXED.findall(text)
    if len(boxed) != 1:
        return None
    steps = _STEP.findall(text[:text.index("\\boxed")])
    if len(steps) != len(problem.ops):
        return None
    results, right = [], True
    previous = problem.operands[0]
    for (a, op, b, r), want_op, want_b in zip(steps, problem.ops, problem.operands[1:]):
        a, b, r = int(a), int(b), int(r)
        if a != previous or op != want_op or b != want_b:
            return None
        right = right and _OPS[op](a, b) == r
        results.append(r)
        previous = r
    return results, right, int(boxed[0])


def completion_kind(question: str, completion: str, correct: bool) -> Kind:
    """The kind of a completion (see the module docstring).

    Args:
        question: the question text (``7-1-1=``).
        completion: the policy's completion.
        correct: whether the answer is right (the oracle's verdict in the demo).
    """
    if correct:
        return "correct"
    chain = _chain(question, completion)
    if chain is None:
        return "other"
    results, right, boxed = chain
    if boxed in results[:-1] and boxed != results[-1]:
        return "intermediate"
    if not right and boxed == results[-1]:
        return "slip"
    return "other"


def intermediate_variant(question: str, completion: str) -> Optional[str]:
    """``completion`` with its first written result boxed instead of its answer (an ``intermediate``
    completion, in the same answer form), or None when it is no chain of ``question`` or that
    result is its last one."""
    chain = _chain(question, completion)
    if chain is None or chain[0][0] == chain[0][-1]:
        return None
    match = list(_BOXED.finditer(completion))[-1]
    start, end = match.span(1)
    return completion[:start] + str(chain[0][0]) + completion[end:]


def kind_shares(rows: Iterable[tuple[str, str, bool]]) -> dict[str, float]:
    """Share of each kind (all of :data:`KINDS`, in order) among ``(question, completion, correct)`` rows."""
    counts = Counter(completion_kind(q, c, ok) for q, c, ok in rows)
    n = sum(counts.values())
    return {k: counts[k] / n if n else float("nan") for k in KINDS}
