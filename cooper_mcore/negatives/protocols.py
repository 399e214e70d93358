"""The interfaces the negative generators are written against: the assistant's chat client and the
generators themselves (structural protocols, so test doubles need no base class). The verifier's is
:mod:`cooper_mcore.verify.protocols`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Protocol, runtime_checkable

import torch

from cooper_mcore.types import Prompt, RolloutGroup

__all__ = ["ChatBatchClient", "GroupAware", "NegativeGenerator", "RolloutNegatives"]


class ChatBatchClient(Protocol):
    """The part of :class:`cooper_mcore.llm_client.OpenAIChatClient` used here."""

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
    """A generator that draws from the step's rollouts; ``build_pairs`` hands them over first, with the
    reward model's scores of the rollouts (``[P, G]``) when it has them."""

    def set_groups(self, groups: Sequence[RolloutGroup], scores: Optional[torch.Tensor] = None) -> None: ...


@runtime_checkable
class RolloutNegatives(Protocol):
    """A generator whose negatives are rollouts of the same prompt: ``build_pairs`` asks it for their
    columns (so that it can pair several distinct negatives with the prompt's positives)."""

    def select(self, verdicts: torch.Tensor, scores: Optional[torch.Tensor],
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)``, both ``[P, k]``: up to ``k`` distinct negative columns per prompt."""
        ...
