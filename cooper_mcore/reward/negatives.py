"""Negatives for the reward model's contrastive update, and the preference pairs built from them.

Per prompt, the chosen side is the first rollout the rule verifier marked correct; the rejected
side is a verified-wrong solution from a :class:`NegativeGenerator`:

* :class:`LLMAssistant` (Cooper's method): an instruct model behind an OpenAI-compatible API
  rewrites the correct solution into a wrong but convincing one; a rewrite is kept only if the
  rule verifier says its answer is *not* equivalent to the gold answer.
* CPU alternatives for runs without an assistant LLM: :class:`PolicyWrongNegatives` (a rollout of
  the same prompt the verifier marked wrong), :class:`AnswerPerturbation` (the positive with its
  final answer changed to a nearby wrong number) and :class:`RandomOtherResponse` (the paper's
  ablation: a response to another prompt).

:func:`build_pairs` keeps one pair per prompt; pairs without a positive or without a negative are
kept but masked (``valid`` is False) so that callers can count them.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from typing import Optional, Protocol, runtime_checkable

from cooper_mcore.types import PreferencePair, Prompt, RolloutGroup

logger = logging.getLogger(__name__)


class VerdictLike(Protocol):
    """What a verifier returns per item: ``correct`` is True, False or None (unverifiable)."""

    @property
    def correct(self) -> Optional[bool]: ...


class BatchVerifier(Protocol):
    """The part of ``cooper_mcore.reward.verifier.RuleVerifier`` used here."""

    def verify_batch(self, golds: Sequence[str], preds: Sequence[str]) -> Sequence[VerdictLike]:
        """One verdict per (gold answer, full completion text), gold first."""
        ...


class ChatBatchClient(Protocol):
    """The part of :class:`cooper_mcore.reward.openai_client.OpenAIChatClient` used here."""

    def chat_batch(self, batch: Sequence[Sequence[dict[str, str]]], temperature: float = 0.7,
                   max_tokens: int | Sequence[int] = 512) -> list[Optional[str]]:
        """Contents in order; None for requests that failed after retries."""
        ...


class NegativeGenerator(Protocol):
    """Writes a verified-wrong negative for each (prompt, correct positive completion).

    Attributes:
        source: the :attr:`PreferencePair.source` tag of its negatives.
    """

    source: str

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """One negative per item, in order; None where none could be made."""
        ...


@runtime_checkable
class GroupAware(Protocol):
    """A generator that draws from the step's rollouts; :func:`build_pairs` hands them over first."""

    def set_groups(self, groups: Sequence[RolloutGroup]) -> None: ...


def _is_wrong(outcome: VerdictLike) -> bool:
    return outcome.correct is False


def _new_stats(*keys: str) -> dict[str, int]:
    return dict.fromkeys(("requested", "accepted", *keys), 0)


# ----------------------------------------------------------------------------------------------
# Assistant LLM


REWRITE_SYSTEM_PROMPT = (
    "You write realistic flawed solutions to math problems. They are used to train a grader that must learn to "
    "tell correct solutions from convincing wrong ones, so the flaws must be hard to spot."
)

REWRITE_USER_TEMPLATE = """Below are a math problem and a correct solution to it. Rewrite the solution into one \
that is completely wrong but convincing:
- introduce flawed reasoning (for example a subtle arithmetic slip, a misapplied formula, a wrong case analysis or an \
unjustified step) that leads to a different, incorrect final result; the correct final answer is {answer}, so your \
final answer must differ from it;
- keep a similar length, structure and level of detail as the original;
- state every step confidently and plausibly; never hint that anything is wrong and do not add notes about the errors;
- end with the final answer in the same format as the original (for example \\boxed{{...}}).
Output only the rewritten solution and its final answer, with no preamble.

Problem:
{question}

Correct solution:
{solution}"""

_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)


def rewrite_messages(question: str, solution: str, answer: str) -> list[dict[str, str]]:
    """The chat that asks the assistant for a wrong-but-convincing rewrite of ``solution``.

    Args:
        question: the problem statement.
        solution: a correct solution (the positive).
        answer: the gold answer, which the rewrite must not reach.
    """
    user = REWRITE_USER_TEMPLATE.format(question=question.strip(), solution=solution.strip(), answer=answer.strip())
    return [{"role": "system", "content": REWRITE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def clean_assistant_output(text: str) -> str:
    """Strip a leading ``<think>...</think>`` block (reasoning models) and surrounding whitespace."""
    return _THINK.sub("", text, count=1).strip()


class LLMAssistant:
    """Assistant-written negatives (Cooper): an instruct LLM rewrites the positive into a wrong one.

    Each request asks for ``len(positive.split()) + extra_tokens`` tokens at ``temperature``; a
    rewrite is kept only when ``verifier.verify_batch([gold], [rewrite])`` says
    ``correct is False``. Verdicts True and None (unverifiable) reject it.

    Args:
        client: an OpenAI-compatible chat client (retries and concurrency are its business).
        verifier: the rule verifier.
        temperature: sampling temperature of the assistant.
        extra_tokens: tokens allowed beyond the positive's word count.
        rounds: how many times an item whose rewrite was rejected or failed is asked again
            (1 = once, as in the paper).

    Attributes:
        stats: cumulative counters: requested, accepted, rejected_correct, rejected_unverifiable,
            failed_requests, empty.
        last_failed: per item of the last :meth:`generate` call, whether it got no negative
            because its (last) request failed after the client's retries.
    """

    source = "assistant"

    def __init__(self, client: ChatBatchClient, verifier: BatchVerifier, temperature: float = 0.7,
                 extra_tokens: int = 500, rounds: int = 1):
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if extra_tokens < 1:
            raise ValueError(f"extra_tokens must be >= 1, got {extra_tokens}")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.client = client
        self.verifier = verifier
        self.temperature = float(temperature)
        self.extra_tokens = int(extra_tokens)
        self.rounds = int(rounds)
        self.stats = _new_stats("rejected_correct", "rejected_unverifiable", "failed_requests", "empty")
        self.last_failed: list[bool] = []

    def max_tokens_for(self, positive: str) -> int:
        """The completion budget for rewriting ``positive``: its word count plus ``extra_tokens``."""
        return len(positive.split()) + self.extra_tokens

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """One verified-wrong rewrite per (prompt, positive), or None.

        Args:
            items: (prompt, correct completion) pairs.
        """
        self.stats["requested"] += len(items)
        out: list[Optional[str]] = [None] * len(items)
        request_failed = [False] * len(items)
        pending = list(range(len(items)))
        for _ in range(self.rounds):
            if not pending:
                break
            chats = [rewrite_messages(items[i][0].question, items[i][1], items[i][0].answer) for i in pending]
            limits = [self.max_tokens_for(items[i][1]) for i in pending]
            texts = self.client.chat_batch(chats, temperature=self.temperature, max_tokens=limits)
            assert len(texts) == len(pending), f"client returned {len(texts)} answers for {len(pending)} chats"
            idx: list[int] = []
            candidates: list[str] = []
            for i, text in zip(pending, texts):
                request_failed[i] = text is None
                if text is None:
                    self.stats["failed_requests"] += 1
                    continue
                text = clean_assistant_output(text)
                if not text:
                    self.stats["empty"] += 1
                    continue
                idx.append(i)
                candidates.append(text)
            if candidates:
                verdicts = self.verifier.verify_batch([items[i][0].answer for i in idx], candidates)
                assert len(verdicts) == len(candidates), "verifier returned the wrong number of verdicts"
                for i, text, verdict in zip(idx, candidates, verdicts):
                    if verdict.correct is False:
                        out[i] = text
                        self.stats["accepted"] += 1
                    elif verdict.correct is True:
                        self.stats["rejected_correct"] += 1
                    else:
                        self.stats["rejected_unverifiable"] += 1
            pending = [i for i in pending if out[i] is None]
        self.last_failed = [out[i] is None and request_failed[i] for i in range(len(items))]
        logger.debug("assistant negatives: %s", self.stats)
        return out


# ----------------------------------------------------------------------------------------------
# CPU alternatives


class PolicyWrongNegatives:
    """A rollout of the same prompt that the rule verifier marked wrong (``rule_correct is False``).

    The groups come from :meth:`set_groups` (which :func:`build_pairs` calls each step) or the
    constructor. Samples with ``rule_correct`` None (unverified) are never used.

    Args:
        groups: the step's rollout groups, if known now.
        seed: seed of the choice among several wrong rollouts.

    Attributes:
        stats: cumulative counters: requested, accepted, no_wrong_rollout.
    """

    source = "policy"

    def __init__(self, groups: Optional[Sequence[RolloutGroup]] = None, seed: int = 0):
        self._rng = random.Random(seed)
        self._wrong: dict[str, list[str]] = {}
        self.stats = _new_stats("no_wrong_rollout")
        if groups is not None:
            self.set_groups(groups)

    def set_groups(self, groups: Sequence[RolloutGroup]) -> None:
        """Use these rollouts from now on (replacing earlier ones)."""
        wrong: dict[str, list[str]] = {}
        for g in groups:
            texts = wrong.setdefault(g.prompt.id, [])
            texts.extend(s.text for s in g.samples if s.rule_correct is False and s.text.strip())
        self._wrong = wrong

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """A wrong rollout per item, or None if its group has none.

        Raises:
            ValueError: if an item's prompt is not among the groups given.
        """
        self.stats["requested"] += len(items)
        out: list[Optional[str]] = []
        for prompt, _positive in items:
            if prompt.id not in self._wrong:
                raise ValueError(f"prompt {prompt.id!r} is not in the rollout groups given to PolicyWrongNegatives "
                                 "(call set_groups with this step's groups)")
            texts = self._wrong[prompt.id]
            out.append(self._rng.choice(texts) if texts else None)
            self.stats["accepted" if texts else "no_wrong_rollout"] += 1
        return out


class RandomOtherResponse:
    """The paper's ablation: a random response to *another* prompt of the batch (seeded).

    Draws from all rollouts of other prompts when groups are known (:meth:`set_groups`, called
    by :func:`build_pairs`), else from the other items' positives.

    Args:
        seed: seed of the draws.
        verifier: if given, a draw is kept only if verified wrong against this prompt's gold
            answer (another problem's solution may happen to reach the same number).
        groups: the step's rollout groups, if known now.

    Attributes:
        stats: cumulative counters: requested, accepted, no_other_prompt, rejected_correct,
            rejected_unverifiable.
    """

    source = "random"

    def __init__(self, seed: int = 0, verifier: Optional[BatchVerifier] = None,
                 groups: Optional[Sequence[RolloutGroup]] = None):
        self._rng = random.Random(seed)
        self.verifier = verifier
        self._pool: Optional[list[tuple[str, str]]] = None
        self.stats = _new_stats("no_other_prompt", "rejected_correct", "rejected_unverifiable")
        if groups is not None:
            self.set_groups(groups)

    def set_groups(self, groups: Sequence[RolloutGroup]) -> None:
        """Draw from these rollouts from now on."""
        self._pool = [(g.prompt.id, s.text) for g in groups for s in g.samples if s.text.strip()]

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """A response to a different prompt per item, or None if the batch has no other prompt."""
        self.stats["requested"] += len(items)
        pool = self._pool if self._pool is not None else [(p.id, text) for p, text in items]
        out: list[Optional[str]] = []
        for prompt, _positive in items:
            others = [text for pid, text in pool if pid != prompt.id]
            out.append(self._rng.choice(others) if others else None)
            if not others:
                self.stats["no_other_prompt"] += 1
        if self.verifier is not None:
            idx = [i for i, t in enumerate(out) if t is not None]
            if idx:
                verdicts = self.verifier.verify_batch([items[i][0].answer for i in idx], [out[i] for i in idx])
                for i, verdict in zip(idx, verdicts):
                    if verdict.correct is not False:
                        self.stats["rejected_correct" if verdict.correct else "rejected_unverifiable"] += 1
                        out[i] = None
        self.stats["accepted"] += sum(t is not None for t in out)
        return out


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
        self.stats = _new_stats("no_answer", "rejected")

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
        golds = [items[i][0].answer for i, cands in enumerate(per_item) for _ in cands]
        flat = [c for cands in per_item for c in cands]
        verdicts = list(self.verifier.verify_batch(golds, flat)) if flat else []
        assert len(verdicts) == len(flat), "verifier returned the wrong number of verdicts"
        out: list[Optional[str]] = []
        k = 0
        for cands in per_item:
            chosen = next((c for c, v in zip(cands, verdicts[k:k + len(cands)]) if _is_wrong(v)), None)
            k += len(cands)
            out.append(chosen)
            self.stats["accepted" if chosen is not None else "no_answer" if not cands else "rejected"] += 1
        return out


NEGATIVE_KINDS = ("assistant", "policy", "perturb", "random")


def make_negative_generator(kind: str, verifier: BatchVerifier, client: Optional[ChatBatchClient] = None,
                            seed: int = 0) -> NegativeGenerator:
    """The generator for a configuration's ``kind`` (one of :data:`NEGATIVE_KINDS`).

    Args:
        kind: "assistant" (needs ``client``), "policy", "perturb" or "random".
        verifier: the rule verifier ("random" uses it to drop draws that happen to be correct).
        client: the assistant's chat client.
        seed: seed of the CPU generators' choices.

    Raises:
        ValueError: for an unknown kind, or "assistant" without a client.
    """
    if kind == "assistant":
        if client is None:
            raise ValueError("negatives kind 'assistant' needs a chat client (an assistant LLM server URL)")
        return LLMAssistant(client, verifier)
    if kind == "policy":
        return PolicyWrongNegatives(seed=seed)
    if kind == "perturb":
        return AnswerPerturbation(verifier, seed=seed)
    if kind == "random":
        return RandomOtherResponse(seed=seed, verifier=verifier)
    raise ValueError(f"unknown negatives kind {kind!r}; choose from {NEGATIVE_KINDS}")


# ----------------------------------------------------------------------------------------------
# Pairs


def first_correct(group: RolloutGroup) -> Optional[str]:
    """The text of the group's first sample with ``rule_correct is True``, or None."""
    return next((s.text for s in group.samples if s.rule_correct is True), None)


def build_pairs(groups: Sequence[RolloutGroup], negatives: NegativeGenerator) -> list[PreferencePair]:
    """One preference pair per group, in order.

    The chosen side is the first sample the rule verifier marked correct; the rejected side comes
    from ``negatives`` (one ``generate`` call for all groups with a positive; a generator with
    ``set_groups`` receives ``groups`` first). A group without a positive gives
    ``PreferencePair(prompt, None, None)``; one whose negative could not be made keeps its chosen
    side with ``rejected`` None. Both are masked (``valid`` is False).

    Args:
        groups: the step's rollout groups (samples already verified).
        negatives: the negative generator.
    """
    if isinstance(negatives, GroupAware):
        negatives.set_groups(groups)
    positives = [first_correct(g) for g in groups]
    items = [(g.prompt, p) for g, p in zip(groups, positives) if p is not None]
    rejected = negatives.generate(items) if items else []
    if len(rejected) != len(items):
        raise ValueError(f"{type(negatives).__name__}.generate returned {len(rejected)} negatives for "
                         f"{len(items)} items")
    failed = list(getattr(negatives, "last_failed", None) or [False] * len(items))
    assert len(failed) == len(items), "last_failed does not match the items"
    it, it_failed = iter(rejected), iter(failed)
    source = getattr(negatives, "source", "")
    pairs = []
    for g, positive in zip(groups, positives):
        neg = next(it) if positive is not None else None
        fail = next(it_failed) if positive is not None else False
        pairs.append(PreferencePair(g.prompt, positive, neg, source if neg is not None else "", failed=fail))
    return pairs


def pair_stats(pairs: Sequence[PreferencePair]) -> dict[str, int]:
    """Counts for logging: total, valid, no_positive, no_negative, and failed (no negative because
    the generator failed, e.g. the assistant endpoint; included in no_negative)."""
    return {
        "total": len(pairs),
        "valid": sum(p.valid for p in pairs),
        "no_positive": sum(p.chosen is None for p in pairs),
        "no_negative": sum(p.chosen is not None and p.rejected is None for p in pairs),
        "failed": sum(p.failed for p in pairs),
    }


class AssistantUnavailable(RuntimeError):
    """The assistant endpoint failed after its retries and the run is configured to stop."""


def check_negative_failures(pairs: Sequence[PreferencePair], on_failure: str, endpoint: str) -> int:
    """Apply ``rm.on_assistant_failure`` to a step's pairs.

    Pairs whose negative failed are already masked (``valid`` is False). With ``"mask"`` their
    number is returned for the ``pairs/assistant_failed`` metric; with ``"stop"`` any such pair
    raises.

    Args:
        pairs: the step's pairs (from :func:`build_pairs`).
        on_failure: "mask" or "stop".
        endpoint: the assistant's URL, for the message.

    Raises:
        ValueError: unknown ``on_failure``.
        AssistantUnavailable: ``on_failure == "stop"`` and a request failed.
    """
    if on_failure not in ("mask", "stop"):
        raise ValueError(f"on_assistant_failure must be 'mask' or 'stop', got {on_failure!r}")
    failed = sum(p.failed for p in pairs)
    if failed and on_failure == "stop":
        raise AssistantUnavailable(
            f"assistant endpoint {endpoint} failed for {failed} of {len(pairs)} prompts after its retries; "
            "stopping as rm.on_assistant_failure=stop (set it to 'mask' to leave those pairs out and go on)")
    if failed:
        logger.warning("assistant endpoint %s failed for %d of %d prompts; their pairs are masked", endpoint,
                       failed, len(pairs))
    return failed
