"""Programmatic negatives made by editing a verified-correct solution (no LLM needed).

* :class:`AnswerPerturbation`: the positive with its final answer changed to a nearby wrong number
  (any task whose final answer is a number or a choice letter).
* :class:`ChainRewrite`: an offline stand-in for the paper's assistant on the arithmetic-chain task
  of :mod:`cooper_mcore.data.mathgen` (``59-15=44,44-75=-31 \\boxed{-31}``): the correct chain is
  rewritten into a convincing wrong one: one step off with the rest of the chain carried on
  consistently, an intermediate result copied as the final answer, or a correct chain with a wrong
  final line; its final value always differs from the positive's (wrong by construction), and its
  final answer may be written in the form the policy writes for the prompt, ``\\boxed{-30.}``
  included, which the rule verifier cannot read (``forms="rollouts"``).

A perturbation is checked by the rule verifier against the gold answer (gold first); a chain
rewrite by the paper's rule check: the positive must verify against the gold, and the rewrite must
not verify against the positive (the reference code's ``not verify(neg, pos)``, gold-side first).
Only the first candidate that passes is kept.
"""

from __future__ import annotations

import operator
import random
import re
import typing
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Literal, Optional

import torch

from cooper_mcore.data.mathgen import answer_form, format_answer
from cooper_mcore.types import Prompt, RolloutGroup
from cooper_mcore.verify.protocols import BatchVerifier

__all__ = ["REWRITE_FORMS", "REWRITE_KINDS", "AnswerPerturbation", "ChainRewrite", "RewriteForms", "final_answer_span",
           "number_variants"]

_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_LETTER = re.compile(r"^\s*\(?([A-J])\)?\s*$")


def _boxed_span(text: str) -> Optional[tuple[int, int]]:
    """The content span of the last ``\\boxed{...}`` or ``\\fbox{...}`` with balanced braces."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for j in range(start, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return start, j
    return None


def final_answer_span(text: str) -> Optional[tuple[int, int]]:
    """Where the final answer of a completion sits: ``(start, end)`` character offsets, or None.

    The content of the last ``\\boxed{...}``; else the rest of the line after the last ``####``;
    else the last number in the text.
    """
    span = _boxed_span(text)
    if span is not None:
        return span
    pos = text.rfind("####")
    if pos >= 0:
        start = pos + 4
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        content = text[start:end]
        lead = len(content) - len(content.lstrip())
        if content.strip():
            return start + lead, start + len(content.rstrip())
    numbers = list(_NUMBER.finditer(text))
    if numbers:
        return numbers[-1].span()
    return None


def _format_number(value: Decimal, like: str) -> str:
    return format(value, ",f" if "," in like else "f")


def number_variants(token: str, rng: random.Random, allow_sign_change: bool = True) -> list[str]:
    """Plausible wrong numbers near ``token`` (a decimal numeral, maybe with sign and thousands commas).

    Off by ±1, ±2 and ±10, doubled, sign-flipped, or with two adjacent digits swapped; shuffled by
    ``rng``; never ``token``'s own value.

    Args:
        token: the number as written.
        rng: source of the shuffle.
        allow_sign_change: if False, only variants of the same sign (zero excluded), for numbers
            inside a larger expression such as ``\\frac{3}{4}``.
    """
    try:
        value = Decimal(token.replace(",", ""))
    except InvalidOperation as e:
        raise ValueError(f"not a number: {token!r}") from e
    candidates = [value + d for d in (1, -1, 2, -2, 10, -10)] + [value * 2]
    if value != 0:
        candidates.append(-value)
    digits = token.lstrip("-")
    swaps = [i for i in range(len(digits) - 1)
             if digits[i].isdigit() and digits[i + 1].isdigit() and digits[i] != digits[i + 1]
             and not (i == 0 and digits[1] == "0")]
    if swaps:
        i = rng.choice(swaps)
        swapped = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2:]
        candidates.append(Decimal(("-" if token.startswith("-") else "") + swapped.replace(",", "")))
    if not allow_sign_change:
        candidates = [c for c in candidates if c != 0 and (c < 0) == (value < 0)]
    seen = {value}
    out = []
    for c in candidates:
        if c not in seen:
            seen.add(c)
            out.append(_format_number(c, token))
    rng.shuffle(out)
    return out


class AnswerPerturbation:
    """The positive with its final answer changed to a nearby wrong number, verified wrong.

    The final answer is found by :func:`final_answer_span`; the last number inside it is
    replaced by a variant from :func:`number_variants` (a single choice letter A-J by another
    letter). When the whole answer is that number, its other stand-alone occurrences on the same
    line and the line before change too ("9 * 2 = 18.\\n#### 18" becomes "9 * 2 = 19.\\n#### 19"), so
    that the negative is a slip rather than a contradiction. Up to ``num_candidates`` variants per
    item go to the verifier in one batch; the first verified wrong is kept.

    Args:
        verifier: the rule verifier.
        seed: seed of the choice of variants.
        num_candidates: variants tried per item.

    Attributes:
        stats: cumulative counters: requested, accepted, no_answer, rejected (no variant verified
            wrong).
    """

    source = "perturb"

    def __init__(self, verifier: BatchVerifier, seed: int = 0, num_candidates: int = 3):
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        self.verifier = verifier
        self.num_candidates = int(num_candidates)
        self._rng = random.Random(seed)
        self.stats = dict.fromkeys(("requested", "accepted", "no_answer", "rejected"), 0)

    def candidates(self, text: str) -> list[str]:
        """Up to ``num_candidates`` copies of ``text`` with the final answer changed (unverified)."""
        span = final_answer_span(text)
        if span is None:
            return []
        start, end = span
        content = text[start:end]
        letter = _LETTER.match(content)
        if letter is not None:
            old = letter.group(1)
            choices = [c for c in "ABCDE" if c != old] if old in "ABCDE" else [c for c in "ABCDEFGHIJ" if c != old]
            self._rng.shuffle(choices)
            a, b = letter.span(1)
            return [text[:start] + content[:a] + c + content[b:] + text[end:]
                    for c in choices[: self.num_candidates]]
        numbers = list(_NUMBER.finditer(content))
        if not numbers:
            return []
        last = numbers[-1]
        token = last.group(0)
        whole = content.strip() == token
        line_start = text.rfind("\n", 0, start) + 1
        region_start = text[:line_start].rstrip().rfind("\n") + 1
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        same = re.compile(r"(?<![\d.,])" + re.escape(token) + r"(?![\d]|[.,]\d)")
        out = []
        for variant in number_variants(token, self._rng, allow_sign_change=whole)[: self.num_candidates]:
            new_content = content[: last.start()] + variant + content[last.end():]
            if whole:
                before = same.sub(variant, text[region_start:start])
                after = same.sub(variant, text[end:line_end])
                out.append(text[:region_start] + before + new_content + after + text[line_end:])
            else:
                out.append(text[:start] + new_content + text[end:])
        return out

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """A verified-wrong perturbation of each positive, or None."""
        self.stats["requested"] += len(items)
        per_item = [self.candidates(text) for _, text in items]
        chosen = _first_verified_wrong(self.verifier, [p.answer for p, _ in items], per_item)
        out: list[Optional[str]] = []
        for cands, c in zip(per_item, chosen):
            out.append(None if c is None else cands[c])
            self.stats["accepted" if c is not None else "no_answer" if not cands else "rejected"] += 1
        return out


def _first_verified_wrong(verifier: BatchVerifier, golds: Sequence[str],
                          per_item: Sequence[Sequence[str]]) -> list[Optional[int]]:
    """Per item, the index of its first candidate the verifier calls wrong (gold first), or None.

    All candidates of all items go to the verifier in one batch.
    """
    flat = [c for cands in per_item for c in cands]
    flat_golds = [g for g, cands in zip(golds, per_item) for _ in cands]
    verdicts = list(verifier.verify_batch(flat_golds, flat)) if flat else []
    assert len(verdicts) == len(flat), "verifier returned the wrong number of verdicts"
    out: list[Optional[int]] = []
    k = 0
    for cands in per_item:
        out.append(next((j for j, v in enumerate(verdicts[k:k + len(cands)]) if v.correct is False), None))
        k += len(cands)
    return out


# ----------------------------------------------------------------------------------------------
# Arithmetic-chain rewrite


REWRITE_KINDS: tuple[str, ...] = ("step", "copy", "final")
RewriteForms = Literal["positive", "rollouts"]
REWRITE_FORMS: tuple[str, ...] = typing.get_args(RewriteForms)
#: how far a slipped step is off.
STEP_SLIPS = (1, -1, 2, -2, 10, -10)
_BOXED_INT = re.compile(r"-?\d+\.?")
_FORMS = ("boxed", "boxed_period", "none")  # answer_form's
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_STEP = re.compile(r"(?<![\d.])(-?\d+)\s*([-+*])\s*(\d+)\s*=\s*(-?\d+)(?![\d.])")


class _Step:
    """One ``a op b = r`` step of a chain and where it is written."""

    __slots__ = ("a", "op", "b", "r", "span")

    def __init__(self, a: int, op: str, b: int, r: int, span: tuple[int, int]):
        self.a, self.op, self.b, self.r, self.span = a, op, b, r, span

    def text(self) -> str:
        return f"{self.a}{self.op}{self.b}={self.r}"


def parse_chain(text: str) -> Optional[tuple[list[_Step], tuple[int, int]]]:
    """The worked chain of a completion and its final answer's span, or None if it is not a clean chain.

    A clean chain: the ``a op b = r`` steps written before the final answer (see
    :func:`final_answer_span`) are each arithmetically right, each starts from the previous result,
    and the final answer is the last result.
    """
    span = final_answer_span(text)
    if span is None:
        return None
    steps = [_Step(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)), m.span())
             for m in _STEP.finditer(text, 0, span[0])]
    if not steps or text[span[0]:span[1]].strip() != str(steps[-1].r):
        return None
    for prev, step in zip([None, *steps[:-1]], steps):
        if _OPS[step.op](step.a, step.b) != step.r or (prev is not None and step.a != prev.r):
            return None
    return steps, span


def _replace(text: str, edits: Sequence[tuple[tuple[int, int], str]]) -> str:
    for (start, end), new in sorted(edits, key=lambda e: e[0][0], reverse=True):
        text = text[:start] + new + text[end:]
    return text


class ChainRewrite:
    """Assistant-like negatives for the arithmetic-chain task, written offline and wrong by construction.

    Kinds (:data:`REWRITE_KINDS`), each a convincing wrong solution made from the verified-correct
    positive ``59-15=44,44-75=-31 \\boxed{-31}``:

    * ``"step"``: one step off by a small slip (:data:`STEP_SLIPS`), the rest of the chain carried on
      consistently from the wrong value (``59-15=45,45-75=-30 \\boxed{-30}``);
    * ``"copy"``: an earlier intermediate result (an operand for a one-step chain) copied as the final
      answer (``59-15=44,44-75=-31 \\boxed{44}``);
    * ``"final"``: the chain left right and the final line wrong, a near miss from
      :func:`number_variants` (``59-15=44,44-75=-31 \\boxed{-30}``).

    A rewrite whose final value equals the positive's (a slip that a later ``* 0`` undoes) is dropped:
    every negative has its value changed. ``forms`` says how its final answer is written: as in the
    positive (``"positive"``), or (``"rollouts"``) in the form of one of the prompt's rollouts drawn at
    random (:func:`~cooper_mcore.data.mathgen.answer_form`; the groups come from :meth:`set_groups`),
    so that the negatives follow the forms the policy writes, ``\\boxed{-30.}`` included, which the
    rule verifier cannot read and so never calls wrong by itself.

    A positive that is not a clean chain (:func:`parse_chain`) gets only the ``"final"`` kind. Up to
    ``num_candidates`` candidates per item (kinds taken in turn from a random start) go to the verifier
    in one batch with the positive itself; the first that passes the paper's rule check is kept: the
    positive verifies against the gold (a gold the verifier cannot read leaves the item without a
    negative) and the candidate does not verify against the positive (``not verify(neg, pos)``).

    Args:
        verifier: the rule verifier.
        seed: seed of the choices.
        kinds: the kinds to use, a non-empty subset of :data:`REWRITE_KINDS`.
        num_candidates: candidates tried per item.
        forms: ``"positive"`` or ``"rollouts"`` (:data:`REWRITE_FORMS`).

    Attributes:
        stats: cumulative counters: requested, accepted, no_answer (no final answer, or no kind
            applies), rejected (no candidate passed the check), not_a_chain (texts given to
            :meth:`candidates` that are not a clean chain), ``accepted_<kind>`` and
            ``accepted_form_<form>``.
    """

    source = "rewrite"

    def __init__(self, verifier: BatchVerifier, seed: int = 0, kinds: Sequence[str] = REWRITE_KINDS,
                 num_candidates: int = 3, forms: RewriteForms = "positive"):
        kinds = tuple(kinds)
        if not kinds or any(k not in REWRITE_KINDS for k in kinds):
            raise ValueError(f"rewrite kinds must be a non-empty subset of {REWRITE_KINDS}, got {kinds}")
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        if forms not in REWRITE_FORMS:
            raise ValueError(f"rewrite forms must be one of {REWRITE_FORMS}, got {forms!r}")
        self.verifier = verifier
        self.kinds = kinds
        self.num_candidates = int(num_candidates)
        self.forms: RewriteForms = forms
        self._rng = random.Random(seed)
        self._rollout_forms: dict[str, list[str]] = {}
        self.stats = dict.fromkeys(("requested", "accepted", "no_answer", "rejected", "not_a_chain",
                                    *(f"accepted_{k}" for k in REWRITE_KINDS),
                                    *(f"accepted_form_{f}" for f in _FORMS)), 0)

    def set_groups(self, groups: Sequence[RolloutGroup], scores: Optional[torch.Tensor] = None) -> None:
        """Note the answer forms of each prompt's rollouts (``forms="rollouts"``; ``scores`` is not used)."""
        self._rollout_forms = {g.prompt.id: [f for f in (answer_form(s.text) for s in g.samples) if f != "none"]
                               for g in groups}

    def rewrite(self, text: str, kind: str) -> Optional[str]:
        """One unverified rewrite of ``text`` of the given kind, or None if the kind does not apply."""
        return self._rewrite(text, kind, parse_chain(text))

    def _rewrite(self, text: str, kind: str, parsed: Optional[tuple[list[_Step], tuple[int, int]]]) -> Optional[str]:
        if kind == "final":
            span = final_answer_span(text)
            if span is None:
                return None
            try:
                variants = number_variants(text[span[0]:span[1]].strip(), self._rng)
            except ValueError:  # not a number (e.g. a choice letter)
                return None
            return _replace(text, [(span, variants[0])]) if variants else None
        if parsed is None:
            return None
        steps, span = parsed
        if kind == "copy":
            pool = [s.r for s in steps[:-1]] or [steps[0].a, steps[0].b]
            pool = [v for v in pool if v != steps[-1].r]
            return _replace(text, [(span, str(self._rng.choice(pool)))]) if pool else None
        assert kind == "step", kind
        i = self._rng.randrange(len(steps))
        new = [_Step(s.a, s.op, s.b, s.r, s.span) for s in steps]
        new[i].r += self._rng.choice(STEP_SLIPS)
        for j in range(i + 1, len(new)):
            new[j].a = new[j - 1].r
            new[j].r = _OPS[new[j].op](new[j].a, new[j].b)
        edits = [(s.span, s.text()) for s in new[i:]] + [(span, str(new[-1].r))]
        return _replace(text, edits)

    def candidates(self, text: str, form: Optional[str] = None) -> list[tuple[str, str]]:
        """Up to ``num_candidates`` distinct ``(kind, rewrite)`` of ``text`` (unverified), each with a
        final value other than the positive's, written in ``form`` (``boxed`` or ``boxed_period``;
        None: as in ``text``)."""
        parsed = parse_chain(text)
        if parsed is None:
            self.stats["not_a_chain"] += 1
        old = _final_value(text)
        start = self._rng.randrange(len(self.kinds))
        out: list[tuple[str, str]] = []
        for c in range(self.num_candidates * len(self.kinds)):
            if len(out) == self.num_candidates:
                break
            kind = self.kinds[(start + c) % len(self.kinds)]
            new = self._rewrite(text, kind, parsed)
            if new is not None and form is not None:
                new = _in_form(new, form)
            if (new is not None and new != text and _final_value(new) != old
                    and all(new != t for _, t in out)):
                out.append((kind, new))
        return out

    def _form_of(self, prompt: Prompt) -> Optional[str]:
        """The form of this item's rewrites: one of the prompt's rollouts' forms (``forms="rollouts"``,
        drawn at random), or None (as the positive is written)."""
        seen = self._rollout_forms.get(prompt.id, []) if self.forms == "rollouts" else []
        return self._rng.choice(seen) if seen else None

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """A rewrite of each positive that passes the paper's rule check, or None."""
        self.stats["requested"] += len(items)
        per_item = [self.candidates(text, self._form_of(prompt)) for prompt, text in items]
        chosen = _first_rule_checked(self.verifier, items, [[t for _, t in cands] for cands in per_item])
        out: list[Optional[str]] = []
        for cands, c in zip(per_item, chosen):
            if c is None:
                out.append(None)
                self.stats["no_answer" if not cands else "rejected"] += 1
            else:
                kind, text = cands[c]
                out.append(text)
                self.stats["accepted"] += 1
                self.stats[f"accepted_{kind}"] += 1
                self.stats[f"accepted_form_{answer_form(text)}"] += 1
        return out


def _final_value(text: str) -> Optional[Decimal]:
    """The number in a text's final answer (:func:`final_answer_span`, a trailing period allowed), or None."""
    span = final_answer_span(text)
    if span is None:
        return None
    try:
        return Decimal(text[span[0]:span[1]].strip().rstrip(".").replace(",", ""))
    except InvalidOperation:
        return None


def _in_form(text: str, form: str) -> str:
    """``text`` with its final boxed integer written in ``form`` (``boxed``: ``\\boxed{-30}``,
    ``boxed_period``: ``\\boxed{-30.}``); unchanged when its final answer is not a boxed integer."""
    span = _boxed_span(text)
    if span is None or not _BOXED_INT.fullmatch(text[span[0]:span[1]].strip()):
        return text
    start = text.rfind("\\boxed", 0, span[0])
    value = text[span[0]:span[1]].strip().rstrip(".")
    return text[:start] + format_answer(value, form) + text[span[1] + 1:]


def _first_rule_checked(verifier: BatchVerifier, items: Sequence[tuple[Prompt, str]],
                        per_item: Sequence[Sequence[str]]) -> list[Optional[int]]:
    """Per item, the index of its first candidate that passes the paper's rule check, or None: the
    positive verifies against the gold (gold first) and the candidate does not verify against the
    positive (the positive on the gold side: ``correct is False``; unverifiable is no pass).

    One batch checks the distinct positives; then one batch per round checks the next candidate of
    every item still without a negative (a rewrite changes the value, so the first usually passes).
    """
    positives = list(dict.fromkeys((p.answer, pos) for p, pos in items))
    verdicts = list(verifier.verify_batch([g for g, _ in positives], [pos for _, pos in positives])) if items else []
    assert len(verdicts) == len(positives), "verifier returned the wrong number of verdicts"
    correct = {key: v.correct is True for key, v in zip(positives, verdicts)}
    out: list[Optional[int]] = [None] * len(items)
    pending = [i for i, (p, pos) in enumerate(items) if correct[(p.answer, pos)]]
    for j in range(max((len(c) for c in per_item), default=0)):
        batch = [i for i in pending if j < len(per_item[i])]
        if not batch:
            break
        round_verdicts = list(verifier.verify_batch([items[i][1] for i in batch], [per_item[i][j] for i in batch]))
        assert len(round_verdicts) == len(batch), "verifier returned the wrong number of verdicts"
        for i, v in zip(batch, round_verdicts):
            if v.correct is False:
                out[i] = j
        pending = [i for i in batch if out[i] is None]
    return out
