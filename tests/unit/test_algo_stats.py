"""The verdict's means and standard errors (cooper_mcore.algo.stats) against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from cooper_mcore.algo.stats import Estimate, difference_se, mean_se, paired_mean_se, separation_se


def test_paired_mean_se_by_hand():
    # items averaged over the two seeds: 0.5, 0, 1, 0.5; mean 0.5; sample variance (0 + .25 + .25 + 0) / 3
    e = paired_mean_se([[1.0, 0.0, 1.0, 0.5], [0.0, 0.0, 1.0, 0.5]])
    assert e.value == pytest.approx(0.5)
    assert e.se == pytest.approx(math.sqrt(0.5 / 3 / 4))  # 0.2041
    one = paired_mean_se([[0.25, 0.75]])  # one seed: sd of (0.25, 0.75) is 0.3536, / sqrt(2) = 0.25
    assert (one.value, one.se) == (pytest.approx(0.5), pytest.approx(0.25))
    assert paired_mean_se([[0.3]]).value == pytest.approx(0.3) and math.isnan(paired_mean_se([[0.3]]).se)
    assert all(math.isnan(x) for x in (paired_mean_se([[]]).value, paired_mean_se([[]]).se))


def test_paired_mean_se_refuses_misaligned_seeds():
    with pytest.raises(ValueError, match="same items"):
        paired_mean_se([[1.0, 0.0], [1.0]])
    with pytest.raises(ValueError, match="at least one seed"):
        paired_mean_se([])


def test_separation_se_by_hand():
    # 4 correct, 3 accepted: TPR 0.75; 2 wrong, 1 accepted: FPR 0.5
    e = separation_se([True, True, True, True, False, False], [True, True, True, False, True, False])
    assert e.value == pytest.approx(0.25)
    assert e.se == pytest.approx(math.sqrt(0.75 * 0.25 / 4 + 0.5 * 0.5 / 2))  # 0.4146
    perfect = separation_se([True, False], [True, False])
    assert (perfect.value, perfect.se) == (1.0, 0.0)
    assert math.isnan(separation_se([True, True], [True, False]).value)  # no wrong completion: not measured
    with pytest.raises(ValueError, match="labels"):
        separation_se([True], [True, False])


def test_mean_and_difference_by_hand():
    m = mean_se([Estimate(0.2, 0.03), Estimate(0.4, 0.04)])
    assert (m.value, m.se) == (pytest.approx(0.3), pytest.approx(0.025))  # sqrt(.0009 + .0016) / 2
    d = difference_se(Estimate(0.5, 0.03), Estimate(0.2, 0.04))
    assert (d.value, d.se) == (pytest.approx(0.3), pytest.approx(0.05))
    with pytest.raises(ValueError, match="at least one"):
        mean_se([])
