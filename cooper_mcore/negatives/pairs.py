"""Negatives for the reward model's contrastive update, and the preference pairs built from them.

Per prompt, the chosen side is a rollout the rule verifier marked correct (the first one by
default, as the reference implementation; see :func:`build_pairs` for the other picks); the
rejected side is a verified-wrong solution from a :class:`NegativeGenerator`:

* :class:`~cooper_mcore.negatives.assistant.LLMAssistant` (Cooper's method): an instruct model
  behind an OpenAI-compatible API rewrites the correct solution into a wrong but convincing one,
  asked up to 3 times; a rewrite is kept only if the rule verifier says it is *not* equivalent to
  the gold answer.
* CPU alternatives for runs without an assistant LLM: :class:`PolicyWrongNegatives` (rollouts of
  the same prompt the verifier marked wrong after reading their answer, the hardest or a random one),
  :class:`~cooper_mcore.negatives.rewrites.ChainRewrite` (an offline assistant-like rewrite of an
  arithmetic chain), :class:`~cooper_mcore.negatives.rewrites.AnswerPerturbation` (the positive with
  its final answer changed to a nearby wrong number) and :class:`RandomOtherResponse` (the paper's
  ablation: a response to another prompt).

:func:`build_pairs` selects the positives (and the policy's own negatives) with
:mod:`cooper_mcore.algo.pairs` and makes ``pairs_per_prompt`` slots per prompt; slots without a
positive or without a negative are kept but masked (``valid`` is False) so that callers can count
them.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from cooper_mcore.algo.pairs import (
    NEGATIVE_PICKS,
    POSITIVE_PICKS,
    NegativePick,
    PositivePick,
    first_positive_index,
    select_negatives,
    select_positives,
    verdict_codes,
)
from cooper_mcore.negatives.assistant import AssistantPrompt, LLMAssistant
from cooper_mcore.negatives.protocols import ChatBatchClient, GroupAware, NegativeGenerator, RolloutNegatives
from cooper_mcore.negatives.rewrites import (
    REWRITE_KINDS,
    AnswerPerturbation,
    ChainRewrite,
    RewriteForms,
    final_answer_span,
    number_variants,
)
from cooper_mcore.types import PreferencePair, Prompt, RolloutGroup, Sample
from cooper_mcore.verify.protocols import BatchVerifier, VerdictLike

__all__ = [
    "NEGATIVE_KINDS",
    "AnswerPerturbation",
    "AssistantUnavailable",
    "BatchVerifier",
    "ChainRewrite",
    "ChatBatchClient",
    "GroupAware",
    "NegativeGenerator",
    "PolicyWrongNegatives",
    "RandomOtherResponse",
    "RolloutNegatives",
    "VerdictLike",
    "build_pairs",
    "check_negative_failures",
    "final_answer_span",
    "first_correct",
    "group_verdicts",
    "make_negative_generator",
    "number_variants",
    "pair_stats",
    "rollout_scores",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# The step's rollouts


def _verdict(s: Sample) -> Optional[bool]:
    """A sample's verdict for pairing: its ``rule_correct``, or None (unverifiable) for a blank text or
    a wrong verdict on an answer the rule could not read (``rule_answered is False``)."""
    if not s.text.strip():
        return None
    if s.rule_correct is False and s.rule_answered is False:
        return None
    return s.rule_correct


def group_verdicts(groups: Sequence[RolloutGroup]) -> torch.Tensor:
    """Verdict codes ``[P, G]`` (:func:`cooper_mcore.algo.pairs.verdict_codes`) of the groups' samples.

    A sample with blank text counts as unverifiable (it is never a positive nor a negative); so does
    one the rule marked wrong without reading an answer in it (``rule_answered is False``, e.g.
    ``\\boxed{14.}``, which math-verify keeps only as a string): such a rollout may well be correct,
    and using it as a negative would teach the reward model the rule's blind spot. Negatives are
    confidently wrong: an answer read and found different. ``rule_answered`` None (unknown: older
    data, verifiers that do not say) keeps the plain verdict. Ragged groups are padded with
    unverifiable columns.
    """
    return verdict_codes([[_verdict(s) for s in g.samples] for g in groups])


def rollout_scores(groups: Sequence[RolloutGroup]) -> torch.Tensor:
    """``[P, G]`` float64 of the samples' :attr:`~cooper_mcore.types.Sample.reward`; NaN where unset or padded."""
    g = max((len(grp.samples) for grp in groups), default=0)
    out = torch.full((len(groups), g), float("nan"), dtype=torch.float64)
    for i, grp in enumerate(groups):
        for j, s in enumerate(grp.samples):
            if s.reward is not None:
                out[i, j] = float(s.reward)
    return out


class PolicyWrongNegatives:
    """Rollouts of the same prompt that the rule verifier marked wrong (``rule_correct is False``) after
    reading their answer.

    Which wrong rollouts, by ``negative_pick`` (:func:`cooper_mcore.algo.pairs.select_negatives`):
    "random" (default), "hardest" (the one the reward model currently scores highest: the exploit
    the policy is moving towards) or "first". Several pairs of one prompt get distinct negatives.
    The groups (and the RM scores "hardest" needs) come from :meth:`set_groups`, which
    :func:`build_pairs` calls each step, or the constructor. Unverified samples (``rule_correct``
    None), blank texts and rollouts marked wrong without a readable answer (``rule_answered`` False:
    the rule's blind spot, possibly correct; see :func:`group_verdicts`) are never used.

    Args:
        groups: the step's rollout groups, if known now.
        seed: seed of the "random" pick.
        negative_pick: "random", "hardest" or "first".

    Attributes:
        stats: cumulative counters: requested, accepted, no_wrong_rollout.
    """

    source = "policy"

    def __init__(self, groups: Optional[Sequence[RolloutGroup]] = None, seed: int = 0,
                 negative_pick: NegativePick = "random"):
        if negative_pick not in NEGATIVE_PICKS:
            raise ValueError(f"unknown negative_pick {negative_pick!r}; expected one of {NEGATIVE_PICKS}")
        self.negative_pick: NegativePick = negative_pick
        self._generator = torch.Generator().manual_seed(seed)
        self._groups: list[RolloutGroup] = []
        self._row: dict[str, int] = {}
        self._verdicts = torch.zeros(0, 0, dtype=torch.int8)
        self._scores: Optional[torch.Tensor] = None
        self.stats = dict.fromkeys(("requested", "accepted", "no_wrong_rollout"), 0)
        if groups is not None:
            self.set_groups(groups)

    def set_groups(self, groups: Sequence[RolloutGroup], scores: Optional[torch.Tensor] = None) -> None:
        """Use these rollouts from now on (replacing earlier ones).

        Args:
            groups: the step's rollout groups.
            scores: ``[P, G]`` RM scores of their samples (logits or rewards); default: each sample's
                ``reward`` (needed only by "hardest").
        """
        self._groups = list(groups)
        self._row = {g.prompt.id: i for i, g in enumerate(self._groups)}
        self._verdicts = group_verdicts(self._groups)
        self._scores = rollout_scores(self._groups) if scores is None else scores

    def select(self, verdicts: torch.Tensor, scores: Optional[torch.Tensor],
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``k`` distinct wrong rollouts per prompt by ``negative_pick``.

        Args:
            verdicts: ``[P, G]`` verdict codes.
            scores: ``[P, G]`` RM scores (for "hardest").
            k: slots per prompt.

        Returns:
            ``(index, valid)``, both ``[P, k]`` (see :func:`cooper_mcore.algo.pairs.select_negatives`).
            The stats count the slots of prompts that have a positive.
        """
        index, valid = select_negatives(verdicts, scores, k, self.negative_pick, self._generator)
        _, has_positive = first_positive_index(verdicts)
        wanted = valid[has_positive]
        self.stats["requested"] += wanted.numel()
        self.stats["accepted"] += int(wanted.sum())
        self.stats["no_wrong_rollout"] += int((~wanted).sum())
        return index, valid

    def generate(self, items: list[tuple[Prompt, str]]) -> list[Optional[str]]:
        """A wrong rollout per item, or None if its group has none left (an item's prompt that appears
        several times gets distinct rollouts, in pick order).

        Raises:
            ValueError: an item's prompt is not among the groups given.
        """
        for prompt, _ in items:
            if prompt.id not in self._row:
                raise ValueError(f"prompt {prompt.id!r} is not in the rollout groups given to PolicyWrongNegatives "
                                 "(call set_groups with this step's groups)")
        self.stats["requested"] += len(items)
        if not items:
            return []
        k = max(Counter(p.id for p, _ in items).values())
        index, valid = select_negatives(self._verdicts, self._scores, k, self.negative_pick, self._generator)
        seen: Counter[str] = Counter()
        out: list[Optional[str]] = []
        for prompt, _positive in items:
            row, slot = self._row[prompt.id], seen[prompt.id]
            seen[prompt.id] += 1
            ok = bool(valid[row, slot])
            out.append(self._groups[row].samples[int(index[row, slot])].text if ok else None)
            self.stats["accepted" if ok else "no_wrong_rollout"] += 1
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
        self.stats = dict.fromkeys(("requested", "accepted", "no_other_prompt", "rejected_correct",
                                    "rejected_unverifiable"), 0)
        if groups is not None:
            self.set_groups(groups)

    def set_groups(self, groups: Sequence[RolloutGroup], scores: Optional[torch.Tensor] = None) -> None:
        """Draw from these rollouts from now on (``scores`` is not used)."""
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


NEGATIVE_KINDS = ("assistant", "policy", "rewrite", "perturb", "random")


def make_negative_generator(kind: str, verifier: BatchVerifier, client: Optional[ChatBatchClient] = None,
                            seed: int = 0, *, negative_pick: NegativePick = "random", assistant_rounds: int = 3,
                            assistant_prompt: AssistantPrompt = "reference",
                            rewrite_kinds: Sequence[str] = REWRITE_KINDS,
                            rewrite_forms: RewriteForms = "positive") -> NegativeGenerator:
    """The generator for a configuration's ``kind`` (one of :data:`NEGATIVE_KINDS`).

    Args:
        kind: "assistant" (needs ``client``), "policy", "rewrite", "perturb" or "random".
        verifier: the rule verifier ("random" uses it to drop draws that happen to be correct).
        client: the assistant's chat client.
        seed: seed of the CPU generators' choices.
        negative_pick: "policy": which wrong rollouts ("random", "hardest", "first").
        assistant_rounds: "assistant": requests per item at most (3 as the reference).
        assistant_prompt: "assistant": "reference" (no gold answer in the request) or "with_gold".
        rewrite_kinds: "rewrite": the rewrite kinds to use (see :class:`ChainRewrite`).
        rewrite_forms: "rewrite": how the rewrites write their final answer ("positive", "rollouts").

    Raises:
        ValueError: for an unknown kind, or "assistant" without a client.
    """
    if kind == "assistant":
        if client is None:
            raise ValueError("negatives kind 'assistant' needs a chat client (an assistant LLM server URL)")
        return LLMAssistant(client, verifier, rounds=assistant_rounds, prompt=assistant_prompt)
    if kind == "policy":
        return PolicyWrongNegatives(seed=seed, negative_pick=negative_pick)
    if kind == "rewrite":
        return ChainRewrite(verifier, seed=seed, kinds=rewrite_kinds, forms=rewrite_forms)
    if kind == "perturb":
        return AnswerPerturbation(verifier, seed=seed)
    if kind == "random":
        return RandomOtherResponse(seed=seed, verifier=verifier)
    raise ValueError(f"unknown negatives kind {kind!r}; choose from {NEGATIVE_KINDS}")


# ----------------------------------------------------------------------------------------------
# Pairs


def first_correct(group: RolloutGroup) -> Optional[str]:
    """The text of the group's first sample with ``rule_correct is True`` (and non-blank text), or None."""
    index, has = first_positive_index(group_verdicts([group]))
    return group.samples[int(index[0])].text if bool(has[0]) else None


def build_pairs(
    groups: Sequence[RolloutGroup],
    negatives: NegativeGenerator,
    scores: Optional[torch.Tensor] = None,
    *,
    pairs_per_prompt: int = 1,
    positive_pick: PositivePick = "first",
    seed: int = 0,
) -> list[PreferencePair]:
    """``pairs_per_prompt`` preference-pair slots per group, group by group (slot-minor order).

    Positives are rule-correct rollouts picked by :func:`cooper_mcore.algo.pairs.select_positives`
    (``positive_pick``: "first" as the reference, "hardest" the lowest-scored, "random"); when a
    group has fewer positives than slots they repeat. Negatives:

    * a :class:`~cooper_mcore.negatives.protocols.RolloutNegatives` generator
      (:class:`PolicyWrongNegatives`) picks distinct wrong rollouts of the same group per slot
      (``select``), so a group gets ``min(pairs_per_prompt, #wrong)`` valid pairs;
    * any other generator writes one negative per slot that has a positive (one ``generate`` call
      for all of them; the same positive may be rewritten several times).

    A generator with ``set_groups`` receives ``groups`` and the scores first. A slot of a group
    without a positive is ``PreferencePair(prompt, None, None)``; one whose negative could not be
    made keeps its chosen side with ``rejected`` None. Both are masked (``valid`` is False).

    Args:
        groups: the step's rollout groups (samples already verified).
        negatives: the negative generator.
        scores: ``[P, G]`` the current RM's scores of the rollouts (logits or rewards: only their order
            matters), for the "hardest" picks; default: each sample's ``reward`` (NaN where unset).
        pairs_per_prompt: slots per group, >= 1.
        positive_pick: "first", "hardest" or "random".
        seed: seed of the "random" positive pick.

    Raises:
        ValueError: bad ``pairs_per_prompt``, ``positive_pick`` or ``scores`` shape, a "hardest" pick
            without finite scores, or a generator that returns the wrong number of negatives.
    """
    if pairs_per_prompt < 1:
        raise ValueError(f"pairs_per_prompt must be >= 1, got {pairs_per_prompt}")
    if positive_pick not in POSITIVE_PICKS:
        raise ValueError(f"unknown positive_pick {positive_pick!r}; expected one of {POSITIVE_PICKS}")
    verdicts = group_verdicts(groups)
    if scores is None:
        scores = rollout_scores(groups)
    elif tuple(scores.shape) != tuple(verdicts.shape):
        raise ValueError(f"scores must be [num_groups, G] = {tuple(verdicts.shape)}, got {tuple(scores.shape)}")
    if isinstance(negatives, GroupAware):
        negatives.set_groups(groups, scores)
    if not groups:
        return []
    pos_index, has_positive = select_positives(verdicts, scores, pairs_per_prompt, positive_pick,
                                               torch.Generator().manual_seed(seed))
    slots = _Slots(groups, pos_index, has_positive, getattr(negatives, "source", ""))
    if isinstance(negatives, RolloutNegatives):
        return slots.rollout_pairs(*negatives.select(verdicts, scores, pairs_per_prompt))
    return slots.generated_pairs(negatives)


@dataclass
class _Slots:
    """The ``[P, k]`` pair slots of :func:`build_pairs`: each group's chosen positives, filled in
    slot-minor order with a negative from the group's rollouts or from a generator."""

    groups: Sequence[RolloutGroup]
    pos_index: torch.Tensor
    has_positive: torch.Tensor
    source: str

    def _slots(self) -> list[tuple[int, int]]:
        return [(i, j) for i in range(len(self.groups)) for j in range(self.pos_index.shape[1])]

    def _chosen(self, i: int, j: int) -> tuple[str, int]:
        col = int(self.pos_index[i, j])
        return self.groups[i].samples[col].text, col

    def rollout_pairs(self, neg_index: torch.Tensor, neg_valid: torch.Tensor) -> list[PreferencePair]:
        """Negatives are the group's own rollouts picked by ``select`` (``neg_valid`` False: none left)."""
        pairs: list[PreferencePair] = []
        for i, j in self._slots():
            prompt = self.groups[i].prompt
            if not self.has_positive[i]:
                pairs.append(PreferencePair(prompt, None, None))
                continue
            text, col = self._chosen(i, j)
            if neg_valid[i, j]:
                neg_col = int(neg_index[i, j])
                pairs.append(PreferencePair(prompt, text, self.groups[i].samples[neg_col].text, self.source,
                                            chosen_index=col, rejected_index=neg_col))
            else:
                pairs.append(PreferencePair(prompt, text, None, chosen_index=col))
        return pairs

    def generated_pairs(self, negatives: NegativeGenerator) -> list[PreferencePair]:
        """One ``generate`` call writes a negative for every slot that has a positive."""
        wanted = [(i, j) for i, j in self._slots() if self.has_positive[i]]
        items = [(self.groups[i].prompt, self._chosen(i, j)[0]) for i, j in wanted]
        rejected = negatives.generate(items) if items else []
        if len(rejected) != len(items):
            raise ValueError(f"{type(negatives).__name__}.generate returned {len(rejected)} negatives for "
                             f"{len(items)} items")
        failed = list(getattr(negatives, "last_failed", None) or [False] * len(items))
        assert len(failed) == len(items), "last_failed does not match the items"
        it = iter(zip(rejected, failed))
        pairs: list[PreferencePair] = []
        for i, j in self._slots():
            if not self.has_positive[i]:
                pairs.append(PreferencePair(self.groups[i].prompt, None, None))
                continue
            neg, fail = next(it)
            text, col = self._chosen(i, j)
            pairs.append(PreferencePair(self.groups[i].prompt, text, neg, self.source if neg is not None else "",
                                        failed=fail, chosen_index=col))
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
