"""Training checkpoints with an optimizer that keeps its state the way Transformer Engine's FusedAdam does.

With TE installed (the Dockerfile pins it) megatron-core's Adam is TE's ``FusedAdam``: it keeps
``step`` in each param group, creates ``exp_avg``/``exp_avg_sq`` itself, and its ``state_dict()``
looks every per-parameter state name up in a fixed table (``exp_avg``, ``exp_avg_sq``,
``master_param``), so a per-parameter ``step`` entry raises ``KeyError: 'step'``. TE does not install
on CPU machines; :class:`GroupStepAdam` models those properties, and megatron-core is switched to its
TE code paths (``USING_TE_OPTIMIZER``) for the test. Before the fix, the trainer put a
per-parameter ``step`` into every state (and read the step count from there, so it reported 0).
"""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core import optimizer as mcore_optimizer
from megatron.core.optimizer import distrib_optimizer

from cooper_mcore.checkpoint.model import load_checkpoint_model, read_meta
from cooper_mcore.checkpoint.training import load_training_checkpoint, save_training_checkpoint
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.train.offload import ModelOffloader
from cooper_mcore.train.step import OptimConfig, adam_step, build_scheduler, inner_optimizers, wrap_for_training
from tests.unit.test_nonfinite import _forward_step, _tokens

STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


class GroupStepAdam(torch.optim.Optimizer):
    """Adam(W) with FusedAdam's bookkeeping: ``group["step"]``, lazily created moments, and a
    ``state_dict`` that accepts only FusedAdam's state names."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True,
                 bias_correction=True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            t, (b1, b2) = group["step"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if self.adam_w_mode:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))

    def state_dict(self):
        sd = super().state_dict()
        for v in sd["state"].values():
            for name in v:
                if name not in STATE_NAMES:
                    raise KeyError(name)  # TE: self.name_to_dtype_map[name]
        return sd


@pytest.fixture
def te_world(monkeypatch):
    """megatron-core building and checkpointing its optimizer as with Transformer Engine installed."""
    monkeypatch.setattr(mcore_optimizer, "Adam", GroupStepAdam)
    monkeypatch.setattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(distrib_optimizer, "Adam", GroupStepAdam)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    with single_process_world():
        yield


def _model(ckpt: str) -> ModelState:
    module, arch = load_checkpoint_model(ckpt, ParallelConfig())
    ddp, opt = wrap_for_training(module, OptimConfig(lr=1e-2))
    _, hf_config, dtype = read_meta(ckpt)
    return ModelState("policy", module, arch, hf_config, dtype, ckpt, tokenizer=None,
                      offloader=ModelOffloader(ddp, opt), ddp=ddp, optimizer=opt,
                      scheduler=build_scheduler(opt, 1e-2, 0, 10, 0.01))


def _train_step(m: ModelState) -> None:
    from cooper_mcore.train.step import train_step

    ids = _tokens(m.arch.vocab_size)
    result = train_step(m.ddp, m.optimizer, _forward_step(), iter(ids.split(2)), 2, ids.shape[1], 2)
    assert result.updated and math.isfinite(result.grad_norm)


def test_te_style_adam_trains_checkpoints_and_resumes(te_world, tiny_models, tmp_path):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    m = _model(ckpt)
    inner = inner_optimizers(m.optimizer)
    assert all(isinstance(o, GroupStepAdam) for o in inner)
    assert all("step" not in st for o in inner for st in o.state.values())  # FusedAdam's layout kept
    save_training_checkpoint(str(tmp_path), 0, [m], {"note": "before any update"})  # a fresh RM's case
    _train_step(m)
    assert adam_step(m.optimizer) == 1.0  # read from the param groups
    path = save_training_checkpoint(str(tmp_path), 1, [m], {})
    fresh = _model(ckpt)
    state = load_training_checkpoint(path, [fresh])
    assert state["adam_steps"]["policy"] == 1.0 and adam_step(fresh.optimizer) == 1.0
    for a, b in zip(inner, inner_optimizers(fresh.optimizer)):
        for pa, pb in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
            assert torch.equal(pa, pb)
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(a.state[pa][name], b.state[pb][name])
    _train_step(fresh)  # and it keeps training
    assert adam_step(fresh.optimizer) == 2.0
