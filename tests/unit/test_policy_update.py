"""The GRPO update the trainer back-propagates, through Megatron: its gradient against an independent
plain-torch GRPO step on the same weights (transformers' model), micro-batch invariance, first-step
invariants, and the reported loss against a hand computation.

Gradients, not post-Adam weights, are compared: Adam divides by the root of the second moment, so
fp32 reduction-order noise in near-zero gradients (which differs between CPU vector ISAs) becomes
weight differences of the order of the learning rate. A gradient is a sum of per-token terms; two
fp32 evaluations of it in different orders differ by a few ulps of the largest partial sums, so they
are compared at ``atol = 1e-5 * max|g|`` and ``rtol = 1e-4``; a real bug (a per-sequence instead of a
token mean, a missing clip or KL term) changes them by tens of percent.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from cooper_mcore.algo import kl_penalty
from cooper_mcore.convert.compare import load_checkpoint_model
from cooper_mcore.convert.mapping import canonical_mcore_name, param_mappings, to_hf
from cooper_mcore.mcore.micro_batches import MicroBatching
from cooper_mcore.mcore.tokens import TokenBatch, build_token_batch, compute_logprobs
from cooper_mcore.mcore.training import OptimConfig, wrap_for_training
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.rl.policy import GRPOLoss, policy_update


def _batch(vocab: int, n: int = 8, seed: int = 3) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        lengths = torch.randint(lo, hi, (n,), generator=g)
        return [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in lengths]

    prompts, responses = draw(2, 6), draw(1, 9)
    batch = build_token_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.linspace(-1.5, 1.5, n)
    return batch


def _megatron_update(ckpt: str, batch: TokenBatch, mbs: int, loss: GRPOLoss, lr: float = 1e-3):
    """One policy_update; returns (model, metrics, {hf name: gradient})."""
    model, arch = load_checkpoint_model(ckpt, ParallelConfig())
    ddp, opt = wrap_for_training(model, OptimConfig(lr=lr, clip_grad=0.0), per_token_loss=True)
    metrics = policy_update(ddp, opt, batch, MicroBatching(mbs), loss)
    grads = {canonical_mcore_name(n): p.main_grad.detach().clone() for n, p in model.named_parameters()}
    by_name = {m.mcore: m for m in param_mappings(arch)}
    hf = {}
    for name, g in grads.items():
        if name in by_name:
            hf.update(zip(by_name[name].hf, (t.clone() for t in to_hf(by_name[name], g, arch))))
    return model, metrics, hf


def _reference_grads(hf_dir: str, batch: TokenBatch, loss: GRPOLoss) -> tuple[dict[str, torch.Tensor], float]:
    """The GRPO step written out in plain torch on transformers' model of the same weights:
    per-token PPO clip, k3 KL to the reference, entropy bonus, token mean over the whole batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    logits = model(batch.input_ids).logits.float()
    logp_all = torch.log_softmax(logits, dim=-1)
    labels = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, -1:]], dim=1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    adv = batch.advantages[:, None]
    ratio = torch.exp(logp - batch.old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - loss.clip_low, 1 + loss.clip_high))
    d = batch.ref_logp - logp
    k3 = torch.exp(d) - d - 1
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    per_token = surrogate + loss.kl_coef * k3 - loss.entropy_coef * entropy
    mask = batch.loss_mask
    total = (per_token * mask).sum() / mask.sum()
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, float(total)


def _with_logprobs(ckpt: str, batch: TokenBatch, noise: float) -> TokenBatch:
    """Old log-probabilities of the current weights, shifted by seeded noise so that ratios move
    off 1 on both sides of the clip range; a reference shifted the other way."""
    model, _ = load_checkpoint_model(ckpt, ParallelConfig())
    logp = compute_logprobs(model, batch, MicroBatching(len(batch)))
    g = torch.Generator().manual_seed(11)
    batch.old_logp = logp + noise * torch.randn(logp.shape, generator=g)
    batch.ref_logp = logp - 0.3 * torch.rand(logp.shape, generator=g)
    return batch


@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied"])
def test_update_gradient_equals_a_plain_torch_grpo_step(tiny_models, family):
    hf_dir, ckpt = tiny_models[(family, "causal_lm")]
    loss = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_kind="low_var_kl", entropy_coef=0.01)
    with single_process_world():
        batch = _with_logprobs(ckpt, _batch(vocab=128), noise=0.3)
        _, metrics, ours = _megatron_update(ckpt, batch, mbs=2, loss=loss)
    ref, ref_loss = _reference_grads(hf_dir, batch, loss)
    assert metrics["clip_frac"] > 0.05  # the clip is active on this batch
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    scale = max(float(g.abs().max()) for g in ref.values())
    for name, g in ref.items():
        if family == "qwen2_tied" and name == "lm_head.weight":
            continue  # the same tensor as the embedding
        torch.testing.assert_close(ours[name], g, atol=1e-5 * scale, rtol=1e-4, msg=name)


def test_micro_batches_1x8_equal_8x1(tiny_models):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    loss = GRPOLoss(kl_coef=1e-3)
    with single_process_world():
        batch = _with_logprobs(ckpt, _batch(vocab=128), noise=0.0)
        _, ma, ga = _megatron_update(ckpt, batch, mbs=8, loss=loss)
        _, mb, gb = _megatron_update(ckpt, batch, mbs=1, loss=loss)
    scale = max(float(g.abs().max()) for g in ga.values())
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=1e-5 * scale, rtol=1e-4, msg=k)
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    assert ma["ratio/mean"] == pytest.approx(1.0, abs=1e-6) and ma["clip_frac"] == 0.0  # old == current


def test_loss_is_token_mean_of_the_grpo_objective(tiny_models):
    _, ckpt = tiny_models[("llama", "causal_lm")]
    loss = GRPOLoss(kl_coef=0.5)
    with single_process_world():
        model, _ = load_checkpoint_model(ckpt, ParallelConfig())
        batch = _batch(vocab=128)
        batch.old_logp = compute_logprobs(model, batch, MicroBatching(4))
        batch.ref_logp = batch.old_logp.clone() - 0.01 * batch.loss_mask  # a reference slightly off
        _, m, _ = _megatron_update(ckpt, batch, mbs=4, loss=loss)
    mask = batch.loss_mask
    adv = batch.advantages[:, None].expand_as(mask)
    # at ratio 1 the clipped surrogate is -A per token; the KL term is k3 of (old - 0.01) vs old
    kl = kl_penalty(batch.old_logp, batch.ref_logp, "low_var_kl")
    expected = ((-adv + 0.5 * kl) * mask).sum() / mask.sum()
    assert m["loss"] == pytest.approx(float(expected), abs=1e-6)
    assert m["kl"] == pytest.approx(float((kl * mask).sum() / mask.sum()), abs=1e-7) and m["kl"] > 0


def test_token_logprobs_leave_fp32_logits_intact():
    """megatron's vocab-parallel cross entropy works in place: on fp32 logits (CPU runs) the entropy
    computed after it would read shifted, exponentiated values; on bf16 (GPUs) ``.float()`` copies.
    Both paths must leave the logits as they were."""
    from cooper_mcore.algo import entropy_from_logits
    from cooper_mcore.mcore.tokens import token_logprobs, vocab_parallel_entropy

    with single_process_world():
        logits = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
        before = logits.clone()
        logp = token_logprobs(logits, torch.zeros(2, 5, dtype=torch.long))
        torch.testing.assert_close(logits, before, rtol=0, atol=0)
        torch.testing.assert_close(logp, torch.log_softmax(before, -1)[..., 0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(vocab_parallel_entropy(logits), entropy_from_logits(before), rtol=1e-5, atol=1e-5)
