"""Micro-batches by a token budget (cooper_mcore.micro_batching.planning): hand-checked plans and properties."""

import ast
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cooper_mcore.micro_batching as micro_batching
from cooper_mcore.micro_batching import planning
from cooper_mcore.micro_batching.planning import MicroBatchPlan, plan_micro_batches


def _imported_roots(path: str) -> set[str]:
    """The top-level names of every module a source file imports."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return {name.split(".")[0] for name in names}


def test_planning_is_pure_python():
    """The planner imports the standard library only (no torch, torch.distributed or megatron), and
    the package imports nothing itself, so importing the planner loads nothing else."""
    assert _imported_roots(planning.__file__) <= set(sys.stdlib_module_names) | {"__future__"}
    assert _imported_roots(micro_batching.__file__) == set()


def test_packed_worst_fit_by_hand():
    # lower bound ceil(15 / 6) = 3 micro-batches; 5, 4, 3 open them, 2 joins the 3 (least
    # loaded that fits), 1 joins the 4: every micro-batch costs 5
    plan = plan_micro_batches([5, 4, 3, 2, 1], max_tokens=6)
    assert plan.micro_batches == (((0,), (1, 4), (2, 3)),)
    assert [plan.micro_batch_cost(mb) for mb in plan.for_rank(0)] == [5, 5, 5]


def test_two_ranks_by_hand():
    # 36 tokens, budget 10: 4 micro-batches (2 per rank) of 9 tokens: {8,1} {7,2} {6,3} {5,4};
    # dealt in rounds of two, the largest of a round to the lighter rank (ties: lower rank)
    plan = plan_micro_batches([8, 7, 6, 5, 4, 3, 2, 1], max_tokens=10, dp_size=2)
    assert plan.micro_batches == (((0, 7), (2, 5)), ((1, 6), (3, 4)))
    assert plan.rank_cost(0) == plan.rank_cost(1) == 18


def test_padded_cost_by_hand():
    # padded cost = rows x longest row; 2 micro-batches cannot hold [4, 4, 2, 2, 1] within 8
    # ({4,2} and {4,2} cost 8 each, then 1 fits neither: 3 x 4 = 12), 3 can:
    # {4,1} costs 2 x 4 = 8, {4} 4, {2,2} 4
    plan = plan_micro_batches([4, 4, 2, 2, 1], max_tokens=8, cost="padded")
    assert plan.micro_batches == (((0, 4), (1,), (2, 3)),)
    assert [plan.micro_batch_cost(mb) for mb in plan.for_rank(0)] == [8, 4, 4]
    # the same samples packed: 13 tokens in 2 micro-batches of at most 8
    packed = plan_micro_batches([4, 4, 2, 2, 1], max_tokens=8, cost="packed")
    assert packed.micro_batches_per_rank == 2


def test_over_budget_sample_is_alone():
    # 1 sample over the budget + ceil(7 / 4) = 3 micro-batches: {10} alone, {3}, {2, 2};
    # a rank's micro-batches are ordered by cost, largest first
    plan = plan_micro_batches([10, 2, 2, 3], max_tokens=4)
    assert plan.micro_batches == (((0,), (1, 2), (3,)),)
    assert plan.micro_batch_cost((0,)) == 10


def test_min_micro_batches_and_empty():
    plan = plan_micro_batches([3, 3], max_tokens=100, min_micro_batches=2)
    assert plan.micro_batches == (((0,), (1,)),)
    with pytest.raises(ValueError, match="cannot fill 2 ranks x 2 micro-batches"):
        plan_micro_batches([3, 3, 3], max_tokens=3, dp_size=2)
    plan = plan_micro_batches([3, 3, 3], max_tokens=3, dp_size=2, allow_empty=True)
    assert plan.micro_batches == (((0,), (2,)), ((1,), ()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(lengths=[], max_tokens=4), "no sample"),
    (dict(lengths=[3, 0], max_tokens=4), "length must be >= 1"),
    (dict(lengths=[3], max_tokens=0), "max_tokens"),
    (dict(lengths=[3], max_tokens=4, dp_size=0), "dp_size"),
    (dict(lengths=[3], max_tokens=4, cost="sum"), "cost must be one of"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_micro_batches(**kwargs)


def _check(plan: MicroBatchPlan, lengths, max_tokens, dp, min_mb, allow_empty):
    seen = sorted(i for r in range(plan.num_ranks) for i in plan.samples_of_rank(r))
    assert seen == list(range(len(lengths)))  # every sample exactly once
    assert plan.num_ranks == dp
    k = plan.micro_batches_per_rank
    assert k >= min_mb and all(len(plan.micro_batches[r]) == k for r in range(dp))
    for r in range(dp):
        for mb in plan.micro_batches[r]:
            assert allow_empty or mb, "empty micro-batch"
            assert list(mb) == sorted(mb)
            if len(mb) > 1:
                assert plan.micro_batch_cost(mb) <= max_tokens
    if any(not mb for r in range(dp) for mb in plan.micro_batches[r]):
        assert len(lengths) < dp * k
    costs = [plan.rank_cost(r) for r in range(dp)]
    largest = max(plan.micro_batch_cost(mb) for r in range(dp) for mb in plan.micro_batches[r])
    assert max(costs) - min(costs) <= largest
    over = sum(n > max_tokens for n in lengths)
    rest = sum(n for n in lengths if n <= max_tokens)
    assert k >= -(-(over + -(-rest // max_tokens)) // dp)  # never below the lower bound


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60), max_tokens=st.integers(1, 900),
       dp=st.integers(1, 4), cost=st.sampled_from(["packed", "padded"]), min_mb=st.integers(1, 3))
def test_properties_allow_empty(lengths, max_tokens, dp, cost, min_mb):
    plan = plan_micro_batches(lengths, max_tokens, dp, cost, min_mb, allow_empty=True)
    _check(plan, lengths, max_tokens, dp, min_mb, allow_empty=True)
    assert plan_micro_batches(lengths, max_tokens, dp, cost, min_mb, allow_empty=True) == plan  # deterministic


@settings(max_examples=300, deadline=None)
@given(per_rank=st.lists(st.integers(1, 300), min_size=1, max_size=16), max_tokens=st.integers(1, 900),
       dp=st.integers(1, 4), cost=st.sampled_from(["packed", "padded"]), seed=st.integers(0, 10**6))
def test_properties_divisible_batch_never_needs_empty(per_rank, max_tokens, dp, cost, seed):
    """A mini-batch of dp x r samples always has a plan without empty micro-batches (k <= r)."""
    import random

    lengths = per_rank * dp
    random.Random(seed).shuffle(lengths)
    plan = plan_micro_batches(lengths, max_tokens, dp, cost)
    _check(plan, lengths, max_tokens, dp, 1, allow_empty=False)
    assert plan.micro_batches_per_rank <= len(per_rank)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 64), min_size=4, max_size=60), max_tokens=st.integers(64, 512))
def test_packed_uses_few_micro_batches(lengths, max_tokens):
    """No sample exceeds the budget: worst fit needs at most about twice the lower bound.

    When worst fit fails with m micro-batches, either the failing sample and every earlier one
    is over half the budget (m + 1 such samples: m < their count <= 2 x lower bound + 1), or every
    micro-batch is over half full (m < 2 x tokens / budget <= 2 x lower bound).
    """
    plan = plan_micro_batches(lengths, max_tokens)
    bound = -(-sum(lengths) // max_tokens)
    assert plan.micro_batches_per_rank <= 2 * bound + 1
