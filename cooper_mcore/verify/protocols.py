"""The interface of a verifier, as its clients (the rollouts, the negative generators) use it: a
structural protocol, so that the rule verifier, the arithmetic oracle and test doubles need no base
class."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Protocol

__all__ = ["BatchVerifier", "VerdictLike"]


class VerdictLike(Protocol):
    """What a verifier returns per item: ``correct`` is True, False or None (unverifiable)."""

    @property
    def correct(self) -> Optional[bool]: ...


class BatchVerifier(Protocol):
    """The part of :class:`cooper_mcore.verify.rule.RuleVerifier` its clients use."""

    def verify_batch(self, golds: Sequence[str], preds: Sequence[str]) -> Sequence[VerdictLike]:
        """One verdict per (gold answer, full completion text), gold first."""
        ...
