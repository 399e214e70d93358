"""A resumable, data-parallel-sharded iterator over prompts.

Each epoch visits the prompts in a permutation drawn from ``(seed, epoch)`` alone, so every
data-parallel rank computes the same order without communicating. A step takes the next
``global_batch_size`` prompts of that order (the *global batch*); rank ``r`` of ``dp_size``
receives the ``r``-th contiguous slice of ``global_batch_size // dp_size`` of them, so the ranks'
shares are disjoint and together form the global batch.

At the end of an epoch the remainder that does not fill a global batch is dropped
(``drop_last=True``, every batch has distinct prompts) or completed from the next epoch's order
(``drop_last=False``, no prompt is skipped; the dataset may then be smaller than a batch).

The position is the pair ``(epoch, index)`` into the epoch's order; it is the same on every rank,
and :meth:`PromptIterator.state_dict` / :meth:`PromptIterator.load_state_dict` save and restore it
so that a resumed run yields exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from typing import Any

from cooper_mcore.types import Prompt

STATE_VERSION = 1


def epoch_order(num_prompts: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order in which epoch ``epoch`` visits ``range(num_prompts)``.

    Depends only on its arguments (Python's Mersenne Twister seeded with an integer, which is
    stable across Python versions and platforms).
    """
    order = list(range(num_prompts))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _fingerprint(prompts: Sequence[Prompt]) -> str:
    h = hashlib.sha1()
    for p in prompts:
        h.update(p.id.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


class PromptIterator:
    """This data-parallel rank's share of each global batch of prompts, epoch after epoch.

    Args:
        prompts: the dataset (the same list, in the same order, on every rank).
        global_batch_size: prompts per step over all data-parallel ranks.
        dp_rank: this rank's index in the data-parallel group.
        dp_size: the data-parallel world size; must divide ``global_batch_size``.
        seed: shuffling seed (the same on every rank).
        shuffle: permute each epoch (False: file order every epoch).
        drop_last: drop each epoch's incomplete last batch (see the module docstring).

    Raises:
        ValueError: empty dataset, non-positive sizes, ``dp_rank`` out of range, ``dp_size`` not
            dividing ``global_batch_size``, or (with ``drop_last``) fewer prompts than one batch.
    """

    def __init__(
        self,
        prompts: Sequence[Prompt],
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if not prompts:
            raise ValueError("PromptIterator: the prompt list is empty")
        if global_batch_size < 1:
            raise ValueError(f"PromptIterator: global_batch_size must be >= 1, got {global_batch_size}")
        if dp_size < 1:
            raise ValueError(f"PromptIterator: dp_size must be >= 1, got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"PromptIterator: dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        if global_batch_size % dp_size:
            raise ValueError(
                f"PromptIterator: global_batch_size={global_batch_size} is not divisible by dp_size={dp_size}"
            )
        if drop_last and len(prompts) < global_batch_size:
            raise ValueError(
                f"PromptIterator: {len(prompts)} prompts cannot fill one global batch of {global_batch_size} "
                "with drop_last=True (use drop_last=False or a smaller batch)"
            )
        self.prompts = list(prompts)
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.local_batch_size = global_batch_size // dp_size
        self._fingerprint = _fingerprint(self.prompts)
        self.epoch = 0
        self.index = 0
        self.step = 0
        self._order = epoch_order(len(self.prompts), seed, 0, shuffle)

    @property
    def batches_per_epoch(self) -> int:
        """Whole global batches in one epoch (with ``drop_last=False`` a batch may straddle two)."""
        return len(self.prompts) // self.global_batch_size

    def _set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.index = 0
        self._order = epoch_order(len(self.prompts), self.seed, epoch, self.shuffle)

    def next_global_indices(self) -> list[int]:
        """Advance one step; return the dataset indices of the whole global batch (every rank's)."""
        n = len(self.prompts)
        if self.drop_last and self.index + self.global_batch_size > n:
            self._set_epoch(self.epoch + 1)
        out: list[int] = []
        while len(out) < self.global_batch_size:
            if self.index == n:
                self._set_epoch(self.epoch + 1)
            take = min(self.global_batch_size - len(out), n - self.index)
            out.extend(self._order[self.index:self.index + take])
            self.index += take
        self.step += 1
        assert len(out) == self.global_batch_size
        return out

    def next_batch(self) -> list[Prompt]:
        """Advance one step; return this rank's ``global_batch_size // dp_size`` prompts."""
        indices = self.next_global_indices()
        lo = self.dp_rank * self.local_batch_size
        return [self.prompts[i] for i in indices[lo:lo + self.local_batch_size]]

    def __iter__(self) -> Iterator[list[Prompt]]:
        """Endless iteration over :meth:`next_batch`."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The position (the same on every rank) and what it is only valid for."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "step": self.step,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "global_batch_size": self.global_batch_size,
            "num_prompts": len(self.prompts),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (from any rank, any ``dp_size``).

        The position counts prompts, not batches, so a changed ``global_batch_size`` or ``dp_size``
        resumes at the same prompt (the batches then differ from the original run's).

        Raises:
            ValueError: the state belongs to another dataset (size or ids), seed or shuffling or
                ``drop_last`` setting, or its position is out of range.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"PromptIterator state: unsupported version {state.get('version')!r}")
        mine = self.state_dict()
        for key in ("seed", "shuffle", "drop_last", "num_prompts", "fingerprint"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"PromptIterator state does not match this iterator: {key}={state.get(key)!r} "
                    f"in the state, {mine[key]!r} here"
                )
        epoch, index, step = state["epoch"], state["index"], state["step"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(index, int) and 0 <= index <= len(self.prompts)):
            raise ValueError(f"PromptIterator state: invalid position epoch={epoch!r} index={index!r}")
        self._set_epoch(epoch)
        self.index = index
        self.step = int(step)
