"""Preference-pair selection (cooper_mcore.algo.pairs) against picks worked out by hand: first /
hardest / random positives, hardest / random / first policy negatives, k pairs per prompt, masks,
and unverifiable rollouts never chosen."""

from __future__ import annotations

import pytest
import torch

from cooper_mcore.algo import gather_by_group
from cooper_mcore.algo.pairs import (
    CORRECT,
    UNVERIFIABLE,
    WRONG,
    first_positive_index,
    select_negatives,
    select_pairs,
    select_positives,
    verdict_codes,
)

C, W, U = CORRECT, WRONG, UNVERIFIABLE
NAN = float("nan")

# row 0: positives at 0 (score 0.2) and 2 (-0.5); negatives at 1 (0.9), 4 (0.1), 5 (0.9, ties with 1);
#        column 3 is unverifiable and scores highest, so it must never be picked.
# row 1: no positive; negatives at 0 (0.4) and 1 (0.6).
# row 2: positives at 0 (0.3), 1 (0.1), 2 (0.7); one negative at 5 (-1.0).
# row 3: nothing verifiable (its scores are NaN, which is fine as no pick reads them).
VERDICTS = torch.tensor([
    [C, W, C, U, W, W],
    [W, W, U, U, U, U],
    [C, C, C, U, U, W],
    [U, U, U, U, U, U],
], dtype=torch.int8)
SCORES = torch.tensor([
    [0.2, 0.9, -0.5, 5.0, 0.1, 0.9],
    [0.4, 0.6, 9.0, 9.0, 9.0, 9.0],
    [0.3, 0.1, 0.7, 0.0, 0.0, -1.0],
    [NAN, NAN, NAN, NAN, NAN, NAN],
])


def test_verdict_codes_pads_ragged_rows_as_unverifiable():
    codes = verdict_codes([[True, None, False], [False]])
    assert codes.dtype == torch.int8
    assert codes.tolist() == [[C, U, W], [W, U, U]]
    assert verdict_codes([[True]], width=3).tolist() == [[C, U, U]]
    with pytest.raises(ValueError, match="width"):
        verdict_codes([[True, False]], width=1)


def test_positives_first_and_hardest_cycle_when_fewer_than_k():
    index, has = select_positives(VERDICTS, SCORES, k=3, pick="first")
    assert has.tolist() == [True, False, True, False]
    assert index.tolist() == [[0, 2, 0], [0, 0, 0], [0, 1, 2], [0, 0, 0]]
    index, has = select_positives(VERDICTS, SCORES, k=3, pick="hardest")  # lowest score first
    assert index.tolist() == [[2, 0, 2], [0, 0, 0], [1, 0, 2], [0, 0, 0]]
    # "first" needs no scores
    assert select_positives(VERDICTS, None, k=1, pick="first")[0].tolist() == [[0], [0], [0], [0]]


def test_negatives_hardest_first_distinct_and_masked():
    index, valid = select_negatives(VERDICTS, SCORES, k=3, pick="hardest")
    # row 0: 0.9 (col 1) and 0.9 (col 5) tie -> column order, then 0.1 (col 4); row 1: 0.6 then 0.4
    assert index.tolist() == [[1, 5, 4], [1, 0, 0], [5, 0, 0], [0, 0, 0]]
    assert valid.tolist() == [[True, True, True], [True, True, False], [True, False, False], [False, False, False]]
    index, valid = select_negatives(VERDICTS, SCORES, k=2, pick="first")
    assert index.tolist() == [[1, 4], [0, 1], [5, 0], [0, 0]]
    assert valid.tolist() == [[True, True], [True, True], [True, False], [False, False]]
    # k larger than the group
    index, valid = select_negatives(VERDICTS, SCORES, k=8, pick="hardest")
    assert index.shape == (4, 8) and valid.sum(dim=1).tolist() == [3, 2, 1, 0]


def test_select_pairs_hardest_vs_hardest():
    sel = select_pairs(VERDICTS, SCORES, k=3, positive_pick="hardest", negative_pick="hardest")
    assert sel.valid.tolist() == [[True, True, True], [False, False, False], [True, False, False],
                                  [False, False, False]]
    assert sel.pos_index[0].tolist() == [2, 0, 2] and sel.neg_index[0].tolist() == [1, 5, 4]
    assert sel.pos_index[2, 0].item() == 1 and sel.neg_index[2].tolist() == [5, 0, 0]
    assert sel.neg_index[1].tolist() == [0, 0, 0]  # no positive: masked and zeroed
    assert sel.has_positive.tolist() == [True, False, True, False]
    assert sel.num_wrong.tolist() == [3, 2, 1, 0]
    # the pairs' scores: s_pos / s_neg through gather_by_group with [P, k] indices
    s_pos, s_neg = gather_by_group(SCORES, sel.pos_index), gather_by_group(SCORES, sel.neg_index)
    assert s_pos[0].tolist() == pytest.approx([-0.5, 0.2, -0.5]) and s_neg[0].tolist() == pytest.approx([0.9, 0.9, 0.1])


def test_reference_pick_is_first_correct_one_pair():
    sel = select_pairs(VERDICTS, SCORES, k=1, positive_pick="first", negative_pick="first")
    index, has = first_positive_index(VERDICTS)
    assert sel.pos_index[:, 0].tolist() == index.tolist() == [0, 0, 0, 0]
    assert has.tolist() == [True, False, True, False]
    assert sel.neg_index[:, 0].tolist() == [1, 0, 5, 0] and sel.valid[:, 0].tolist() == [True, False, True, False]


def test_bool_verdicts_have_no_unverifiable():
    v = torch.tensor([[False, True, False]])
    sel = select_pairs(v, torch.tensor([[3.0, 0.0, 1.0]]), k=2, negative_pick="hardest")
    assert sel.pos_index.tolist() == [[1, 1]] and sel.neg_index.tolist() == [[0, 2]]
    assert sel.valid.tolist() == [[True, True]]


def test_random_picks_are_seeded_permutations_of_the_candidates():
    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return select_pairs(VERDICTS, None, k=3, positive_pick="random", negative_pick="random", generator=g)

    a, b = draw(5), draw(5)
    assert torch.equal(a.pos_index, b.pos_index) and torch.equal(a.neg_index, b.neg_index)
    firsts_pos, firsts_neg = set(), set()
    for seed in range(40):
        sel = draw(seed)
        assert sorted(sel.pos_index[2].tolist()) == [0, 1, 2]  # 3 positives, 3 slots: each once
        assert sorted(sel.neg_index[0].tolist()) == [1, 4, 5]  # distinct negatives, never column 3
        assert sel.pos_index[0, 0].item() == sel.pos_index[0, 2].item() in (0, 2)  # 2 positives cycle
        firsts_pos.add(sel.pos_index[2, 0].item())
        firsts_neg.add(sel.neg_index[0, 0].item())
    assert firsts_pos == {0, 1, 2} and firsts_neg == {1, 4, 5}


def test_bad_input():
    with pytest.raises(ValueError, match="needs the reward model's scores"):
        select_negatives(VERDICTS, None, pick="hardest")
    with pytest.raises(ValueError, match="finite score"):
        bad = SCORES.clone()
        bad[0, 4] = NAN  # a candidate negative
        select_negatives(VERDICTS, bad, pick="hardest")
    with pytest.raises(ValueError, match="shape"):
        select_positives(VERDICTS, SCORES[:, :3], pick="hardest")
    with pytest.raises(ValueError, match=">= 1"):
        select_pairs(VERDICTS, SCORES, k=0)
    with pytest.raises(ValueError, match="unknown negative_pick 'worst'"):
        select_negatives(VERDICTS, SCORES, pick="worst")
    with pytest.raises(ValueError, match="unknown positive_pick"):
        select_positives(VERDICTS, SCORES, pick="hardest_first")
    with pytest.raises(ValueError, match=r"\[num_groups, G\]"):
        select_positives(torch.tensor([1, 0]))
    with pytest.raises(ValueError):
        gather_by_group(SCORES, torch.tensor([[0, 6], [0, 0], [0, 0], [0, 0]]))
