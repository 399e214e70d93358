"""Non-finite losses and gradients: the update is skipped (weights, Adam moments and step count
bitwise unchanged) for the policy and the reward model; a finite step is bitwise megatron's."""

import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.pipeline_parallel import get_forward_backward_func

import cooper_mcore.rl.policy as policy
from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.jobs import sft as sft_job
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.models.forward import position_ids_for
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.train.reward_model import pairwise_train_step, wrap_reward_model
from cooper_mcore.train.step import OptimConfig, adam_step, guarded_step, train_step, wrap_for_training
from cooper_mcore.train.tokens import compute_logprobs
from tests.unit.test_policy_update import _batch


def _load(ckpt):
    return load_checkpoint_model(ckpt, ParallelConfig())


def _state(model, opt):
    """Weights and every Adam state tensor, cloned."""
    out = {f"w/{k}": v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    for inner in [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]:
        for i, p in enumerate(inner.param_groups[0]["params"]):
            out[f"main/{i}"] = p.detach().clone()
            for k, v in inner.state[p].items():
                out[f"adam/{i}/{k}"] = torch.as_tensor(v).clone()
    return out


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tokens(vocab, n=4, s=12):
    return torch.randint(1, vocab, (n, s), generator=torch.Generator().manual_seed(0))


def _forward_step(nan_grad=False):
    """A forward step whose loss is the mean squared logit (and, optionally, NaN gradients)."""

    def step(data_iterator, model):
        ids = next(data_iterator)
        logits = model(ids, position_ids_for(ids), None)
        if nan_grad:
            logits.register_hook(lambda g: torch.full_like(g, float("nan")))

        def loss_fn(out):
            loss = (out.float() ** 2).mean()
            return loss, {"loss": loss.detach()}

        return logits, loss_fn

    return step


def _fb_then(ddp, opt, ids, step_fn):
    """Forward/backward over two micro-batches, then ``step_fn(opt)``."""
    ddp.train()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=_forward_step(), data_iterator=iter(ids.split(2)), model=[ddp],
                                num_microbatches=2, seq_length=ids.shape[1], micro_batch_size=2, forward_only=False)
    return step_fn(opt)


def test_finite_guarded_step_is_bitwise_megatrons_step(tiny_models):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    with single_process_world():
        results = []
        for use_guard in (False, True):
            model, arch = _load(ckpt)
            ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-3, clip_grad=0.05))  # clipping is active
            ids = _tokens(arch.vocab_size)
            norms = []
            for _ in range(2):
                if use_guard:
                    updated, norm = _fb_then(ddp, opt, ids, guarded_step)
                    assert updated
                else:
                    _, norm, _ = _fb_then(ddp, opt, ids, lambda o: o.step())
                norms.append(norm)
            results.append((_state(model, opt), norms))
    (a, na), (b, nb) = results
    assert na == nb and all(n > 0.05 for n in na)  # the same norms, above the clip threshold
    assert _same(a, b)


def test_nan_gradient_with_finite_loss_skips_the_update(tiny_models):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    with single_process_world():
        model, arch = _load(ckpt)
        ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-3))
        ids = _tokens(arch.vocab_size)
        train_step(ddp, opt, _forward_step(), iter(ids.split(2)), 2, ids.shape[1], 2)  # a real step first
        before = _state(model, opt)
        r = train_step(ddp, opt, _forward_step(nan_grad=True), iter(ids.split(2)), 2, ids.shape[1], 2)
        after = _state(model, opt)
        assert all(math.isfinite(float(m["loss"])) for m in r.metrics) and math.isnan(r.grad_norm)
        assert not r.updated and _same(before, after) and adam_step(opt) == 1.0
        r = train_step(ddp, opt, _forward_step(), iter(ids.split(2)), 2, ids.shape[1], 2)
        assert r.updated and math.isfinite(r.grad_norm) and not _same(after, _state(model, opt))
        assert adam_step(opt) == 2.0


def test_policy_update_with_nan_loss_is_skipped(tiny_models, monkeypatch):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    real_loss = policy.policy_loss
    with single_process_world():
        model, arch = _load(ckpt)
        ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-3, clip_grad=1.0), per_token_loss=True)
        batch = _batch(arch.vocab_size)
        batch.old_logp = compute_logprobs(model, batch, MicroBatching(4))
        before = _state(model, opt)

        def nan_loss(*args, **kwargs):
            tok, stats = real_loss(*args, **kwargs)
            return tok * float("nan"), stats

        monkeypatch.setattr(policy, "policy_loss", nan_loss)
        m = policy.policy_update(ddp, opt, batch, MicroBatching(4), policy.GRPOLoss())
        assert m.nonfinite is True and math.isnan(m.grad_norm) and math.isnan(m.loss)
        assert _same(before, _state(model, opt)) and adam_step(opt) == 0.0
        monkeypatch.setattr(policy, "policy_loss", real_loss)
        m = policy.policy_update(ddp, opt, batch, MicroBatching(4), policy.GRPOLoss())
        assert m.nonfinite is False and m.grad_norm > 0 and adam_step(opt) == 1.0
        assert not _same(before, _state(model, opt))  # the check above could have failed


def test_sft_step_with_nan_loss_is_skipped(tiny_models, monkeypatch):
    """SFT goes through the same guarded step: a NaN loss leaves weights and Adam untouched."""
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    with single_process_world():
        model, arch = _load(ckpt)
        ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-3), per_token_loss=True)
        examples = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]
        before = _state(model, opt)
        real = sft_job.token_logprobs
        monkeypatch.setattr(sft_job, "token_logprobs", lambda *a: real(*a) * float("nan"))
        loss_sum, tokens, norm = sft_job._sft_step(ddp, opt, examples, 0, 1)
        assert math.isnan(loss_sum) and math.isnan(norm) and tokens == 5
        assert _same(before, _state(model, opt)) and adam_step(opt) == 0.0
        monkeypatch.setattr(sft_job, "token_logprobs", real)
        _, _, norm = sft_job._sft_step(ddp, opt, examples, 0, 1)
        assert math.isfinite(norm) and adam_step(opt) == 1.0 and not _same(before, _state(model, opt))


def test_pairwise_rm_step_with_nan_loss_is_skipped(tiny_models, monkeypatch):
    _, ckpt = tiny_models[("qwen2", "reward")]
    with single_process_world():
        model, arch = _load(ckpt)
        ddp, opt = wrap_reward_model(model, OptimConfig(lr=1e-3))
        ids = _tokens(arch.vocab_size, n=6, s=10)
        chosen, rejected = (ids[:3], torch.tensor([10, 7, 5])), (ids[3:], torch.tensor([9, 10, 4]))
        valid = torch.ones(3, dtype=torch.bool)
        before = _state(model, opt)
        real = F.logsigmoid
        monkeypatch.setattr(F, "logsigmoid", lambda x: real(x) * float("nan"))
        m = pairwise_train_step(ddp, opt, chosen, rejected, valid, 2)
        assert m["nonfinite"] is True and m["skipped"] is False and math.isnan(m["grad_norm"])
        assert _same(before, _state(model, opt)) and adam_step(opt) == 0.0
        monkeypatch.setattr(F, "logsigmoid", real)
        m = pairwise_train_step(ddp, opt, chosen, rejected, valid, 2)
        assert m["nonfinite"] is False and adam_step(opt) == 1.0 and not _same(before, _state(model, opt))


@pytest.mark.parametrize("loss_finite", [True, False])
def test_guarded_step_without_gradients_norm_zero(tiny_models, loss_finite):
    """A zero gradient is finite (updates, with weight decay); a non-finite loss alone blocks it."""
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    with single_process_world():
        model, _ = _load(ckpt)
        ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-3, weight_decay=0.1))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        updated, norm = guarded_step(opt, loss_finite=loss_finite)
    assert updated is loss_finite
    assert (norm == 0.0) if loss_finite else math.isnan(norm)
