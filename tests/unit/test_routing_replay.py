"""Rollout routing replay (:mod:`cooper_mcore.models.routing_replay`) and the engines' routed experts.

The multi-rank check that the trainer routes every token as recorded (EP=1, EP=2, TP=2 with sequence
parallelism, recomputation) is tests/multiproc/test_routing_replay.py; here the pieces and the point of
it all: an MoE policy's engine in bf16 and its trainer in fp32 pick different experts for some
tokens, and replaying the engine's choice brings the trainer's log-probabilities closer to the engine's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.convert.hf import hf_to_mcore
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.models.routing_replay import NO_ROUTE, RouteReplay, enable_routing_replay, replaying, route_batch
from cooper_mcore.models.tiny import save_tiny_hf_model
from cooper_mcore.parallel import ParallelConfig, single_process_world
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.train.tokens import build_token_batch, compute_logprobs


def test_route_batch_places_each_sequence_and_fills_the_rest():
    a = torch.arange(3 * 4, dtype=torch.int32).reshape(3, 4)  # 3 positions, 2 layers x top-2
    b = torch.arange(1 * 4, dtype=torch.int32).reshape(1, 4) + 50
    out = route_batch([a, b], width=5, layers=2, topk=2)
    assert out.shape == (2, 5, 2, 2) and out.dtype == torch.int16
    assert torch.equal(out[0, :3], a.reshape(3, 2, 2).short()) and (out[0, 3:] == NO_ROUTE).all()
    assert torch.equal(out[1, 0], b.reshape(2, 2).short()) and (out[1, 1:] == NO_ROUTE).all()
    with pytest.raises(ValueError, match="sequence 0's routes are \\(3, 4\\), expected \\[<= 5, 3 layers x top-2\\]"):
        route_batch([a], width=5, layers=3, topk=2)


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_replay_keeps_the_order_of_micro_batches_through_recomputation():
    """With full recomputation the first passes run without gradients and each takes the next armed
    routes; the backward's recomputations (gradients on) take the used ones again, oldest first.
    Unrecorded rows keep the router's own top-k; the probabilities are the scores at the experts used."""
    router = SimpleNamespace(config=SimpleNamespace(recompute_granularity="full"), training=True)
    replay = RouteReplay(router)
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.2], [0.4, 0.3, 0.2, 0.1]])
    first, second = torch.tensor([[2, 3], [NO_ROUTE, NO_ROUTE]]), torch.tensor([[0, 1], [3, 2]])
    replay.push(first)
    replay.push(second)
    with torch.no_grad():
        values, idx = replay.get_replay_topk(scores, 2, default_compute_topk=_topk)
        assert idx.tolist() == [[2, 3], [0, 1]] and torch.equal(values, scores.gather(1, idx))
        assert replay.get_replay_topk(scores, 2, default_compute_topk=_topk)[1].tolist() == [[0, 1], [3, 2]]
    assert replay.get_replay_topk(scores, 2, default_compute_topk=_topk)[1].tolist() == [[2, 3], [0, 1]]
    assert replay.get_replay_topk(scores, 2, default_compute_topk=_topk)[1].tolist() == [[0, 1], [3, 2]]
    assert replay.get_replay_topk(scores, 2, default_compute_topk=_topk)[1].tolist() == [[1, 2], [0, 1]]  # none left
    router.config.recompute_granularity = None
    replay.push(torch.tensor([[3, 0]]))
    with pytest.raises(ValueError, match="routes of shape \\(1, 2\\) for a router that chose \\(2, 2\\)"):
        replay.get_replay_topk(scores, 2, default_compute_topk=_topk)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> tuple[str, str]:
    """A tiny all-sparse Qwen3-MoE whose router weights are scaled down (router logits closer together,
    so that bf16 rounding moves some tokens to other experts), as an HF folder and a checkpoint."""
    root = tmp_path_factory.mktemp("replay")
    hf = save_tiny_hf_model(str(root / "hf"), "qwen3_moe", seed=5, mlp_only_layers=[])
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.1)
    model.save_pretrained(hf)
    hf_to_mcore(hf, str(root / "mcore"))
    return hf, str(root / "mcore")


def test_hf_engine_returns_what_its_routers_chose(moe_models):
    """The transformers engine's routes (prefill and each decoding step) equal its routers' top-k in one
    forward over ``prompt + completion`` (without the last token), row by row of a left-padded batch."""
    engine = HFEngine.from_pretrained(moe_models[0])
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5, seed=1, routed_experts=True))
    layers = engine.model.model.layers
    for p, o in zip(prompts, outs):
        assert o.routed_experts.shape == (len(p) + len(o.token_ids) - 1, len(layers) * 2)
        seen = {}
        hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=i, seen=seen: seen.__setitem__(i, out[2]))
                 for i, layer in enumerate(layers)]
        engine.model(torch.tensor([p + o.token_ids[:-1]]))
        for h in hooks:
            h.remove()
        routes = o.routed_experts.reshape(-1, len(layers), 2)
        for i, idx in seen.items():
            assert torch.equal(routes[:, i].sort(-1).values, idx.sort(-1).values.int()), i
    assert engine.generate(prompts, SamplingParams(max_new_tokens=2))[0].routed_experts is None


def test_replay_brings_the_trainers_logprobs_to_the_engines(moe_models):
    """A bf16 engine samples; the fp32 trainer's log-probabilities of the sampled tokens are nearer the
    engine's with the engine's routing replayed: the tokens whose experts differed move most (max), the
    rest is bf16 rounding, which replay cannot remove (mean). Measured here (2026-11-27, this model):
    mean |diff| 1.38e-3 -> 1.20e-3, max 1.24e-2 -> 5.5e-3."""
    hf, ckpt = moe_models
    engine = HFEngine.from_pretrained(hf, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (6,), generator=g).tolist() for _ in range(16)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=3, routed_experts=True))
    batch = build_token_batch(prompts, [o.token_ids for o in outs], pad_id=0)
    with single_process_world():
        model, arch = load_checkpoint_model(ckpt, ParallelConfig())
        enable_routing_replay(model)
        routes = route_batch([o.routed_experts for o in outs], batch.input_ids.shape[1], arch.num_layers,
                             arch.moe.experts_per_token)
        off = compute_logprobs(model, batch, MicroBatching(8))
        with replaying(model, routes):
            on = compute_logprobs(model, batch, MicroBatching(8))
    engine_logp = torch.zeros_like(off)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        engine_logp[i, len(p) - 1:len(p) - 1 + len(o.token_ids)] = torch.tensor(o.logprobs)
    mask = batch.loss_mask.bool()
    diff_off, diff_on = (off - engine_logp)[mask].abs(), (on - engine_logp)[mask].abs()
    assert float(diff_on.mean()) < float(diff_off.mean())
    assert float(diff_on.max()) < 0.75 * float(diff_off.max())
