"""The demo's task: two families of arithmetic problems, one of which the rule verifier often misses.

The paper's premise is an asymmetry between its two verifiers: a rule verifier (math-verify) is
precise but brittle, it misses correct answers written in a form it cannot parse (precision 96%,
recall 63% in the paper), while a reference-based reward model is robust but hackable. The demo
builds that asymmetry into its task, by design:

* family ``plus_minus`` (about two thirds of the problems): ``7-1-1=``, worked as
  ``7-1=6,6-1=5 \\boxed{5}``; the rule verifier reads every answer;
* family ``times`` (``task.times_share``, about a third): ``3*4-5=``, worked as
  ``3*4=12,12-5=7 \\boxed{7.}``. Its convention writes the final answer with a trailing period,
  a form math-verify does not read as a number, so the rule calls these correct answers wrong; a
  small share (``task.times_parseable``) of its worked solutions write the plain ``\\boxed{7}``, so
  the rule still finds some positives there: the rule misses answers, not a whole problem type.

A policy can learn to write the form the rule reads, and then the rule rewards it again. So, for a
share of the problems of both families (``task.unreadable_share``, chosen by a hash of the question),
the *reference* is written ``\\text{7.}``, which the rule verifier cannot read: math-verify takes it for
a name, matched only by the same text, which the policy never writes (its answers are boxed). Those items
are unverifiable for the rule whatever the policy writes (no rule reward, no Cooper positive), while the
reward model reads the reference. The premise lasts through training on those problems. (A reference
``\\boxed{7.}`` would not do: math-verify matches it with the same string, the ``times`` convention.)

The truth is known: :func:`cooper_mcore.data.mathgen.answer_value` (the task's oracle) reads both
forms, and the demo's held-out accuracy, its RM's training labels (a simulated judge) and its
benchmark use it. With ``times_share`` 0 the task is the single-family one (the control of
``cooper demo --full``).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cooper_mcore.data.mathgen import (
    MathProblem,
    MathTaskConfig,
    answer_form,
    generate_problems,
    reference_value,
    tokenizer_corpus,
    unreadable_reference,
    worked_solution,
)
from cooper_mcore.data.templates import RM_TEMPLATE, rm_input
from cooper_mcore.jobs.sft import Example, math_sft_examples
from cooper_mcore.types import Prompt

__all__ = ["FAMILIES", "GROUPS", "ISOLATE", "NUMBER_TOKENS", "RM_TAGS", "UNREADABLE", "DemoTask", "Family", "family_of",
           "like_reference"]

Family = Literal["plus_minus", "times"]
FAMILIES: tuple[Family, ...] = ("plus_minus", "times")
#: the group of problems whose reference the rule verifier cannot read (reported apart)
UNREADABLE = "rule_unreadable"
#: the problem groups the report gives figures for: each family, and the rule-unreadable problems
GROUPS: tuple[str, ...] = (*FAMILIES, UNREADABLE)
#: characters the demo's tokenizer keeps as tokens of their own: a number is the same tokens wherever
#: it is written (``=-13``, ``\\boxed{-13}``, the reference ``-13``), so answer equality is a token match
ISOLATE = "-+*=,{}."
#: with ``task.number_tokens``, the whole numbers the tokenizer keeps as one token each as well (every
#: result of the task's chains, -18 to 90, is then a sign and one token): the reward model compares an
#: answer with the reference by one token's identity instead of digit by digit, which it learns several
#: times faster (measured on the demo's RM data: 0.73-0.79 against 0.53 validation accuracy after 7 epochs
#: from random weights)
NUMBER_TOKENS = tuple(str(n) for n in range(10, 100))
#: the VerifyRM template's tags (``<question>``, ..., ``</completion>``), one token each: the RM's inputs are
#: a third shorter, so each epoch of its training is faster (the policy never reads them)
RM_TAGS = tuple(re.findall(r"</?\w+>", RM_TEMPLATE))


def family_of(question: str) -> Family:
    """The family of a question: ``times`` when it has a ``*`` step, else ``plus_minus``."""
    return "times" if "*" in question else "plus_minus"


def like_reference(reference: str, value: int) -> str:
    """``value`` written as ``reference`` is: ``\\text{v.}`` for a rule-unreadable reference, else bare."""
    if reference.strip() == str(reference_value(reference)):
        return str(value)
    return unreadable_reference(value)


@dataclass(frozen=True)
class DemoTask:
    """The two-family task.

    Attributes:
        max_operand: operands are 0..max_operand (both families).
        operators: the ``plus_minus`` family's operators (two steps).
        times_share: share of the ``times`` family among the problems of each split (0: one family).
        times_parseable: share of the ``times`` family's worked solutions written ``\\boxed{N}``
            (the rule reads them) instead of ``\\boxed{N.}``.
        split_seed: the train/held-out assignment (a fixed function of the question).
        unreadable_share: share of the problems (by a hash of the question and ``split_seed``) whose
            reference is written ``\\text{N.}``, which the rule verifier cannot read.
    """

    max_operand: int = 9
    operators: tuple[str, ...] = ("+", "-")
    times_share: float = 1 / 3
    times_parseable: float = 0.25
    split_seed: int = 0
    unreadable_share: float = 0.0

    def __post_init__(self) -> None:
        for name in ("times_share", "times_parseable", "unreadable_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"task.{name} must be in [0, 1], got {getattr(self, name)}")

    def configs(self) -> dict[Family, MathTaskConfig]:
        """The generator of each family."""
        return {"plus_minus": MathTaskConfig(num_steps=2, max_operand=self.max_operand, operators=self.operators,
                                             split_seed=self.split_seed),
                "times": MathTaskConfig(num_steps=2, max_operand=self.max_operand,
                                        step_operators=(("*",), ("+", "-")), split_seed=self.split_seed)}

    def problems(self, n: int, split: str, seed: int) -> list[MathProblem]:
        """``n`` distinct problems of ``split``: ``round(times_share * n)`` of the ``times`` family,
        the rest ``plus_minus``, in a seeded random order."""
        n_times = round(self.times_share * n)
        cfg = self.configs()
        out = (generate_problems(n - n_times, cfg["plus_minus"], split, seed)
               + generate_problems(n_times, cfg["times"], split, seed + 1))
        random.Random(seed).shuffle(out)
        return out

    def rule_unreadable(self, question: str) -> bool:
        """Whether the problem's reference is written so that the rule verifier cannot read it: a fixed
        function of the question (a hash with the split seed) true for ``unreadable_share`` of them."""
        digest = hashlib.sha256(f"unreadable\0{self.split_seed}\0{question}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64 < self.unreadable_share

    def reference(self, problem: MathProblem) -> str:
        """The reference answer of a problem: ``\\text{N.}`` (:func:`~cooper_mcore.data.mathgen.unreadable_reference`)
        when :meth:`rule_unreadable`, else ``N``."""
        if self.rule_unreadable(problem.question):
            return unreadable_reference(problem.answer)
        return str(problem.answer)

    def prompts(self, n: int, split: str, seed: int) -> list[Prompt]:
        """:meth:`problems` as prompts (ids ``mathgen-<split>-<i>``), with their :meth:`reference`."""
        return [Prompt(id=f"mathgen-{split}-{i}", question=p.question, answer=self.reference(p), source="mathgen")
                for i, p in enumerate(self.problems(n, split, seed))]

    def groups_of(self, question: str) -> tuple[str, ...]:
        """The report groups (:data:`GROUPS`) a question belongs to: its family, and ``rule_unreadable``."""
        return (family_of(question), *((UNREADABLE,) if self.rule_unreadable(question) else ()))

    def style(self, problem: MathProblem, rng: random.Random) -> str:
        """The final-answer form of one worked solution: the family's convention."""
        if family_of(problem.question) == "plus_minus":
            return "boxed"
        return "boxed" if rng.random() < self.times_parseable else "boxed_period"

    def sft_examples(self, tokenizer: Any, n: int, seed: int, mix_wrong: float) -> list[Example]:
        """SFT pairs for ``n`` train problems in the families' conventions, ``mix_wrong`` of them
        plausible wrong worked solutions (:func:`cooper_mcore.jobs.sft.math_sft_examples`)."""
        return math_sft_examples(tokenizer, n, seed=seed, mix_wrong=mix_wrong, style=self.style,
                                 problems=self.problems(n, "train", seed))

    def tokenizer_corpus(self, seed: int) -> list[str]:
        """Questions and worked solutions of both families in every form, and the VerifyRM template."""
        cfg = self.configs()
        texts = tokenizer_corpus(2000, cfg["plus_minus"], seed, styles=("boxed",))
        texts += tokenizer_corpus(1000, cfg["times"], seed, styles=("boxed", "boxed_period"))
        # the VerifyRM template's tags too, so that each is a few tokens rather than one <unk> per letter
        return texts + [rm_input(p.question, str(p.answer), worked_solution(p))
                        for p in self.problems(200, "train", seed)]


def form_shares(completions: Sequence[str]) -> dict[str, float]:
    """Share of each final-answer form (``boxed``, ``boxed_period``, ``none``) among completions."""
    forms = [answer_form(c) for c in completions]
    n = len(forms)
    return {f: (forms.count(f) / n if n else float("nan")) for f in ("boxed", "boxed_period", "none")}
