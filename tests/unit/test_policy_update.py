"""The GRPO update through Megatron: micro-batch invariance, first-step invariants, and the
loss against a hand computation from plain log-probabilities."""

import pytest
import torch

from cooper_mcore.algo import kl_penalty
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.train.megatron_setup import OptimConfig, wrap_for_training
from cooper_mcore.train.policy import build_token_batch, compute_logprobs, policy_update


def _batch(vocab):
    g = torch.Generator().manual_seed(3)

    def draw(lo, hi):
        lengths = torch.randint(lo, hi, (8,), generator=g)
        return [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lengths]

    prompts, responses = draw(2, 6), draw(1, 7)
    batch = build_token_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.linspace(-1.5, 1.5, 8)
    return batch


def _step(ckpt, mbs, lr=1e-3, kl=0.0):
    from cooper_mcore.convert.compare import load_checkpoint_model

    model, arch = load_checkpoint_model(ckpt, ParallelConfig())
    ddp, opt = wrap_for_training(model, OptimConfig(lr=lr, clip_grad=0.0), per_token_loss=True)
    batch = _batch(arch.vocab_size)
    batch.old_logp = compute_logprobs(model, batch, mbs)
    batch.ref_logp = batch.old_logp.clone() - 0.01 * batch.loss_mask  # a reference slightly off
    metrics = policy_update(ddp, opt, batch, mbs, 0.2, 0.2, kl, "low_var_kl")
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "extra" not in k}, metrics, batch


def test_micro_batches_1x8_equal_8x1(tiny_models):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    with single_process_world():
        a, ma, _ = _step(ckpt, mbs=8, kl=1e-3)
        b, mb, _ = _step(ckpt, mbs=1, kl=1e-3)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    assert abs(ma["loss"] - mb["loss"]) < 1e-6 and abs(ma["grad_norm"] - mb["grad_norm"]) < 1e-5
    assert ma["ratio/mean"] == 1.0 and ma["clip_frac"] == 0.0  # old == current at the first update


def test_loss_is_token_mean_of_the_grpo_objective(tiny_models):
    _, ckpt = tiny_models[("llama", "causal_lm")]
    with single_process_world():
        _, m, batch = _step(ckpt, mbs=4, kl=0.5)
    mask = batch.loss_mask
    adv = batch.advantages[:, None].expand_as(mask)
    # at ratio 1 the clipped surrogate is -A per token; the KL term is k3 of (old - 0.01) vs old
    kl = kl_penalty(batch.old_logp, batch.ref_logp, "low_var_kl")
    expected = ((-adv + 0.5 * kl) * mask).sum() / mask.sum()
    assert m["loss"] == pytest.approx(float(expected), abs=1e-6)
    assert m["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), abs=1e-7) and m["kl"] > 0
