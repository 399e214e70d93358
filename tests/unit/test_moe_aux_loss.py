"""The routers' load-balancing (aux) loss of a mixture-of-experts training step: its value against a
hand computation, its gradient weight under the per-token loss mode, and the tracker per model.

All on CPU in fp32 at world size 1, on the tiny Qwen3-MoE (4 layers, 8 experts, top 2, the last layer
dense). The aux gradient is isolated by a main loss of ``0 * logits``: the router of the last sparse
layer (layer 2) then gets gradient only from its own aux term (layer 3 is dense), which is recomputed
here with autograd from the router's captured input.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, switch_load_balancing_loss_func
from megatron.core.transformer.moe.router import Router

from cooper_mcore.algo import aux_loss_coeff_scale, load_balancing_loss
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.forward import position_ids_for
from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.train import moe_aux
from cooper_mcore.train.moe_aux import AuxLossCounts, set_aux_loss_coef
from cooper_mcore.train.step import OptimConfig, train_step, wrap_for_training

# fp32 sums of a few hundred terms in another order: a few ulps
TOL = dict(rtol=1e-5, atol=1e-9)
COEF = 0.01
LAST_SPARSE = 2


def test_load_balancing_loss_by_hand():
    """3 tokens, 4 experts, top 2: f = routed share, P = mean probability, loss = coef * E * sum f P."""
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1], [0.25, 0.25, 0.4, 0.1]])
    routing = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0]], dtype=torch.bool)
    f = [2 / 6, 2 / 6, 2 / 6, 0.0]
    p = [0.75 / 3, 1.05 / 3, 0.9 / 3, 0.3 / 3]
    by_hand = 0.1 * 4 * sum(a * b for a, b in zip(f, p))
    assert float(load_balancing_loss(scores, routing, 2, 0.1)) == pytest.approx(by_hand, rel=1e-6)
    megatron = switch_load_balancing_loss_func(scores, routing.sum(0), 3, 2, 4, 0.1)
    assert float(megatron) == pytest.approx(by_hand, rel=1e-6)


def test_coeff_scale():
    assert aux_loss_coeff_scale(30, 120) == 0.25
    with pytest.raises(ValueError, match="routed_tokens"):
        aux_loss_coeff_scale(1, 0)


@pytest.fixture(scope="module")
def moe_world():
    with single_process_world():
        yield ArchSpec.from_hf_config(tiny_hf_config("qwen3_moe", router_aux_loss_coef=COEF).to_dict())


def _router_step(arch: ArchSpec, ids: torch.Tensor, micro: int, loss_units: float):
    """One zero-main-loss step in ``ids.shape[0] / micro`` micro-batches; returns the step, the last
    sparse router's aux gradient and the inputs that router saw (one per micro-batch)."""
    torch.manual_seed(0)
    model = build_model(arch, ParallelConfig(), use_te=False)
    ddp, opt = wrap_for_training(model, OptimConfig(lr=0.0, clip_grad=0.0), per_token_loss=True)
    router = model.decoder.layers[LAST_SPARSE].mlp.router
    seen = []
    hook = router.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    parts = ids.split(micro)

    def forward_step(data_iterator, m):
        mb = next(data_iterator)
        logits = m(mb, position_ids_for(mb), None)
        return logits, lambda out: ((0 * out.float()).sum(), torch.tensor(int(loss_units // len(parts))), {})

    counts = AuxLossCounts.of_shapes(loss_units, [tuple(p.shape) for p in parts])
    result = train_step(ddp, opt, forward_step, iter(parts), len(parts), ids.shape[1], micro, aux_counts=counts)
    hook.remove()
    return result, router.weight.main_grad.clone(), router.weight.detach().clone(), seen


def _hand_aux(weight: torch.Tensor, inputs: list[torch.Tensor], topk: int) -> list[torch.Tensor]:
    """Each micro-batch's aux loss of one router, recomputed from its input (autograd through ``weight``)."""
    out = []
    for x in inputs:
        scores = torch.softmax(x.reshape(-1, x.shape[-1]).float() @ weight.float().t(), dim=-1)
        top = torch.topk(scores, topk, dim=-1).indices
        routing = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        out.append(load_balancing_loss(scores, routing, topk, COEF))
    return out


def test_aux_gradient_is_the_mean_aux_loss_whatever_the_loss_counts(moe_world):
    """The aux gradient equals d(mean over micro-batches of aux)/dW for any loss count, in one
    micro-batch or two. Before the fix it was that divided by the routed tokens (the routers kept
    the per-token flag of build time, False); megatron's per-token path alone would weigh it by
    routed tokens / loss count."""
    arch = moe_world
    ids = torch.randint(1, arch.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    grads = []
    for micro, units in ((4, 7.0), (4, 300.0), (2, 30.0)):
        result, grad, weight, seen = _router_step(arch, ids, micro, units)
        w = weight.clone().requires_grad_(True)
        hand = _hand_aux(w, seen, arch.moe.experts_per_token)
        torch.stack(hand).mean().backward()
        assert float(grad.abs().max()) > 0
        torch.testing.assert_close(grad, w.grad, rtol=1e-4, atol=1e-6 * float(w.grad.abs().max()))
        grads.append(grad)
    # the scale T/N then megatron's 1/T: equal up to two roundings
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6 * float(grads[0].abs().max()))


def test_reported_aux_loss_equals_hand_computation(moe_world, monkeypatch):
    """``moe_aux_loss`` = coef * sum over the sparse layers of E sum f P, mean over micro-batches: the
    last sparse layer's part by hand from its router's input, the sum against the per-layer tracker
    (kept by wrapping the scope's clear, which empties the tracker on exit)."""
    arch = moe_world
    ids = torch.randint(1, arch.vocab_size, (4, 12), generator=torch.Generator().manual_seed(2))
    kept = {}

    def keep_then_clear():
        entry = get_moe_layer_wise_logging_tracker().get(moe_aux.LOAD_BALANCING)
        if entry is not None:
            kept["values"] = entry["values"].clone()
        get_moe_layer_wise_logging_tracker().clear()

    monkeypatch.setattr(moe_aux, "clear_tracker", keep_then_clear)
    result, _, weight, seen = _router_step(arch, ids, 2, 10.0)
    per_layer = [COEF * float(v) / 2 for v in kept["values"]]
    hand_last = torch.stack(_hand_aux(weight, seen, arch.moe.experts_per_token)).mean()
    assert result.moe_aux_loss is not None and result.moe_aux_loss > 0
    assert per_layer[LAST_SPARSE] == pytest.approx(float(hand_last), rel=1e-5)
    assert sum(per_layer) == pytest.approx(result.moe_aux_loss, rel=1e-6)
    assert per_layer[-1] == 0.0  # the dense last layer has no router
    assert not get_moe_layer_wise_logging_tracker()  # cleared after the step: the next model starts empty


def test_config_coefficient_reaches_the_routers(moe_world):
    """``model.moe_aux_loss_coef`` (``set_aux_loss_coef``) is the weight every router reads (the
    step's scope scales and restores it from there); refused for a dense model and below 0."""
    arch = moe_world
    model = build_model(arch, ParallelConfig(), use_te=False)
    set_aux_loss_coef(model, 3 * COEF)
    assert all(r.get_aux_loss_coeff("aux_loss") == 3 * COEF for r in _routers(model))
    with pytest.raises(ValueError, match="must be >= 0"):
        set_aux_loss_coef(model, -1.0)
    dense = build_model(ArchSpec.from_hf_config(tiny_hf_config("qwen3").to_dict()), ParallelConfig(), use_te=False)
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        set_aux_loss_coef(dense, 0.1)


def _routers(model: torch.nn.Module) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def test_a_per_token_moe_step_without_counts_is_refused(moe_world):
    """Without the step's counts the aux weight would be megatron's routed tokens / loss count: refused,
    and the coefficient and the tracker are left as they were."""
    model = build_model(moe_world, ParallelConfig(), use_te=False)
    ddp, opt = wrap_for_training(model, OptimConfig(lr=0.0), per_token_loss=True)
    ids = torch.randint(1, moe_world.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="aux_counts"):
        train_step(ddp, opt, lambda it, m: None, iter([ids]), 1, 8, 2)
    assert model.config.moe_aux_loss_coeff == COEF and not get_moe_layer_wise_logging_tracker()


def _policy_aux(arch: ArchSpec, batching, monkeypatch=None) -> tuple[float, dict[str, torch.Tensor]]:
    """One GRPO update (lr 0) of a fresh tiny MoE policy on fixed sequences in ``batching``'s micro-batches:
    the reported aux loss and every router's gradient."""
    from cooper_mcore.micro_batching.runner import MicroBatching  # noqa: F401  (the caller's batching)
    from cooper_mcore.rl.policy import GRPOLoss, policy_update
    from cooper_mcore.train.tokens import build_token_batch

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, arch.vocab_size, (n,), generator=g).tolist() for n in (3, 6, 4, 5)]
    responses = [torch.randint(1, arch.vocab_size, (n,), generator=g).tolist() for n in (8, 2, 5, 6)]
    batch = build_token_batch(prompts, responses, pad_id=0, pad_to_multiple=32)  # 11..4 tokens in 32 columns
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    batch.old_logp = -torch.rand(batch.input_ids.shape, generator=g)
    torch.manual_seed(0)
    model = build_model(arch, ParallelConfig(), use_te=False)
    ddp, opt = wrap_for_training(model, OptimConfig(lr=0.0, clip_grad=0.0), per_token_loss=True)
    update = policy_update(ddp, opt, batch, batching, GRPOLoss())
    grads = {n: m.weight.main_grad.clone() for n, m in model.named_modules() if isinstance(m, Router)}
    return update.moe_aux_loss, grads


def test_padding_is_left_out_of_the_load_balancing(moe_world, monkeypatch):
    """The same four sequences packed into one row (no padding) and as right-padded rows of 32 columns
    (61% padding): the same aux loss and router gradients. Counted, the padding tokens (all one token id,
    routed alike) would skew the experts' shares f and mean probabilities P."""
    from cooper_mcore.micro_batching import runner
    from cooper_mcore.micro_batching.runner import MicroBatching

    arch = moe_world
    packed, packed_grads = _policy_aux(arch, MicroBatching(size=4, max_tokens=4096, pack=True))
    padded, padded_grads = _policy_aux(arch, MicroBatching(size=4))
    assert packed > 0 and padded == pytest.approx(packed, rel=1e-5)
    for name, grad in packed_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()))
    monkeypatch.setattr(runner, "moe_padding_kwargs", lambda model, valid: {})  # the padding counted
    counted, _ = _policy_aux(arch, MicroBatching(size=4))
    assert abs(counted - packed) > 1e-3 * packed
