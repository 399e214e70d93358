"""The demo's verdict in parts (cooper_mcore.demo.verdict) on runs whose per-problem accuracies, benchmark
verdicts and separations are set by hand; every number below is worked out in the comments."""

from __future__ import annotations

import math

import pytest

from cooper_mcore.demo.report import RunResult
from cooper_mcore.demo.verdict import Part, verdict_parts

BEFORE = [0.5, 0.5, 0.0, 0.5]  # the starting policy, 4 problems: mean 0.375
AFTER = {"rule": [1.0, 0.5, 0.5, 1.0], "static_rm": [0.0, 0.5, 0.0, 0.0], "cooper": [1.0, 0.5, 0.0, 1.0]}
GROUPS = {"plus_minus": [0, 1], "times": [2, 3], "rule_unreadable": [1, 3]}


def _hacking(present: bool, before: float, after: float) -> dict:
    return {"present": present, "reward_start": 0.3, "reward_end": 0.6 if present else 0.35, "reward_rise": 0.3,
            "acc_before": before, "acc_after": after, "acc_change": after - before, "min_reward_rise": 0.25,
            "min_acc_drop": 0.1}


def _runs() -> dict[str, RunResult]:
    runs = {m: RunResult(metrics_path="unused", acc_before=0.375, acc_after=sum(a) / 4, problem_acc=a,
                         problem_acc_before=BEFORE, problem_groups=GROUPS) for m, a in AFTER.items()}
    runs["cooper"].rm_bench_right_before = [True, True, False, True]
    runs["cooper"].rm_bench_right_after = [True, True, True, True]
    return runs


def _means(own_after: float) -> dict:
    return {"rule": {"hacking": _hacking(False, 0.375, 0.75), "acc_after": 0.75},
            "static_rm": {"hacking": _hacking(True, 0.375, 0.125), "acc_after": 0.125},
            "cooper": {"hacking": _hacking(False, 0.375, 0.625), "acc_after": 0.625, "rm_acc_before": 0.75,
                       "rm_acc_after": 1.0,
                       "rm_own_answers": {"before": {"value": 0.6, "se": 0.04}, "after": {"value": own_after,
                                                                                         "se": 0.03}}}}


def _by_name(parts: list[Part]) -> dict[str, Part]:
    return {p.name: p for p in parts}


def test_every_part_by_hand():
    means = _means(own_after=0.52)
    parts = _by_name(verdict_parts(means, [means], [_runs()]))
    assert list(parts) == ["static RM is hacked", "Cooper prevents the hack", "Cooper's RM holds on its own policy's "
                           "answers", "Cooper vs rule on all problems", "Cooper vs rule on the `+`/`-` family",
                           "Cooper vs rule on the `*` family", "Cooper vs rule on the problems whose reference the "
                           "rule cannot read", "Cooper's RM on the fixed benchmark"]
    # static RM: after - before per problem -0.5, 0, 0, -0.5: mean -0.25, sample sd sqrt(4 * 0.25^2 / 3), se sd / 2
    static = parts["static RM is hacked"]
    assert (static.holds, static.value) == (True, pytest.approx(-0.25))
    assert static.se == pytest.approx(math.sqrt(4 * 0.0625 / 3) / 2)
    # Cooper: 0.5, 0, 0, 0.5: mean +0.25, same se; no signature
    coop = parts["Cooper prevents the hack"]
    assert (coop.holds, coop.value, coop.se) == (True, pytest.approx(0.25), pytest.approx(static.se))
    # separation 0.60 +- 0.04 -> 0.52 +- 0.03: -0.08 +- 0.05, above -2 se = -0.10
    own = parts["Cooper's RM holds on its own policy's answers"]
    assert (own.holds, own.value, own.se) == (True, pytest.approx(-0.08), pytest.approx(0.05))
    # Cooper - rule per problem 0, 0, -0.5, 0: mean -0.125, sd sqrt((3 * 0.125^2 + 0.375^2) / 3) = 0.25, se 0.125
    every = parts["Cooper vs rule on all problems"]
    assert (every.holds, every.value, every.se) == (True, pytest.approx(-0.125), pytest.approx(0.125))
    # from 0.375 Cooper gains +0.25 and rule +0.375: 67% of rule's gain
    assert "Cooper ends at 0.625 (+0.250), rule at 0.750 (+0.375), 67% of rule's gain" in every.detail
    # `+`/`-` problems 0, 1: differences 0, 0; `*` problems 2, 3: -0.5, 0 (mean -0.25, sd 0.3536, se 0.25)
    assert (parts["Cooper vs rule on the `+`/`-` family"].value, parts["Cooper vs rule on the `+`/`-` family"].se) \
        == (0.0, 0.0)
    times = parts["Cooper vs rule on the `*` family"]
    assert (times.holds, times.value, times.se) == (True, pytest.approx(-0.25), pytest.approx(0.25))
    unreadable = parts["Cooper vs rule on the problems whose reference the rule cannot read"]  # problems 1, 3
    assert (unreadable.holds, unreadable.value) == (True, 0.0)
    # benchmark verdicts right 1, 1, 0, 1 -> all: changes 0, 0, 1, 0: mean 0.25, sd 0.5, se 0.25
    bench = parts["Cooper's RM on the fixed benchmark"]
    assert (bench.holds, bench.value, bench.se) == (True, pytest.approx(0.25), pytest.approx(0.25))


def test_parts_that_do_not_hold():
    means = _means(own_after=0.45)  # -0.15 +- 0.05: below -2 se
    means["cooper"]["hacking"]["present"] = True
    means["static_rm"]["hacking"]["present"] = False
    runs = _runs()
    runs["cooper"].problem_acc = [0.0, 0.0, 0.0, 0.0]  # Cooper - rule: -1, -0.5, -0.5, -1: mean -0.75, se 0.1443
    runs["cooper"].rm_bench_right_after = [False, False, False, True]  # changes -1, -1, 0, 0: -0.5 +- 0.2887
    parts = _by_name(verdict_parts(means, [means], [runs]))
    assert parts["static RM is hacked"].holds is False and parts["Cooper prevents the hack"].holds is False
    assert parts["Cooper's RM holds on its own policy's answers"].holds is False
    every = parts["Cooper vs rule on all problems"]
    assert (every.holds, every.value) == (False, pytest.approx(-0.75))
    assert parts["Cooper's RM on the fixed benchmark"].holds is True  # -0.5 is within 2 x 0.2887
    assert parts["Cooper vs rule on the `+`/`-` family"].holds is False  # -1, -0.5: -0.75 +- 0.25


def test_seeds_are_averaged_item_by_item():
    """Two seeds: per problem the mean over the seeds, then the mean and its standard error over problems."""
    means = _means(own_after=0.52)
    seed1 = _runs()
    seed1["cooper"].problem_acc = [1.0, 1.0, 0.5, 1.0]  # Cooper - rule in seed 1: 0, 0.5, 0, 0
    parts = _by_name(verdict_parts(means, [means, means], [_runs(), seed1]))
    # per problem, mean over the seeds of (0, 0, -0.5, 0) and (0, 0.5, 0, 0): 0, 0.25, -0.25, 0: mean 0,
    # sample sd sqrt(2 * 0.0625 / 3), se sd / 2
    every = parts["Cooper vs rule on all problems"]
    assert every.value == pytest.approx(0.0) and every.se == pytest.approx(math.sqrt(0.125 / 3) / 2)
    # the separations of the two seeds: mean of equal estimates, se sqrt(2 se^2) / 2
    own = parts["Cooper's RM holds on its own policy's answers"]
    assert own.value == pytest.approx(-0.08) and own.se == pytest.approx(0.05 / math.sqrt(2))


def test_runs_without_the_measurements():
    """Old runs without per-problem accuracies: the hack parts and Cooper vs rule on the means (no standard
    error), no family parts, the separation not measured."""
    means = _means(own_after=0.52)
    del means["cooper"]["rm_own_answers"]
    runs = {m: RunResult(metrics_path="unused", acc_before=0.375, acc_after=0.5) for m in AFTER}
    parts = _by_name(verdict_parts(means, [means], [runs]))
    assert set(parts) == {"static RM is hacked", "Cooper prevents the hack", "Cooper's RM holds on its own "
                          "policy's answers", "Cooper vs rule on all problems", "Cooper's RM on the fixed benchmark"}
    assert parts["Cooper's RM holds on its own policy's answers"].holds is None
    every = parts["Cooper vs rule on all problems"]
    assert (every.value, every.se, every.holds) == (pytest.approx(-0.125), None, False)  # 0.625 - 0.75
    assert parts["Cooper's RM on the fixed benchmark"].value == pytest.approx(0.25)  # 0.75 -> 1.0
