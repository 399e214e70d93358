"""cooper_mcore.algo against numbers worked out by hand: GRPO advantages, the PPO clipped surrogate,
KL estimators, masked aggregation, entropy, the rollout engine against the trainer (mismatch sums,
truncated importance-sampling weights), the reward-model losses and positive selection."""

from __future__ import annotations

import math

import pytest
import torch

from cooper_mcore.algo import (
    aggregate,
    broadcast_to_tokens,
    entropy_from_logits,
    first_positive_index,
    gather_by_group,
    group_advantages,
    kl_penalty,
    logprob_mismatch_sums,
    masked_mean,
    masked_sum,
    policy_loss,
    reward_from_logits,
    rm_bce_loss,
    rm_pairwise_loss,
    truncated_is_weights,
)

NAN = float("nan")
INF = float("inf")


def close(actual: torch.Tensor, expected, atol: float = 1e-6) -> None:
    exp = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.detach().double(), exp, atol=atol, rtol=0)


# --------------------------------------------------------------------------- advantages


def test_group_advantages_hand_values():
    # group 0: [1, 0, 0, 1]: mean 0.5, deviations +-0.5, unbiased var = (4 * 0.25) / 3 = 1/3.
    # group 1: [3, 1, 2, 2]: mean 2, deviations 1, -1, 0, 0, unbiased var = 2 / 3.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    a0 = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # ~0.866024 (sqrt(3)/2 without eps)
    a1 = 1.0 / (math.sqrt(2 / 3) + 1e-6)  # ~1.224743
    adv = group_advantages(rewards)
    close(adv, [[a0, -a0, -a0, a0], [a1, -a1, 0.0, 0.0]])
    assert abs(a0 - 0.8660239) < 1e-6
    # population std of [1, 0, 0, 1] is 0.5 -> +-0.5 / 0.500001
    close(group_advantages(rewards[:1], unbiased=False), [[1 / 1.000002, -1 / 1.000002, -1 / 1.000002, 1 / 1.000002]])
    # each group has zero mean
    close(adv.sum(dim=1), [0.0, 0.0])


def test_group_advantages_degenerate_groups_are_zero():
    single = group_advantages(torch.tensor([[5.0], [-2.0]]))
    assert single.shape == (2, 1)
    assert torch.equal(single, torch.zeros(2, 1))
    const = group_advantages(torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(const, torch.zeros(3, 3))
    # 8 x 0.9 in float32: the mean is off by an ulp and std ~6e-8, so (r - mean) / (std + 1e-6) would be
    # ~0.056, not 0; a constant group must still give exactly 0
    assert torch.equal(group_advantages(torch.full((2, 8), 0.9)), torch.zeros(2, 8))
    # a constant group next to a normal one does not disturb it
    mixed = group_advantages(torch.tensor([[0.7, 0.7], [1.0, 0.0]]))
    std = math.sqrt(0.5)  # deviations +-0.5, unbiased var = 0.5 / 1
    close(mixed, [[0.0, 0.0], [0.5 / (std + 1e-6), -0.5 / (std + 1e-6)]])
    assert torch.isfinite(mixed).all()


def test_group_advantages_bad_input():
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 0))


def test_broadcast_to_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = broadcast_to_tokens(torch.tensor([0.5, -2.0]), mask)
    assert torch.equal(out, torch.tensor([[0.5, 0.5, 0.0], [0.0, -2.0, -2.0]]))
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.tensor([0.5, -2.0, 1.0]), mask)


# --------------------------------------------------------------------------- policy loss


def _ratios_to_logp(ratios):
    old = torch.zeros(len(ratios), len(ratios[0]))
    return torch.log(torch.tensor(ratios)), old


def test_policy_loss_clip_regions_hand_values():
    # eps = 0.2 -> ratio clipped to [0.8, 1.2]. Column 3 is padding (huge ratio, mask 0).
    # A = +1: r=0.5: max(-0.5, -0.8) = -0.5 (unclipped); r=1.1: -1.1; r=1.5: max(-1.5, -1.2) = -1.2 (clip)
    # A = -1: r=0.5: max(0.5, 0.8) = 0.8 (clip); r=1.1: 1.1; r=1.5: max(1.5, 1.2) = 1.5 (unclipped)
    logp, old = _ratios_to_logp([[0.5, 1.1, 1.5, 100.0], [0.5, 1.1, 1.5, 100.0]])
    logp.requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    loss, stats = policy_loss(logp, old, adv, mask)
    close(loss, [[-0.5, -1.1, -1.2, 0.0], [0.8, 1.1, 1.5, 0.0]], atol=1e-6)
    close(stats["clip_frac"], 2 / 6)
    close(stats["clip_frac_low"], 1 / 6)
    close(stats["clip_frac_high"], 1 / 6)
    close(stats["dual_clip_frac"], 0.0)
    close(stats["ratio_mean"], (0.5 + 1.1 + 1.5) * 2 / 6, atol=1e-6)
    close(stats["ratio_max"], 1.5, atol=1e-6)  # the padding's 100 is excluded
    close(stats["ratio_min"], 0.5, atol=1e-6)
    # the per-token statistics behind the means: the ratio (1 on padding) and the clipped tokens, the
    # ones that get no gradient below (r=1.5 with A=+1, r=0.5 with A=-1)
    close(stats.ratio, [[0.5, 1.1, 1.5, 1.0], [0.5, 1.1, 1.5, 1.0]], atol=1e-6)
    assert stats.clipped.tolist() == [[False, False, True, False], [True, False, False, False]]
    assert set(stats) == {"clip_frac", "clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean",
                          "ratio_max", "ratio_min", "approx_kl"}
    # d loss / d logp = -A * ratio on unclipped tokens, 0 on clipped ones and padding
    loss.sum().backward()
    close(logp.grad, [[-0.5, -1.1, 0.0, 0.0], [0.0, 1.1, 1.5, 0.0]], atol=1e-6)
    # expected sign: positive advantage -> raising logp lowers the loss
    assert logp.grad[0, 0] < 0 and logp.grad[1, 1] > 0


def test_policy_loss_ratio_one_is_minus_advantage_exactly():
    logp = torch.tensor([[-0.3, -2.0, -7.5]])
    adv = torch.tensor([[0.7, -1.3, 0.0]])
    loss, stats = policy_loss(logp, logp.clone(), adv, torch.ones(1, 3, dtype=torch.bool))
    assert torch.equal(loss, torch.tensor([[-0.7, 1.3, 0.0]]))
    assert stats["clip_frac"].item() == 0.0
    assert stats["ratio_mean"].item() == 1.0
    assert stats["approx_kl"].item() == 0.0


def test_policy_loss_clip_higher():
    # clip_low 0.2, clip_high 0.28 -> ratio in [0.8, 1.28]
    # A=+1, r=1.25: max(-1.25, -1.25) = -1.25 (inside; the symmetric 0.2 clip would give -1.2)
    # A=+1, r=1.4: max(-1.4, -1.28) = -1.28 (clip high)
    # A=-1, r=0.7: max(0.7, 0.8) = 0.8 (clip low, unchanged by clip_high)
    logp, old = _ratios_to_logp([[1.25, 1.4, 0.7]])
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25, -1.28, 0.8]], atol=1e-6)
    close(stats["clip_frac"], 2 / 3)
    close(stats["clip_frac_high"], 1 / 3)
    close(stats["clip_frac_low"], 1 / 3)
    sym, sym_stats = policy_loss(logp, old, adv, mask)
    close(sym, [[-1.2, -1.2, 0.8]], atol=1e-6)
    close(sym_stats["clip_frac"], 1.0)


def test_policy_loss_dual_clip():
    # c = 3: A=-1, r=5: max(5, 1.2) = 5 -> capped at -A*c = 3; A=-1, r=2: 2 (< 3, kept);
    # A=+1, r=5: max(-5, -1.2) = -1.2 (dual clip only touches A < 0)
    logp, old = _ratios_to_logp([[5.0, 2.0, 5.0]])
    logp.requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 3), clip_ratio_c=3.0)
    close(loss, [[3.0, 2.0, -1.2]], atol=1e-5)
    close(stats["dual_clip_frac"], 1 / 3)
    loss.sum().backward()
    close(logp.grad, [[0.0, 2.0, 0.0]], atol=1e-5)  # capped and clipped tokens get no gradient
    assert stats.clipped.tolist() == [[True, False, True]]  # exactly those: the dual cap and the PPO clip
    close(stats.ratio, [[5.0, 2.0, 5.0]], atol=1e-5)
    off, _ = policy_loss(logp.detach(), old, adv, torch.ones(1, 3))
    close(off, [[5.0, 2.0, -1.2]], atol=1e-5)


def test_policy_loss_dual_clip_caps_negative_advantages_at_three_abs_a():
    # clip 0.2 and c = 3, |A| = 2 (verl's and the reference implementation's dual clip):
    # A=-2, r=5: max(-A*r, -A*clip(r)) = max(10, 2.4) = 10 -> capped at -A*c = 6 (no gradient)
    # A=-2, r=2: max(4, 2.4) = 4 < 6: not capped (gradient -A*r = 4)
    # A=+2, r=5: max(-10, -2.4) = -2.4 (PPO clip high, no gradient); A=+2, r=0.5: max(-1, -1.6) = -1
    # (gradient -A*r = -1): the cap only touches A < 0, positive tokens are as without it
    logp, old = _ratios_to_logp([[5.0, 2.0, 5.0, 0.5]])
    logp.requires_grad_(True)
    adv = torch.tensor([[-2.0, -2.0, 2.0, 2.0]])
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    close(loss, [[6.0, 4.0, -2.4, -1.0]], atol=1e-5)
    loss.sum().backward()
    close(logp.grad, [[0.0, 4.0, 0.0, -1.0]], atol=1e-5)
    off, off_stats = policy_loss(logp.detach(), old, adv, mask)
    close(off, [[10.0, 4.0, -2.4, -1.0]], atol=1e-5)
    # clip_frac counts the tokens either clip cuts off the gradient: the PPO clip (r=5, A>0) and the
    # dual clip (r=5, A<0); its parts (below / above the range, dual) add up to it
    close(stats["dual_clip_frac"], 1 / 4)
    close(stats["clip_frac_high"], 1 / 4)
    close(stats["clip_frac_low"], 0.0)
    close(stats["clip_frac"], 2 / 4)
    close(off_stats["clip_frac"], 1 / 4)  # without the dual clip the r=5, A<0 token keeps its gradient
    close(off_stats["dual_clip_frac"], 0.0)


def test_policy_loss_per_sequence_advantages_and_nan_padding():
    logp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, INF, NAN]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, stats = policy_loss(logp, old, torch.tensor([2.0, -3.0]), mask)
    assert torch.equal(loss, torch.tensor([[-2.0, -2.0, 0.0], [3.0, 0.0, 0.0]]))
    aggregate(loss, mask).backward()
    # token-mean over 3 tokens: d/dlogp = -A * ratio / 3 = -2/3, -2/3 and +1 on the response, 0 on padding
    close(logp.grad, [[-2 / 3, -2 / 3, 0.0], [1.0, 0.0, 0.0]])
    assert all(torch.isfinite(v).all() for v in stats.values())
    # finite log-probs but NaN per-token advantages on padding: no NaN in the gradient either
    logp = torch.tensor([[-1.0, -2.0, -0.7], [-0.5, -0.2, -0.3]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -0.9], [-0.5, -0.1, -0.3]])
    adv = torch.tensor([[2.0, 2.0, NAN], [-3.0, NAN, INF]])
    loss, _ = policy_loss(logp, old, adv, mask)
    assert torch.equal(loss, torch.tensor([[-2.0, -2.0, 0.0], [3.0, 0.0, 0.0]]))
    aggregate(loss, mask).backward()
    close(logp.grad, [[-2 / 3, -2 / 3, 0.0], [1.0, 0.0, 0.0]])


def test_policy_loss_empty_mask_and_bad_input():
    logp = torch.zeros(2, 2)
    loss, stats = policy_loss(logp, logp, torch.ones(2, 2), torch.zeros(2, 2))
    assert torch.equal(loss, torch.zeros(2, 2))
    assert stats["ratio_max"].item() == 0.0 and stats["ratio_min"].item() == 0.0 and stats["clip_frac"].item() == 0.0
    assert not stats.clipped.any() and torch.equal(stats.ratio, torch.ones(2, 2))
    with pytest.raises(ValueError):
        policy_loss(logp, torch.zeros(2, 3), torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError):
        policy_loss(logp, logp, torch.ones(3), torch.ones(2, 2))
    with pytest.raises(ValueError):
        policy_loss(logp, logp, torch.ones(2, 2), torch.ones(2, 2), clip_low=1.0)
    with pytest.raises(ValueError):
        policy_loss(logp, logp, torch.ones(2, 2), torch.ones(2, 2), clip_ratio_c=1.0)


# --------------------------------------------------------------------------- KL


def test_kl_estimators_hand_values():
    # d = logp - ref = [0.5, -1.0, 0.0]
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    close(kl_penalty(logp, ref, "k1"), [0.5, -1.0, 0.0])
    close(kl_penalty(logp, ref, "kl"), [0.5, -1.0, 0.0])
    close(kl_penalty(logp, ref, "k2"), [0.125, 0.5, 0.0])  # 0.5 * d^2
    close(kl_penalty(logp, ref, "abs"), [0.5, 1.0, 0.0])
    # k3 with x = ref - logp = [-0.5, 1, 0]: e^x - x - 1 = [0.60653066 + 0.5 - 1, 2.71828183 - 2, 0]
    k3 = [0.1065306597, 0.7182818285, 0.0]
    close(kl_penalty(logp, ref, "k3"), k3)
    close(kl_penalty(logp, ref, "low_var_kl"), k3)
    close(kl_penalty(logp, ref), k3)  # default


def test_kl_k3_nonnegative_clamped_and_gradient():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(64, generator=g) * 3, torch.randn(64, generator=g) * 3
    k3 = kl_penalty(logp, ref, "k3")
    assert (k3 >= 0).all()
    assert torch.equal(k3, kl_penalty(logp, ref, "low_var_kl"))
    # x = -20: e^-20 + 20 - 1 = 19.000000002 -> 10;  x = +30 -> e^20 + ... -> 10 (log-ratio clamped to 20 first)
    clamped = kl_penalty(torch.tensor([0.0, -30.0, 0.0]), torch.tensor([-20.0, 0.0, -5.0]), "k3")
    close(clamped, [10.0, 10.0, math.exp(-5) + 5 - 1], atol=1e-5)
    # gradient d/dlogp of e^(ref-logp) - (ref-logp) - 1 = 1 - e^(ref-logp): at x=-0.5: 1 - 0.60653066 > 0
    lp = torch.tensor([-1.0, 0.0], requires_grad=True)
    kl_penalty(lp, torch.tensor([-1.5, -20.0])).sum().backward()
    close(lp.grad, [1 - 0.6065306597, 0.0])


def test_kl_zero_when_equal_and_bad_input():
    logp = torch.tensor([[-0.1, -3.0], [-12.0, 0.0]])
    for kind in ("k1", "k2", "k3", "low_var_kl", "abs"):
        assert torch.equal(kl_penalty(logp, logp.clone(), kind), torch.zeros(2, 2)), kind
    with pytest.raises(ValueError):
        kl_penalty(logp, logp, "k4")
    with pytest.raises(ValueError):
        kl_penalty(logp, logp[0], "k1")


# --------------------------------------------------------------------------- aggregation


def _agg_case():
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, NAN, 100.0, 100.0], [7.0, 8.0, 9.0, 10.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    return loss, mask


def test_masked_sum_and_mean_exclude_padding():
    loss, mask = _agg_case()
    assert masked_sum(loss, mask).item() == 10.0  # 1 + 2 + 3 + 4
    assert masked_mean(loss, mask).item() == 2.5  # 10 / 4 tokens
    close(masked_mean(loss, mask, dim=-1), [2.0, 4.0, 0.0])  # empty row -> 0
    close(masked_sum(loss, mask.bool(), dim=-1), [6.0, 4.0, 0.0])
    assert masked_mean(loss, torch.zeros_like(mask)).item() == 0.0
    with pytest.raises(ValueError):
        masked_sum(loss, mask[:, :3])


def test_aggregate_modes_hand_values():
    loss, mask = _agg_case()
    assert aggregate(loss, mask).item() == 2.5  # token-mean: (1+2+3+4) / 4
    assert aggregate(loss, mask, "token-sum").item() == 10.0
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == 3.0  # (6/3 + 4/1) / 2 sequences with tokens
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == 5.0  # (6 + 4) / 2
    x = loss.clone().requires_grad_(True)
    aggregate(x, mask).backward()
    assert torch.equal(x.grad, mask.float() / 4)  # 1/4 per response token, 0 on padding (NaN there too)
    with pytest.raises(ValueError):
        aggregate(loss, mask, "token-median")


# --------------------------------------------------------------------------- entropy


def test_entropy_hand_values():
    close(entropy_from_logits(torch.zeros(7)), math.log(7))
    close(entropy_from_logits(torch.full((2, 3, 5), 1000.0)), torch.full((2, 3), math.log(5)).tolist(), atol=1e-5)
    # p = [1/4, 3/4]: H = 0.25 ln 4 + 0.75 ln(4/3) = 0.34657359 + 0.21576155
    close(entropy_from_logits(torch.tensor([0.0, math.log(3)])), 0.5623351446, atol=1e-6)
    # one-hot-ish: p_other = e^-50 -> H ~ 3 * 51 * e^-50 ~ 3e-20
    h = entropy_from_logits(torch.tensor([[50.0, 0.0, 0.0, 0.0], [1e4, -1e4, 0.0, 0.0]]))
    assert torch.isfinite(h).all() and (h.abs() < 1e-6).all()
    # masked vocabulary entries (-inf) contribute nothing: two live entries -> ln 2
    close(entropy_from_logits(torch.tensor([0.0, -INF, 0.0])), math.log(2))
    bf = entropy_from_logits(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert bf.dtype == torch.float32
    close(bf, [math.log(4)] * 3)
    with pytest.raises(ValueError):
        entropy_from_logits(torch.zeros(3, 0))


# --------------------------------------------------------------------------- engine vs trainer


def test_truncated_is_weights_hand_values():
    # old - engine = ln 3, ln 0.5, 0, ln 1.5 (masked out); cap 2: weights min(3, 2) = 2, 0.5, 1; 1 outside
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0, math.log(1.5)]])
    engine = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])
    close(truncated_is_weights(old, engine, mask, cap=2.0), [[2.0, 0.5, 1.0, 1.0]])
    # log-ratios beyond +-20 are clamped before exp; NaN outside the mask is ignored
    w = truncated_is_weights(torch.tensor([[50.0, -50.0, NAN]]), torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), 1e12)
    torch.testing.assert_close(w.double(), torch.tensor([[math.exp(20.0), math.exp(-20.0), 1.0]], dtype=torch.float64),
                               rtol=1e-6, atol=0)
    x = old.clone().requires_grad_()
    assert not truncated_is_weights(x, engine, mask, 2.0).requires_grad  # a constant of the loss
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, engine, mask, 0.0)
    with pytest.raises(ValueError, match="shapes must match"):
        truncated_is_weights(old, engine[:, :3], mask, 2.0)


def test_logprob_mismatch_sums_hand_values():
    # engine - trainer = 0.5, -1.0, 0.0 on the response (the 4th is padding, NaN there)
    engine = torch.tensor([[-1.0, -3.0, -0.25, NAN]])
    trainer = torch.tensor([[-1.5, -2.0, -0.25, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    sums, top = logprob_mismatch_sums(engine, trainer, mask, tis_cap=2.0)
    close(sums["tokens"], 3.0)
    close(sums["abs_diff_sum"], 1.5)
    close(top, 1.0)
    # k3 with r = exp(trainer - engine): r - 1 - ln r at ln r = -0.5, 1.0, 0
    k3 = (math.exp(-0.5) + 0.5 - 1.0) + (math.exp(1.0) - 1.0 - 1.0) + 0.0
    close(sums["kl_sum"], k3)
    # TIS weights min(exp(trainer - engine), 2): e^-0.5, min(e, 2) = 2 (capped), 1
    close(sums["tis_weight_sum"], math.exp(-0.5) + 2.0 + 1.0)
    close(sums["tis_capped"], 1.0)
    plain, _ = logprob_mismatch_sums(engine, trainer, mask)
    assert float(plain["tis_weight_sum"]) == 0.0 and float(plain["tis_capped"]) == 0.0
    empty, top = logprob_mismatch_sums(engine, trainer, torch.zeros(1, 4))
    assert float(empty["tokens"]) == 0.0 and float(top) == 0.0


# --------------------------------------------------------------------------- reward model


def test_rm_pairwise_loss_hand_values_and_gradient():
    # margins 1, 0, -2 (valid); the 4th pair is masked and its negative is NaN
    s_pos = torch.tensor([2.0, 0.0, 1.0, 5.0], requires_grad=True)
    s_neg = torch.tensor([1.0, 0.0, 3.0, NAN], requires_grad=True)
    valid = torch.tensor([True, True, True, False])
    loss, stats = rm_pairwise_loss(s_pos, s_neg, valid)
    # -logsigmoid(m) = ln(1 + e^-m): ln(1 + e^-1) = 0.31326169, ln 2 = 0.69314718, ln(1 + e^2) = 2.12692801
    close(loss, (0.3132616875 + 0.6931471806 + 2.1269280110) / (3 + 1e-6))
    close(stats["pair_acc"], 1 / 3)  # only margin 1 > 0 (a tie is not a win)
    assert stats["num_valid"].item() == 3
    close(stats["margin_mean"], (1 + 0 - 2) / 3)
    loss.backward()
    # d/ds_pos = -sigmoid(-m) / 3: sigmoid(-1) = 0.26894142, sigmoid(0) = 0.5, sigmoid(2) = 0.88079708
    d = 3 + 1e-6
    close(s_pos.grad, [-0.2689414214 / d, -0.5 / d, -0.8807970780 / d, 0.0])
    close(s_neg.grad, [0.2689414214 / d, 0.5 / d, 0.8807970780 / d, 0.0])


def test_rm_pairwise_loss_all_masked():
    s_pos = torch.tensor([1.0, -2.0], requires_grad=True)
    s_neg = torch.tensor([3.0, NAN], requires_grad=True)
    loss, stats = rm_pairwise_loss(s_pos, s_neg, torch.tensor([0, 0]))
    assert loss.item() == 0.0
    assert stats["pair_acc"].item() == 0.0 and stats["num_valid"].item() == 0
    loss.backward()
    assert torch.equal(s_pos.grad, torch.zeros(2)) and torch.equal(s_neg.grad, torch.zeros(2))
    with pytest.raises(ValueError):
        rm_pairwise_loss(s_pos, s_neg[:1], torch.tensor([1]))


def test_rm_bce_loss_hand_values():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0], requires_grad=True)
    labels = torch.tensor([1, 1, 0, 0])
    loss, stats = rm_bce_loss(logits, labels)
    # label 1: ln(1 + e^-x); label 0: ln(1 + e^x)
    # ln(1 + e^-2) = 0.12692801, ln(1 + e^1) = 1.31326169, ln(1 + e^0.5) = 0.97407698, ln(1 + e^-3) = 0.04858735
    close(loss, (0.1269280110 + 1.3132616875 + 0.9740769842 + 0.0485873516) / 4)
    close(stats["acc"], 0.5)  # predictions (logit > 0) [1, 0, 1, 0] vs labels [1, 1, 0, 0]
    close(stats["pos_frac"], 0.5)
    loss.backward()
    # d/dx = (sigmoid(x) - y) / 4: sigmoid(2) = 0.88079708, sigmoid(-1) = 0.26894142, sigmoid(0.5) = 0.62245933,
    # sigmoid(-3) = 0.04742587
    close(logits.grad, [(0.8807970780 - 1) / 4, (0.2689414214 - 1) / 4, 0.6224593312 / 4, 0.0474258732 / 4])
    bool_loss, _ = rm_bce_loss(logits.detach(), labels.bool())
    close(bool_loss, loss)
    with pytest.raises(ValueError):
        rm_bce_loss(logits, labels[:3])


def test_reward_from_logits():
    r = reward_from_logits(torch.tensor([0.0, math.log(3), -math.log(3)], dtype=torch.bfloat16))
    assert r.dtype == torch.float32
    close(r, [0.5, 0.75, 0.25], atol=5e-3)  # bf16 input: ln 3 is rounded
    close(reward_from_logits(torch.tensor([0.0, math.log(3), -math.log(3)])), [0.5, 0.75, 0.25])


# --------------------------------------------------------------------------- pairs


def test_first_positive_index():
    correct = torch.tensor([
        [False, True, False, True],
        [False, False, False, False],
        [True, True, False, False],
        [False, False, False, True],
    ])
    index, has = first_positive_index(correct)
    assert index.dtype == torch.long
    assert index.tolist() == [1, 0, 0, 3]
    assert has.tolist() == [True, False, True, True]
    # numeric rule scores: only exactly 1 counts as correct
    index, has = first_positive_index(torch.tensor([[0.5, 1.0, 1.0], [0.0, 0.9, 0.0]]))
    assert index.tolist() == [1, 0] and has.tolist() == [True, False]
    with pytest.raises(ValueError):
        first_positive_index(torch.tensor([True, False]))


def test_gather_by_group_builds_pairs():
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.1, 1.2, 1.3, 1.4], [2.1, 2.2, 2.3, 2.4]])
    index, has = first_positive_index(torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]))
    s_pos = gather_by_group(scores, index)
    close(s_pos, [0.3, 1.1, 2.1])  # row 1 has no positive: index 0, masked by `has`
    loss, stats = rm_pairwise_loss(s_pos, torch.tensor([0.0, 9.0, 3.0]), has)
    # valid margins 0.3 and -0.9: (ln(1 + e^-0.3) + ln(1 + e^0.9)) / 2 = (0.55435524 + 1.24115387) / 2
    close(loss, (0.5543552444 + 1.2411538747) / (2 + 1e-6))
    close(stats["pair_acc"], 0.5)
    with pytest.raises(ValueError):
        gather_by_group(scores, torch.tensor([0, 4, 0]))
