"""Deterministic integer arithmetic problems for CPU runs, tests and the tiny tokenizer.

A problem is a chain ``a0 op1 a1 op2 a2 ... =`` evaluated left to right, e.g. ``59-15-75=``
with the worked solution ``59-15=44,44-75=-31`` and the answer ``-31``. Operands are
non-negative integers from a configurable range; operators are ``+``, ``-`` and ``*``. When a
``*`` follows a ``+`` or ``-`` the part before it is parenthesised (``(3+4)*5=``), so the
question read with ordinary precedence has the same value as the chain.

Completions end in a final-answer format: ``\\boxed{-31}`` (default,
``59-15=44,44-75=-31 \\boxed{-31}``), GSM8K's ``#### -31``, or ``\\boxed{-31.}`` (``boxed_period``:
a trailing period, which a rule verifier such as math-verify does not read as a number; the CPU
demo's second problem family writes it, so the rule misses correct answers as in the paper's
premise). :func:`answer_value` is the task's oracle: it reads both boxed forms. The character set is small:
digits, ``+ - * = ( ) ,``, space and ``\\boxed{}`` (and ``#`` for the GSM8K style).

Train and held-out splits are disjoint by construction: a question belongs to the held-out
split iff a hash of ``(split_seed, question)`` falls below ``held_out_fraction``, whatever is
generated, so the two splits can be drawn independently and never share a question.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from cooper_mcore.types import Prompt

OPERATORS = ("+", "-", "*")
SPLITS = ("train", "test")
STYLES = ("boxed", "gsm8k", "boxed_period")
#: the final answers :func:`answer_value` reads: ``\\boxed{-31}`` and ``\\boxed{-31.}`` (the
#: ``boxed_period`` style, a form math-verify does not read as a number)
_FINAL_BOXED = re.compile(r"\\boxed\{(-?\d+)(\.?)\}")
#: a reference the rule verifier cannot read (:func:`unreadable_reference`)
_UNREADABLE_REFERENCE = re.compile(r"\\text\{(-?\d+)\.\}")


@dataclass(frozen=True)
class MathTaskConfig:
    """What problems look like.

    Attributes:
        num_steps: operations per problem (``59-15-75=`` has 2).
        min_operand: smallest operand (>= 0).
        max_operand: largest operand.
        operators: the operators to draw from, a non-empty subset of ``+ - *``.
        step_operators: per step, the operators to draw from (each a non-empty subset of
            ``+ - *``), instead of ``operators`` for every step; empty: ``operators`` everywhere.
            ``(("*",), ("+", "-"))`` gives ``3*4-5=`` problems.
        held_out_fraction: share of all possible questions reserved for the held-out split.
        split_seed: seed of the train/held-out assignment.
    """

    num_steps: int = 2
    min_operand: int = 0
    max_operand: int = 99
    operators: tuple[str, ...] = ("+", "-")
    step_operators: tuple[tuple[str, ...], ...] = ()
    held_out_fraction: float = 0.2
    split_seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field."""
        if self.num_steps < 1:
            raise ValueError(f"MathTaskConfig.num_steps must be >= 1, got {self.num_steps}")
        if self.min_operand < 0:
            raise ValueError(f"MathTaskConfig.min_operand must be >= 0, got {self.min_operand}")
        if self.max_operand < self.min_operand:
            raise ValueError(
                f"MathTaskConfig.max_operand={self.max_operand} is below min_operand={self.min_operand}"
            )
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(
                f"MathTaskConfig.operators must be a non-empty subset of {OPERATORS}, got {self.operators}"
            )
        if self.step_operators and (len(self.step_operators) != self.num_steps or any(
                not ops or any(op not in OPERATORS for op in ops) for ops in self.step_operators)):
            raise ValueError(f"MathTaskConfig.step_operators must be num_steps={self.num_steps} non-empty subsets of "
                             f"{OPERATORS}, got {self.step_operators}")
        if not 0.0 < self.held_out_fraction < 1.0:
            raise ValueError(f"MathTaskConfig.held_out_fraction must be in (0, 1), got {self.held_out_fraction}")

    def num_questions(self) -> int:
        """How many distinct questions exist (both splits together)."""
        span = self.max_operand - self.min_operand + 1
        return span ** (self.num_steps + 1) * math.prod(len(ops) for ops in self.operator_choices())

    def operator_choices(self) -> list[list[str]]:
        """The operators each step draws from (sorted, distinct)."""
        per_step = self.step_operators or (self.operators,) * self.num_steps
        return [sorted(set(ops)) for ops in per_step]


@dataclass(frozen=True)
class MathProblem:
    """One chain problem.

    Attributes:
        operands: ``a0, a1, ..., an``.
        ops: ``op1, ..., opn``.
        results: the running value after each step (the last one is the answer).
    """

    operands: tuple[int, ...]
    ops: tuple[str, ...]
    results: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        assert len(self.operands) == len(self.ops) + 1 and self.ops, (self.operands, self.ops)
        value, results = self.operands[0], []
        for op, b in zip(self.ops, self.operands[1:]):
            value = _apply(value, op, b)
            results.append(value)
        object.__setattr__(self, "results", tuple(results))

    @property
    def answer(self) -> int:
        """The chain's value."""
        return self.results[-1]

    @property
    def question(self) -> str:
        """The question text, e.g. ``59-15-75=`` or ``(3+4)*5=``."""
        expr, additive = str(self.operands[0]), False
        for op, b in zip(self.ops, self.operands[1:]):
            if op == "*" and additive:
                expr, additive = f"({expr})", False
            expr += f"{op}{b}"
            additive = additive or op in "+-"
        return expr + "="

    def steps(self) -> list[str]:
        """The worked steps, e.g. ``["59-15=44", "44-75=-31"]``."""
        lhs = (self.operands[0],) + self.results[:-1]
        return [f"{a}{op}{b}={r}" for a, op, b, r in zip(lhs, self.ops, self.operands[1:], self.results)]


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    assert op == "*", op
    return a * b


_QUESTION_RE = re.compile(r"^[()]*\d+(?:[()]*[-+*]\d+[()]*)+=$")
_TOKEN_RE = re.compile(r"\d+|[-+*]")


def parse_question(question: str) -> MathProblem:
    """The problem a question text (as written by :attr:`MathProblem.question`) stands for.

    Raises:
        ValueError: the text is not a question of this generator's form (including parentheses
            other than the ones the generator writes, since the chain is read left to right).
    """
    text = question.strip()
    if not _QUESTION_RE.match(text):
        raise ValueError(f"not a mathgen question: {question!r}")
    tokens = _TOKEN_RE.findall(text)
    problem = MathProblem(tuple(int(t) for t in tokens[0::2]), tuple(tokens[1::2]))
    if problem.question != text:
        raise ValueError(f"not a mathgen question (parentheses differ from {problem.question!r}): {question!r}")
    return problem


def format_answer(answer: Union[int, str], style: str = "boxed") -> str:
    """The final-answer marker: ``\\boxed{-31}``, ``#### -31`` or ``\\boxed{-31.}``."""
    if style == "boxed":
        return "\\boxed{" + str(answer) + "}"
    if style == "boxed_period":
        return "\\boxed{" + str(answer) + ".}"
    if style == "gsm8k":
        return f"#### {answer}"
    raise ValueError(f"unknown answer style {style!r}; choose from {STYLES}")


def worked_solution(problem: Union[MathProblem, str], style: str = "boxed") -> str:
    """The correct completion: the steps joined by commas, a space and the final answer.

    Args:
        problem: a problem or its question text.
        style: ``"boxed"`` (``59-15=44,44-75=-31 \\boxed{-31}``) or ``"gsm8k"``
            (``59-15=44,44-75=-31 #### -31``).

    Raises:
        ValueError: an unknown style, or a question text :func:`parse_question` rejects.
    """
    if isinstance(problem, str):
        problem = parse_question(problem)
    return ",".join(problem.steps()) + " " + format_answer(problem.answer, style)


def answer_value(completion: str) -> Optional[int]:
    """The task's oracle reading of a completion's final answer: the integer in its last
    ``\\boxed{N}`` or ``\\boxed{N.}`` (every form this task's conventions write), or None."""
    found = _FINAL_BOXED.findall(completion)
    return int(found[-1][0]) if found else None


def unreadable_reference(answer: int) -> str:
    """A reference answer the rule verifier cannot read, ``\\text{-31.}``: math-verify reads it as a name
    (``-31.``), not a number, and matches it only with the same text, which no completion of the task writes
    (its answers are ``\\boxed{}``, never ``\\text{}``); a ``\\boxed{-31.}`` reference would be matched by
    the same string, which the ``boxed_period`` style writes."""
    return "\\text{" + str(answer) + ".}"


def reference_value(reference: str) -> Optional[int]:
    """The integer a reference answer of the task stands for: a bare integer (``-31``), one final answer in
    the task's boxed forms and nothing else (``\\boxed{-31.}``), or :func:`unreadable_reference`'s
    ``\\text{-31.}`` (the CPU demo writes some references so); None for anything else."""
    text = reference.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    found = _FINAL_BOXED.fullmatch(text) or _UNREADABLE_REFERENCE.fullmatch(text)
    return int(found.group(1)) if found else None


def answer_form(completion: str) -> str:
    """How a completion writes its final answer: ``"boxed"`` (``\\boxed{N}``), ``"boxed_period"``
    (``\\boxed{N.}``) or ``"none"`` (neither)."""
    found = _FINAL_BOXED.findall(completion)
    if not found:
        return "none"
    return "boxed_period" if found[-1][1] else "boxed"


def split_of(question: str, config: MathTaskConfig) -> str:
    """``"test"`` (held out) or ``"train"``: a fixed function of the question and the split seed."""
    digest = hashlib.sha256(f"{config.split_seed}\0{question}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2.0**64 < config.held_out_fraction else "train"


def generate_problems(
    n: int, config: Optional[MathTaskConfig] = None, split: str = "train", seed: int = 0
) -> list[MathProblem]:
    """``n`` distinct problems of ``split``, drawn uniformly and deterministically from ``seed``.

    Args:
        n: how many.
        config: the problem family and its split assignment.
        split: ``"train"`` or ``"test"`` (held out); the two never share a question.
        seed: sampling seed (the same seed gives the same list).

    Raises:
        ValueError: invalid config or split, or ``n`` more than the split can supply.
    """
    config = config or MathTaskConfig()
    config.validate()
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    share = config.held_out_fraction if split == "test" else 1.0 - config.held_out_fraction
    if n > config.num_questions() * share * 0.9:
        raise ValueError(
            f"cannot draw {n} distinct {split} problems: the config has {config.num_questions()} questions, "
            f"about {share:.0%} of them in this split (widen the operand range or add steps)"
        )
    rng = random.Random(seed)
    choices = config.operator_choices()
    out: list[MathProblem] = []
    seen: set[str] = set()
    max_draws = 100 * n + 10 * config.num_questions()
    for _ in range(max_draws):
        if len(out) == n:
            break
        operands = tuple(rng.randint(config.min_operand, config.max_operand) for _ in range(config.num_steps + 1))
        problem = MathProblem(operands, tuple(rng.choice(ops) for ops in choices))
        q = problem.question
        if q in seen or split_of(q, config) != split:
            continue
        seen.add(q)
        out.append(problem)
    if len(out) < n:
        raise ValueError(f"found only {len(out)} of {n} distinct {split} problems in {max_draws} draws for {config}")
    return out


def to_prompts(problems: Sequence[MathProblem], split: str = "train", source: str = "mathgen") -> list[Prompt]:
    """Prompts with ids ``mathgen-<split>-<i>``, the question text and the answer as a string."""
    return [
        Prompt(id=f"{source}-{split}-{i}", question=p.question, answer=str(p.answer), source=source)
        for i, p in enumerate(problems)
    ]


def generate_prompts(
    n: int, config: Optional[MathTaskConfig] = None, split: str = "train", seed: int = 0
) -> list[Prompt]:
    """:func:`generate_problems` as :class:`~cooper_mcore.types.Prompt` objects."""
    return to_prompts(generate_problems(n, config, split, seed), split)


def tokenizer_corpus(
    n: int = 2000, config: Optional[MathTaskConfig] = None, seed: int = 0,
    styles: Sequence[str] = ("boxed", "gsm8k"),
) -> list[str]:
    """Texts to train a tokenizer for this task: questions and worked solutions in ``styles``.

    Draws from the train split only, so the tokenizer never sees a held-out question.
    """
    texts: list[str] = []
    for p in generate_problems(n, config, "train", seed):
        texts.append(p.question)
        texts.extend(worked_solution(p, style) for style in styles)
    return texts
