"""Reward controls and the RM calibration anchor (cooper_mcore.algo) against hand-computed numbers:
the reference's bf16 reward, the paper's binary ablation, the group-std floor of the advantages, and
the pairwise loss with a BCE anchor on the pair's own labels."""

from __future__ import annotations

import math

import pytest
import torch

from cooper_mcore.algo import group_advantages, reward_from_logits, rm_bce_loss, rm_pair_losses, rm_pairwise_loss
from cooper_mcore.algo.reward_transforms import round_to_bf16

NAN = float("nan")
# a near-certain group of RM rewards: differences of 1e-4 that plain GRPO blows up to full size
GROUP = [0.9990, 0.9992, 0.9995, 0.9991]


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    exp = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.detach().double(), exp, atol=atol, rtol=0)


def logits_of(probs) -> torch.Tensor:
    p = torch.tensor(probs, dtype=torch.float64)
    return torch.log(p / (1 - p))


# --------------------------------------------------------------------------- reward transforms


def test_sigmoid_bf16_hand_values():
    # logit -> bf16 logit -> sigmoid -> nearest bf16 (2**-8 grid in [0.5, 1), 2**-11 in [1/16, 1/8)):
    #   0 -> 0.5
    #   ln 3 = 1.0986 -> 1.1015625 (grid 2**-7) -> 0.75056 -> 192/256 = 0.75
    #   2 -> 0.880797 -> 225.48/256 -> 225/256 = 0.87890625
    #   -2 -> 0.1192029 -> 244.13 * 2**-11 -> 244 * 2**-11 = 0.119140625
    #   5.5 -> 0.9959299 -> 254.96/256 -> 255/256 = 0.99609375
    #   6.3 -> 6.3125 (grid 2**-5) -> 0.998190 -> 255.54/256 -> 1.0
    logits = torch.tensor([0.0, math.log(3), 2.0, -2.0, 5.5, 6.3])
    r = reward_from_logits(logits, "sigmoid_bf16")
    assert r.dtype == torch.float32
    assert r.tolist() == [0.5, 0.75, 0.87890625, 0.119140625, 0.99609375, 1.0]
    # the same as a bf16 sigmoid kernel on bf16 logits
    assert torch.equal(r, torch.sigmoid(logits.to(torch.bfloat16)).float())
    assert reward_from_logits(logits.double(), "sigmoid_bf16").dtype == torch.float64
    assert round_to_bf16(torch.tensor([1.0 + 2**-9, 1.0 + 3 * 2**-9])).tolist() == [1.0, 1.0 + 2**-7]  # ties to even


def test_binary_and_default_transforms():
    logits = torch.tensor([-0.1, 0.0, 2.0, -3.0])
    assert reward_from_logits(logits, "binary").tolist() == [0.0, 1.0, 1.0, 0.0]
    close(reward_from_logits(logits), [1 / (1 + math.exp(0.1)), 0.5, 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(3))])
    with pytest.raises(ValueError, match="unknown reward transform 'tanh'"):
        reward_from_logits(logits, "tanh")


# --------------------------------------------------------------------------- the near-certain group


def test_near_certain_group_under_each_control():
    r = torch.tensor([GROUP], dtype=torch.float64)
    # plain GRPO: mean 0.9992, deviations -2e-4, 0, 3e-4, -1e-4; unbiased var = (4 + 0 + 9 + 1)e-8 / 3
    std = math.sqrt(14e-8 / 3)  # 2.1602e-4
    dev = [-2e-4, 0.0, 3e-4, -1e-4]
    plain = group_advantages(r)
    close(plain, [[d / (std + 1e-6) for d in dev]], atol=1e-9)
    assert plain[0, 2].item() == pytest.approx(1.3823, abs=1e-4)  # full size from a 3e-4 difference
    # std floor 0.05: divided by the floor instead -> -0.0040, 0, 0.0060, -0.0020
    close(group_advantages(r, std_floor=0.05), [[d / (0.05 + 1e-6) for d in dev]], atol=1e-12)
    # a floor below the group's std changes nothing
    assert torch.equal(group_advantages(r, std_floor=1e-4), plain)
    # the reference's bf16 reward: all four round to 1.0, so the group ties and its advantages are 0
    bf16 = reward_from_logits(logits_of([GROUP]), "sigmoid_bf16")
    assert bf16.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert torch.equal(group_advantages(bf16), torch.zeros(1, 4, dtype=torch.float64))
    # the binary ablation: all 1, advantages 0
    assert reward_from_logits(logits_of([GROUP]), "binary").tolist() == [[1.0, 1.0, 1.0, 1.0]]
    # in float32 the same group: the inputs carry ~6e-8 rounding error, i.e. ~3e-4 of std-size
    # deviations, so the advantages agree with the float64 ones to ~1e-3
    close(group_advantages(r.float()), plain, atol=2e-3)


def test_std_floor_bad_input():
    with pytest.raises(ValueError, match="std_floor"):
        group_advantages(torch.tensor([[1.0, 0.0]]), std_floor=-0.1)


# --------------------------------------------------------------------------- calibration anchor


def test_pairwise_loss_with_anchor_hand_values_and_gradient():
    # margins 1, 0, -2 (valid); the 4th pair is masked and its negative is NaN; anchor weight 0.5
    s_pos = torch.tensor([2.0, 0.0, 1.0, 5.0], requires_grad=True)
    s_neg = torch.tensor([1.0, 0.0, 3.0, NAN], requires_grad=True)
    valid = torch.tensor([True, True, True, False])
    per_pair, sums = rm_pair_losses(s_pos, s_neg, valid, anchor_weight=0.5)
    # pairwise ln(1 + e^-m): 0.3132616875, 0.6931471806, 2.1269280110
    # anchor (ln(1 + e^-s_pos) + ln(1 + e^s_neg)) / 2:
    #   (0.1269280110 + 1.3132616875) / 2 = 0.7200948493; ln 2 = 0.6931471806;
    #   (0.3132616875 + 3.0485873516) / 2 = 1.6809245196
    pairwise = [0.3132616875, 0.6931471806, 2.1269280110]
    anchor = [0.7200948493, 0.6931471806, 1.6809245196]
    close(per_pair, [p + 0.5 * a for p, a in zip(pairwise, anchor)] + [0.0])
    close(sums["num_valid"], 3.0)
    close(sums["pairwise_sum"], sum(pairwise))
    close(sums["anchor_sum"], sum(anchor))
    close(sums["correct_sum"], 1.0)
    # rows right by logit > 0: chosen 2, 0, 1 -> yes, no, yes; rejected 1, 0, 3 (right if <= 0) -> no, yes, no
    close(sums["threshold_correct_sum"], 3.0)

    loss, stats = rm_pairwise_loss(s_pos, s_neg, valid, anchor_weight=0.5)
    d = 3 + 1e-6  # the reference's denominator: valid pairs + 1e-6
    close(loss, sum(p + 0.5 * a for p, a in zip(pairwise, anchor)) / d)
    close(stats["pairwise"], sum(pairwise) / 3)
    close(stats["anchor"], sum(anchor) / 3)
    close(stats["threshold_acc"], 0.5)
    close(stats["pair_acc"], 1 / 3)
    close(stats["mean_chosen"], 1.0)
    close(stats["mean_rejected"], 4 / 3)
    loss.backward()
    # d/ds_pos = (-sigmoid(-m) - 0.25 * sigmoid(-s_pos)) / d; d/ds_neg = (sigmoid(-m) + 0.25 * sigmoid(s_neg)) / d
    # sigmoid: (-1) 0.2689414214, (-2) 0.1192029220, (0) 0.5, (2) 0.8807970780, (1) 0.7310585786, (3) 0.9525741268
    close(s_pos.grad, [(-0.2689414214 - 0.25 * 0.1192029220) / d, (-0.5 - 0.25 * 0.5) / d,
                       (-0.8807970780 - 0.25 * 0.2689414214) / d, 0.0])
    close(s_neg.grad, [(0.2689414214 + 0.25 * 0.7310585786) / d, (0.5 + 0.25 * 0.5) / d,
                       (0.8807970780 + 0.25 * 0.9525741268) / d, 0.0])


def test_anchor_breaks_shift_invariance():
    s_pos = torch.tensor([3.0, 4.0], requires_grad=True)
    s_neg = torch.tensor([1.0, 2.5], requires_grad=True)
    valid = torch.ones(2, dtype=torch.bool)
    loss, _ = rm_pairwise_loss(s_pos, s_neg, valid)
    loss.backward()
    # the pairwise loss alone is shift-invariant: the gradient along (1, 1) of each pair is 0
    close(s_pos.grad + s_neg.grad, [0.0, 0.0])
    s_pos.grad = s_neg.grad = None
    loss, _ = rm_pairwise_loss(s_pos, s_neg, valid, anchor_weight=1.0)
    loss.backward()
    # with the anchor it is 0.5 * (sigmoid(s_pos) - 1 + sigmoid(s_neg)) / (2 + 1e-6) per pair: positive here,
    # i.e. descent moves all scores down, towards the 0.5 threshold the rejected side has crossed
    sig = torch.sigmoid
    expected = 0.5 * (sig(s_pos.detach()) - 1 + sig(s_neg.detach())) / (2 + 1e-6)
    close(s_pos.grad + s_neg.grad, expected)
    assert bool((expected > 0).all())


def test_anchor_zero_weight_is_the_paper_loss_and_bad_weight():
    s_pos, s_neg = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 0.5])
    valid = torch.tensor([True, False])
    per_pair, _ = rm_pair_losses(s_pos, s_neg, valid)
    close(per_pair, [math.log1p(math.exp(-1.5)), 0.0])
    with pytest.raises(ValueError, match="anchor_weight"):
        rm_pair_losses(s_pos, s_neg, valid, anchor_weight=-1.0)
    loss, stats = rm_pairwise_loss(s_pos, s_neg, torch.tensor([False, False]), anchor_weight=1.0)
    assert loss.item() == 0.0 and stats["threshold_acc"].item() == 0.0


def test_bce_reductions():
    logits = torch.tensor([2.0, -1.0])
    labels = torch.tensor([1, 1])
    per_row, _ = rm_bce_loss(logits, labels, reduction="none")
    close(per_row, [0.1269280110, 1.3132616875])  # ln(1 + e^-2), ln(1 + e^1)
    close(rm_bce_loss(logits, labels, reduction="sum")[0], 0.1269280110 + 1.3132616875)
    close(rm_bce_loss(logits, labels)[0], (0.1269280110 + 1.3132616875) / 2)
    assert rm_bce_loss(torch.zeros(0), torch.zeros(0), reduction="none")[0].shape == (0,)
    with pytest.raises(ValueError, match="reduction"):
        rm_bce_loss(logits, labels, reduction="max")
