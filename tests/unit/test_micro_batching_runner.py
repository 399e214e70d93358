"""The four passes of a Cooper step with micro-batches by a token budget, padded or packed, against
fixed-size micro-batches: the same log-probabilities, the same GRPO gradient, the same RM scores and
the same pairwise RM gradient. fp32 sums in another order: tolerances of 1e-5 of the
largest value (measured differences are about 1e-7); a dropped, duplicated or misplaced row moves
them by orders of magnitude more.
"""

from __future__ import annotations

import pytest
import torch

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.micro_batching.runner import MicroBatching, micro_batch_plan
from cooper_mcore.parallel import ParallelConfig
from cooper_mcore.rl.policy import GRPOLoss, policy_update
from cooper_mcore.train.reward_model import RMBatch, pairwise_train_step, rm_scores, wrap_reward_model
from cooper_mcore.train.step import OptimConfig, wrap_for_training
from cooper_mcore.train.tokens import build_token_batch, compute_logprobs

MODES = {"fixed": MicroBatching(4), "budget": MicroBatching(4, max_tokens=40),
         "packed": MicroBatching(4, max_tokens=40, pack=True)}


def _ragged_batch(vocab: int = 128, n: int = 8):
    """GRPO-shaped: short prompts, responses from 1 to 22 tokens."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 6, (n,), generator=g)]
    responses = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in (1, 22, 3, 9, 2, 17, 5, 12)[:n]]
    batch = build_token_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.linspace(-1.0, 1.2, n)
    return batch


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(float(a.abs().max()), 1e-6)
    torch.testing.assert_close(b, a, atol=1e-5 * scale, rtol=1e-4, msg=what)


def test_budget_plans_fill_micro_batches_and_keep_every_row():
    lengths = [7, 26, 8, 14, 6, 22, 10, 17]
    for mode, cost in (("budget", lambda mb: len(mb) * max(lengths[r] for r in mb)),
                       ("packed", lambda mb: sum(lengths[r] for r in mb))):
        plan = micro_batch_plan(lengths, MODES[mode])
        assert sorted(r for mb in plan for r in mb) == list(range(8))
        assert all(cost(mb) <= 40 or len(mb) == 1 for mb in plan), (mode, plan)
    assert len(micro_batch_plan(lengths, MODES["packed"])) == 3  # 110 tokens in bins of 40
    assert micro_batch_plan(lengths, MODES["fixed"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="token budget"):
        MicroBatching(4, pack=True)


def test_logprobs_equal_in_every_mode(tiny_models, world):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    model, _ = load_checkpoint_model(ckpt, ParallelConfig())
    batch = _ragged_batch()
    out = {mode: compute_logprobs(model, batch, b) for mode, b in MODES.items()}
    real = torch.arange(batch.input_ids.shape[1])[None, :] < batch.lengths[:, None]
    for mode in ("budget", "packed"):
        _close(out["fixed"][real], out[mode][real], mode)


def test_policy_update_gradient_equal_in_every_mode(tiny_models, world):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    grads, losses = {}, {}
    for mode, batching in MODES.items():
        model, _ = load_checkpoint_model(ckpt, ParallelConfig())
        ddp, opt = wrap_for_training(model, OptimConfig(lr=0.0, clip_grad=0.0), per_token_loss=True)
        batch = _ragged_batch()
        logp = compute_logprobs(model, batch, MODES["fixed"])
        batch.old_logp = logp + 0.2 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
        batch.ref_logp = logp - 0.1
        m = policy_update(ddp, opt, batch, batching, GRPOLoss(kl_coef=0.1, entropy_coef=0.01))
        grads[mode] = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        losses[mode] = m.loss
    for mode in ("budget", "packed"):
        assert losses[mode] == pytest.approx(losses["fixed"], rel=1e-5)
        for name, g in grads["fixed"].items():
            _close(g, grads[mode][name], f"{mode} {name}")


def _rm_rows(vocab: int, n: int, seed: int) -> RMBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 19, 8, 14, 3, 11][:n])
    ids = torch.randint(1, vocab, (n, 20), generator=g)
    for i, k in enumerate(lengths.tolist()):
        ids[i, k:] = 0
    return RMBatch(ids, lengths)


def test_rm_scores_and_pairwise_gradient_equal_in_every_mode(tiny_models, world):
    _, ckpt = tiny_models[("qwen2", "reward")]
    model, arch = load_checkpoint_model(ckpt, ParallelConfig())
    rows = _rm_rows(arch.vocab_size, 6, seed=2)
    scores = {mode: rm_scores(model, rows.input_ids, rows.lengths, 4, b) for mode, b in MODES.items()}
    for mode in ("budget", "packed"):
        _close(scores["fixed"], scores[mode], mode)
    chosen, rejected = _rm_rows(arch.vocab_size, 6, seed=3), _rm_rows(arch.vocab_size, 6, seed=4)
    valid = torch.tensor([True, False, True, True, True, False])
    grads, metrics = {}, {}
    for mode, batching in MODES.items():
        rm, _ = load_checkpoint_model(ckpt, ParallelConfig())
        ddp, opt = wrap_reward_model(rm, OptimConfig(lr=0.0, clip_grad=0.0))
        metrics[mode] = pairwise_train_step(ddp, opt, chosen, rejected, valid, 2, anchor_weight=0.5, batching=batching)
        grads[mode] = {n: p.main_grad.detach().clone() for n, p in rm.named_parameters()}
    for mode in ("budget", "packed"):
        assert metrics[mode]["num_valid"] == 4
        assert metrics[mode]["loss"] == pytest.approx(metrics["fixed"]["loss"], rel=1e-5)
        for name, g in grads["fixed"].items():
            _close(g, grads[mode][name], f"{mode} {name}")
