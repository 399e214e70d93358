"""The training data's references checked against the rule verifier at start: a run whose references the
rule cannot read says so before its first step, naming the share and the data file.

A prompt whose reference the rule verifier cannot read gives no rule verdict on its rollouts (status
``gold_unreadable``): no rule reward in ``reward.mode=rule``, no positive for the reward model in
``cooper``. Data made of such prompts trains to the end with zero reward or no pair, and only the
``rule/gold_unreadable`` metric shows why; so the first :data:`CHECKED_PROMPTS` training prompts are put
to the verifier at start, and more than :data:`WARN_SHARE` of them unreadable is a warning (any share at
all an info line). Steps in a row without any verdict stop the run later
(:func:`cooper_mcore.rl.results.steps_without_signal`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cooper_mcore.types import Prompt
from cooper_mcore.verify.rule import GOLD_UNREADABLE, RuleVerifier

logger = logging.getLogger(__name__)

__all__ = ["CHECKED_PROMPTS", "WARN_SHARE", "check_references", "unreadable_share"]

#: how many training prompts (the data file's first) are checked at start: a fraction of a second
CHECKED_PROMPTS = 256
#: the share of unreadable references above which the start-up check warns (the CPU demo has 30% by design)
WARN_SHARE = 0.5


def unreadable_share(verifier: RuleVerifier, prompts: Sequence[Prompt]) -> tuple[float, list[Prompt]]:
    """The share of ``prompts`` whose reference the rule verifier cannot read, and those prompts.

    Each reference is verified against an empty completion: a reference the checker reads gives a
    verdict (wrong), one it cannot read ``gold_unreadable`` (math-verify matches nothing with an empty
    text); a timeout counts as neither.

    Raises:
        ValueError: no prompts.
    """
    if not prompts:
        raise ValueError("unreadable_share: no prompts to check")
    outcomes = verifier.verify_batch([p.answer for p in prompts], [""] * len(prompts))
    unreadable = [p for p, o in zip(prompts, outcomes) if o.status == GOLD_UNREADABLE]
    return len(unreadable) / len(prompts), unreadable


def check_references(verifier: RuleVerifier, prompts: Sequence[Prompt], train_path: str) -> float:
    """Check the references of the first :data:`CHECKED_PROMPTS` of ``prompts`` (``data.train_path``'s, in
    file order) and log the share the rule verifier cannot read: a warning above :data:`WARN_SHARE`, an
    info line below it, nothing when it reads them all. Return the share (0 without prompts)."""
    head = list(prompts[:CHECKED_PROMPTS])
    if not head:
        return 0.0
    share, unreadable = unreadable_share(verifier, head)
    if not unreadable:
        return share
    examples = ", ".join(f"{p.id}: {p.answer[:40]!r}" for p in unreadable[:3])
    log = logger.warning if share > WARN_SHARE else logger.info
    log("the rule verifier cannot read the reference of %d of the first %d prompts (%.0f%%) of data.train_path %s "
        "(e.g. %s): their rollouts get no rule verdict (no rule reward, no reward-model positive); check them with "
        "`cooper verify`", len(unreadable), len(head), 100 * share, train_path, examples)
    return share
