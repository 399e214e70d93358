"""Micro-batches by a token budget, balanced across data-parallel ranks (pure Python).

Instead of a fixed number of samples per micro-batch, :func:`plan_micro_batches` bins the samples
of a mini-batch so that every micro-batch holds at most ``max_tokens`` tokens, and deals the
micro-batches to the data-parallel ranks so that each rank runs the same number of them (the
pipeline schedule and the gradient reduction expect it) with token totals as even as possible.

What a micro-batch costs depends on its layout:

* ``"packed"``: the sequences are packed end to end into one row
  (:mod:`cooper_mcore.micro_batching.packing`): the sum of their lengths;
* ``"padded"``: right-padded rows: number of rows x the longest row.

Method: samples are taken longest first (ties: lower index first) and each goes to the micro-batch
of least cost that it fits in ("worst fit decreasing", which also evens the micro-batches out),
over ``dp * k`` micro-batches with ``k`` growing from a lower bound (samples over the budget, one
micro-batch each, plus ``ceil(other tokens / max_tokens)``, over ``dp``) until every sample fits.
Micro-batches are then dealt in rounds of ``dp``, largest first, the largest of a round to the
rank with the least cost so far.

Guarantees of the returned :class:`MicroBatchPlan`:

1. every sample is in exactly one micro-batch;
2. a micro-batch costs at most ``max_tokens``, unless it holds one sample alone whose cost
   exceeds it;
3. every rank has the same number ``k >= min_micro_batches`` of micro-batches, none empty (with
   ``allow_empty``: empty ones only when there are fewer samples than ``dp * k``);
4. the ranks' total costs differ by at most the cost of the largest micro-batch;
5. the result depends only on the arguments (deterministic).

``k`` is not guaranteed to be the least possible (bin packing is NP-hard); it is the least ``k``
from the lower bound for which worst fit succeeds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Optional

Cost = Literal["packed", "padded"]
COSTS = ("packed", "padded")


@dataclass(frozen=True)
class MicroBatchPlan:
    """Micro-batches of sample indices for each data-parallel rank.

    Attributes:
        micro_batches: ``micro_batches[rank][j]`` the sample indices (ascending) of that rank's
            ``j``-th micro-batch; ranks hold equally many.
        lengths: the samples' token counts.
        max_tokens: the budget per micro-batch.
        cost: how a micro-batch's tokens are counted (``"packed"`` or ``"padded"``).
    """

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    lengths: tuple[int, ...]
    max_tokens: int
    cost: Cost

    @property
    def num_ranks(self) -> int:
        return len(self.micro_batches)

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.micro_batches[0])

    def for_rank(self, rank: int) -> list[list[int]]:
        """The micro-batches of data-parallel rank ``rank``."""
        return [list(mb) for mb in self.micro_batches[rank]]

    def samples_of_rank(self, rank: int) -> list[int]:
        """All sample indices of ``rank``, in micro-batch order."""
        return [i for mb in self.micro_batches[rank] for i in mb]

    def micro_batch_cost(self, indices: Sequence[int]) -> int:
        """Tokens a micro-batch of these samples occupies (see the module docstring)."""
        return _cost([self.lengths[i] for i in indices], self.cost)

    def rank_cost(self, rank: int) -> int:
        """Sum of the micro-batch costs of ``rank``."""
        return sum(self.micro_batch_cost(mb) for mb in self.micro_batches[rank])

    def rank_tokens(self, rank: int) -> int:
        """Real tokens of ``rank`` (padding excluded)."""
        return sum(self.lengths[i] for i in self.samples_of_rank(rank))


def _cost(lengths: Sequence[int], cost: Cost) -> int:
    if not lengths:
        return 0
    return sum(lengths) if cost == "packed" else len(lengths) * max(lengths)


def plan_micro_batches(
    lengths: Sequence[int],
    max_tokens: int,
    dp_size: int = 1,
    cost: Cost = "packed",
    min_micro_batches: int = 1,
    allow_empty: bool = False,
) -> MicroBatchPlan:
    """Bin samples into micro-batches of at most ``max_tokens`` tokens, equally many per rank.

    Args:
        lengths: token count of each sample of the mini-batch (all data-parallel ranks'
            samples, or one rank's with ``dp_size=1``). A sample that must stay whole with
            another (a chosen/rejected pair of the pairwise RM loss) is one sample of their
            summed length.
        max_tokens: the budget per micro-batch.
        dp_size: number of data-parallel ranks to deal the micro-batches to.
        cost: ``"packed"`` (sum of lengths) or ``"padded"`` (rows x longest row).
        min_micro_batches: at least this many micro-batches per rank (ranks that plan their own
            samples agree on a count by planning again with the all-reduced maximum).
        allow_empty: allow empty micro-batches when there are fewer samples than ranks x
            micro-batches (the caller runs them as masked dummies); otherwise that is an error.

    Returns:
        The plan; see the module docstring for its guarantees.

    Raises:
        ValueError: no sample, a length < 1, ``max_tokens``/``dp_size``/``min_micro_batches`` < 1,
            an unknown ``cost``, or (without ``allow_empty``) too few samples to give every
            rank ``k`` non-empty micro-batches.
    """
    lengths = tuple(int(n) for n in lengths)
    if not lengths:
        raise ValueError("plan_micro_batches: no sample")
    if min(lengths) < 1:
        raise ValueError(f"plan_micro_batches: every length must be >= 1, got {min(lengths)}")
    if max_tokens < 1 or dp_size < 1 or min_micro_batches < 1:
        raise ValueError(f"plan_micro_batches: max_tokens ({max_tokens}), dp_size ({dp_size}) and "
                         f"min_micro_batches ({min_micro_batches}) must be >= 1")
    if cost not in COSTS:
        raise ValueError(f"plan_micro_batches: cost must be one of {COSTS}, got {cost!r}")
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    # a sample over the budget fills a micro-batch alone; the others need their tokens' worth
    over = sum(1 for n_i in lengths if n_i > max_tokens)
    rest = sum(n_i for n_i in lengths if n_i <= max_tokens)
    k = max(min_micro_batches, math.ceil((over + math.ceil(rest / max_tokens)) / dp_size))
    while True:
        if dp_size * k > n and not allow_empty:
            raise ValueError(
                f"plan_micro_batches: {n} samples cannot fill {dp_size} ranks x {k} micro-batches "
                f"(max_tokens={max_tokens}, longest sample {max(lengths)}); pass allow_empty=True to run "
                f"empty micro-batches as masked dummies, or give every rank as many samples")
        bins = _worst_fit(order, lengths, dp_size * k, max_tokens, cost)
        if bins is not None:
            break
        k += 1
    return MicroBatchPlan(_deal(bins, lengths, dp_size, cost), lengths, max_tokens, cost)


def _worst_fit(order: list[int], lengths: tuple[int, ...], m: int, max_tokens: int,
               cost: Cost) -> Optional[list[list[int]]]:
    """Samples (longest first) into ``m`` bins, each to the cheapest bin it fits; None if one fits nowhere."""
    bins: list[list[int]] = [[] for _ in range(m)]
    loads = [0] * m
    longest = [0] * m  # with samples longest first, a bin's first sample is its longest
    for i in order:
        n = lengths[i]
        best = None
        for b in range(m):
            if not bins[b]:
                fits = True
            elif cost == "packed":
                fits = loads[b] + n <= max_tokens
            else:
                fits = (len(bins[b]) + 1) * longest[b] <= max_tokens
            if fits and (best is None or loads[b] < loads[best]):
                best = b
        if best is None:
            return None
        bins[best].append(i)
        longest[best] = max(longest[best], n)
        loads[best] = _cost([lengths[j] for j in bins[best]], cost)
    return bins


def _deal(bins: list[list[int]], lengths: tuple[int, ...], dp_size: int,
          cost: Cost) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Deal bins to ranks in rounds of ``dp_size``, largest first, largest to the lightest rank.

    Within a round the ranks' order by load is reversed against the bins' order by cost, which
    keeps the spread of rank loads at most the largest bin's cost.
    """
    keyed = sorted(((_cost([lengths[i] for i in b], cost), sorted(b)) for b in bins),
                   key=lambda cb: (-cb[0], cb[1][0] if cb[1] else len(lengths)))
    ranks: list[list[tuple[int, ...]]] = [[] for _ in range(dp_size)]
    loads = [0] * dp_size
    for start in range(0, len(keyed), dp_size):
        by_load = sorted(range(dp_size), key=lambda r: (loads[r], r))
        for r, (c, b) in zip(by_load, keyed[start:start + dp_size]):
            ranks[r].append(tuple(b))
            loads[r] += c
    return tuple(tuple(mbs) for mbs in ranks)
