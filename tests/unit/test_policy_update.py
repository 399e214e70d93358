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
from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.models.hf_mapping import canonical_mcore_name, param_mappings, to_hf
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.rl.policy import GRPOLoss, policy_update
from cooper_mcore.rl.results import GRPOUpdate
from cooper_mcore.train.step import OptimConfig, wrap_for_training
from cooper_mcore.train.tokens import TokenBatch, build_token_batch, compute_logprobs


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
    """One policy_update; returns (model, its GRPOUpdate, {hf name: gradient})."""
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


def _reference_grads(hf_dir: str, batch: TokenBatch, loss: GRPOLoss) -> tuple[dict[str, torch.Tensor], float, float]:
    """The GRPO step written out in plain torch on transformers' model of the same weights:
    per-token PPO clip, verl's dual clip (a negative-advantage token's loss capped at
    ``-A * clip_ratio_c``) when ``clip_ratio_c`` is set, the surrogate weighted by
    ``min(exp(old - engine), tis_cap)`` when ``tis_cap`` is set (truncated importance sampling), k3
    KL to the reference, entropy bonus, token mean over the whole batch. Returns the gradients, the
    loss, and the fraction of response tokens whose surrogate gives no gradient (what ``clip_frac``
    counts)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    logits = model(batch.input_ids).logits.float()
    logp_all = torch.log_softmax(logits, dim=-1)
    labels = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, -1:]], dim=1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    adv = batch.advantages[:, None]
    ratio = torch.exp(logp - batch.old_logp)
    surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - loss.clip_low, 1 + loss.clip_high))
    if loss.clip_ratio_c is not None:  # verl: where(A < 0, min(-A * c, clipped surrogate), clipped surrogate)
        surrogate = torch.where(adv < 0, torch.minimum(-adv * loss.clip_ratio_c, surrogate), surrogate)
    if loss.tis_cap is not None:  # verl / slime: pg_loss * clamp(exp(old - rollout), max=C)
        surrogate = surrogate * torch.exp(batch.old_logp - batch.engine_logp).clamp(max=loss.tis_cap)
    d = batch.ref_logp - logp
    k3 = torch.exp(d) - d - 1
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    per_token = surrogate + loss.kl_coef * k3 - loss.entropy_coef * entropy
    mask = batch.loss_mask
    total = (per_token * mask).sum() / mask.sum()
    (d_surrogate,) = torch.autograd.grad((surrogate * mask).sum(), logp, retain_graph=True)
    no_gradient = float(((d_surrogate == 0) & mask.bool()).sum() / mask.sum())
    total.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, float(total), no_gradient


def _with_logprobs(ckpt: str, batch: TokenBatch, noise: float) -> TokenBatch:
    """Old log-probabilities of the current weights, shifted by seeded noise so that ratios move
    off 1 on both sides of the clip range; a reference shifted the other way."""
    model, _ = load_checkpoint_model(ckpt, ParallelConfig())
    logp = compute_logprobs(model, batch, MicroBatching(len(batch)))
    g = torch.Generator().manual_seed(11)
    batch.old_logp = logp + noise * torch.randn(logp.shape, generator=g)
    batch.ref_logp = logp - 0.3 * torch.rand(logp.shape, generator=g)
    return batch


@pytest.mark.parametrize("family,chunk", [("qwen2", 1024), ("qwen2_tied", 1024), ("qwen2", 5)])
def test_update_gradient_equals_a_plain_torch_grpo_step(tiny_models, family, chunk):
    """The update's gradient, with the log-probabilities and the entropy bonus read from the logits
    in one chunk and in chunks of 5 positions (the micro-batches of 2 rows span chunk boundaries)."""
    hf_dir, ckpt = tiny_models[(family, "causal_lm")]
    loss = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_kind="low_var_kl", entropy_coef=0.01,
                    chunk_tokens=chunk)
    with single_process_world():
        batch = _with_logprobs(ckpt, _batch(vocab=128), noise=0.3)
        _, metrics, ours = _megatron_update(ckpt, batch, mbs=2, loss=loss)
    ref, ref_loss, ref_clip_frac = _reference_grads(hf_dir, batch, loss)
    assert metrics.clip_frac > 0.05  # the clip is active on this batch
    assert metrics.clip_frac == pytest.approx(ref_clip_frac, abs=1e-6)
    assert metrics.loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    scale = max(float(g.abs().max()) for g in ref.values())
    for name, g in ref.items():
        if family == "qwen2_tied" and name == "lm_head.weight":
            continue  # the same tensor as the embedding
        torch.testing.assert_close(ours[name], g, atol=1e-5 * scale, rtol=1e-4, msg=name)


def _with_stale_tokens(ckpt: str, batch: TokenBatch) -> tuple[TokenBatch, torch.Tensor]:
    """Old log-probabilities 1.5 below the current weights' on every other position (ratio e^1.5 = 4.48,
    above the dual clip's 3: tokens of a policy several mini-batches stale) and within seeded noise of
    them elsewhere. Returns the batch and where it is stale."""
    model, _ = load_checkpoint_model(ckpt, ParallelConfig())
    logp = compute_logprobs(model, batch, MicroBatching(len(batch)))
    stale = (torch.arange(logp.shape[1]) % 2 == 0).expand_as(logp)
    noise = 0.1 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    batch.old_logp = torch.where(stale, logp - 1.5, logp + noise)
    batch.ref_logp = logp.clone()
    return batch, stale


def test_update_gradient_applies_the_dual_clip(tiny_models):
    """With ``clip_ratio_c`` = 3 a negative-advantage token whose ratio is above 3 gives a constant loss
    (``-3A``) and no gradient, as in verl and the reference implementation: the trainer's gradient
    equals a plain-torch step with the dual clip and is far from one without it."""
    hf_dir, ckpt = tiny_models[("qwen2", "causal_lm")]
    loss = GRPOLoss(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0)
    assert GRPOLoss().clip_ratio_c == 3.0
    with single_process_world():
        batch, stale = _with_stale_tokens(ckpt, _batch(vocab=128))
        _, metrics, ours = _megatron_update(ckpt, batch, mbs=2, loss=loss)
    mask = batch.loss_mask.bool()
    negative = (batch.advantages < 0)[:, None].expand_as(mask)
    capped = mask & negative & stale
    assert int(capped.sum()) >= 5  # the batch has dual-clipped tokens
    ref, ref_loss, ref_clip_frac = _reference_grads(hf_dir, batch, loss)
    no_dual, no_dual_loss, no_dual_clip_frac = _reference_grads(hf_dir, batch, GRPOLoss(0.2, 0.28, clip_ratio_c=None))
    assert metrics.loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert no_dual_loss > ref_loss + 0.1  # the uncapped losses of stale negative tokens (|A| * 4.48 > |A| * 3)
    # clip_frac counts the tokens either clip leaves without a gradient, the dual-clipped ones included
    assert metrics.clip_frac == pytest.approx(ref_clip_frac, abs=1e-6)
    assert ref_clip_frac >= no_dual_clip_frac + float(capped.sum() / mask.sum()) - 1e-6
    scale = max(float(g.abs().max()) for g in ref.values())
    for name, g in ref.items():
        torch.testing.assert_close(ours[name], g, atol=1e-5 * scale, rtol=1e-4, msg=name)
    apart = max(float((ours[n] - g).abs().max()) for n, g in no_dual.items())
    assert apart > 0.1 * scale, apart


def test_update_gradient_applies_truncated_importance_sampling(tiny_models):
    """With ``tis_cap`` each token's surrogate is weighted by ``min(exp(old - engine), cap)``: the
    trainer's gradient equals a plain-torch step with those weights (some tokens capped, some below
    1) and is far from the unweighted one; the KL and entropy terms are not weighted."""
    hf_dir, ckpt = tiny_models[("qwen2", "causal_lm")]
    loss = GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, chunk_tokens=7)
    with single_process_world():
        batch = _with_logprobs(ckpt, _batch(vocab=128), noise=0.3)
        g = torch.Generator().manual_seed(7)
        batch.engine_logp = batch.old_logp - 1.2 * torch.randn(batch.old_logp.shape, generator=g)
        _, metrics, ours = _megatron_update(ckpt, batch, mbs=2, loss=loss)
        with pytest.raises(ValueError, match="algo.tis_cap needs the rollout engine"):
            policy_update(None, None, TokenBatch(batch.input_ids, batch.loss_mask, batch.advantages, batch.old_logp,
                                                 batch.ref_logp), MicroBatching(2), loss)
    weights = torch.exp(batch.old_logp - batch.engine_logp)[batch.loss_mask.bool()]
    assert (weights > 2.0).sum() >= 5 and (weights < 0.5).sum() >= 5  # capped tokens and down-weighted ones
    ref, ref_loss, ref_clip_frac = _reference_grads(hf_dir, batch, loss)
    plain, _, _ = _reference_grads(hf_dir, batch, GRPOLoss(0.2, 0.28, kl_coef=0.1, entropy_coef=0.01))
    assert metrics.loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert metrics.clip_frac == pytest.approx(ref_clip_frac, abs=1e-6)
    scale = max(float(g.abs().max()) for g in ref.values())
    for name, g in ref.items():
        torch.testing.assert_close(ours[name], g, atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert max(float((ours[n] - g).abs().max()) for n, g in plain.items()) > 0.1 * scale


def test_update_policy_takes_the_dual_clip_from_the_config(monkeypatch):
    """``rl/step.py`` builds the update's loss from ``algo``: ``clip_ratio_c`` (default 3.0; null: off)
    reaches :class:`GRPOLoss` with the other settings."""
    from types import SimpleNamespace

    from cooper_mcore.config.schema import load_config
    from cooper_mcore.rl import step

    class Batch:
        def __len__(self):
            return 4

        def slice(self, start, end):
            return self

    seen = []

    def update(ddp, optimizer, batch, batching, loss):
        seen.append(loss)
        return GRPOUpdate(loss=0.0, kl=0.0, ratio_mean=1.0, clip_frac=0.0, entropy=0.0, grad_norm=0.0, nonfinite=False)

    monkeypatch.setattr(step, "policy_update", update)
    optimizer = SimpleNamespace(param_groups=[{"lr": 1e-6}])
    for overrides, expected in (([], 3.0), (["algo.clip_ratio_c=4.5"], 4.5), (["algo.clip_ratio_c=null"], None)):
        cfg = load_config(None, ["algo.clip_high=0.28", *overrides])
        run = SimpleNamespace(cfg=cfg, batching=None, policy=SimpleNamespace(
            ddp=None, optimizer=optimizer, scheduler=SimpleNamespace(step=lambda n: None)))
        step.update_policy(run, Batch())
        assert seen[-1] == GRPOLoss(clip_low=0.2, clip_high=0.28, kl_coef=1e-3, kl_kind="low_var_kl",
                                    entropy_coef=0.0, clip_ratio_c=expected)


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
    assert ma.loss == pytest.approx(mb.loss, abs=1e-6)
    assert ma.grad_norm == pytest.approx(mb.grad_norm, rel=1e-5)
    assert ma.ratio_mean == pytest.approx(1.0, abs=1e-6) and ma.clip_frac == 0.0  # old == current


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
    assert m.loss == pytest.approx(float(expected), abs=1e-6)
    assert m.kl == pytest.approx(float((kl * mask).sum() / mask.sum()), abs=1e-7) and m.kl > 0


def test_token_logprobs_leave_fp32_logits_intact():
    """The log-probabilities and the entropy are read from fp32 logits (CPU runs) without writing
    them: what the loss reads after them is what the model returned."""
    from cooper_mcore.algo import entropy_from_logits
    from cooper_mcore.train.tokens import token_logprobs, token_logprobs_and_entropy

    with single_process_world():
        logits = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
        before = logits.clone()
        labels = torch.zeros(2, 5, dtype=torch.long)
        logp = token_logprobs(logits, labels)
        torch.testing.assert_close(logits, before, rtol=0, atol=0)
        torch.testing.assert_close(logp, torch.log_softmax(before, -1)[..., 0], rtol=1e-5, atol=1e-6)
        _, ent = token_logprobs_and_entropy(logits, labels, "metric", chunk_tokens=3)
        torch.testing.assert_close(logits, before, rtol=0, atol=0)
        torch.testing.assert_close(ent, entropy_from_logits(before), rtol=1e-5, atol=1e-5)
