"""Worker: rollout routing replay in the trainer's forwards, checked token by token against the routes.

The recorded routes are a function of each token's id and the layer (two experts that a router of
random weights would seldom pick), so every router call can be checked on its own: an embedding hook
keeps the token ids of the forward under way, a router hook the routing map it returns. Checked: the
old-log-prob pass (padded micro-batches, forward only) and a GRPO update (packed micro-batches, with
full activation recomputation: each router runs again in the backward). With a model-parallel group
of two ranks (TP=2), the routes are held on its first rank only and reach the other through
:func:`~cooper_mcore.rl.rollouts.generate_groups` and ``share_routes``, as a step's rollouts do. Each rank writes
``{checked, mismatched, recomputed, padding, pickled_routes}`` to ``<out>.<rank>`` as JSON.
"""

import argparse
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter

from cooper_mcore.checkpoint.model import load_model_checkpoint, read_meta
from cooper_mcore.micro_batching.runner import PACK_PAD_ID, MicroBatching
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.routing_replay import NO_ROUTE, enable_routing_replay, replaying, route_batch
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.rl import rollouts
from cooper_mcore.rl.policy import GRPOLoss, policy_update
from cooper_mcore.rl.rollouts import generate_groups, share_routes
from cooper_mcore.rollout.base import GenerateOutput, SamplingParams
from cooper_mcore.train.step import OptimConfig, wrap_for_training
from cooper_mcore.train.tokens import build_token_batch, compute_logprobs
from cooper_mcore.types import Prompt


def recorded(tokens: torch.Tensor, layer: int, experts: int) -> torch.Tensor:
    """The recorded experts ``[..., 2]`` of tokens in a layer: ``3 t + l`` and the next one, mod E."""
    first = (tokens * 3 + layer) % experts
    return torch.stack([first, (first + 1) % experts], dim=-1)


class Checker:
    """Hooks on the embedding and the routers; checks each router call against ``recorded``."""

    def __init__(self, model, experts: int) -> None:
        self.experts, self.ids = experts, None
        self.counts = {"checked": 0, "mismatched": 0, "recomputed": 0, "padding": 0}
        self.config = model.config
        model.embedding.register_forward_pre_hook(lambda _m, args, kwargs: self._ids(kwargs.get("input_ids", None)
                                                                                   if not args else args[0]),
                                                  with_kwargs=True)
        for m in model.modules():
            if isinstance(m, TopKRouter):
                m.register_forward_hook(lambda mod, _args, out: self._check(mod, out[1]))

    def _ids(self, ids: torch.Tensor) -> None:
        order = ids.detach().cpu().t()  # [s, b]: the routers' token order
        if self.config.sequence_parallel:
            order = order.chunk(self.config.tensor_model_parallel_size, dim=0)[
                parallel_state.get_tensor_model_parallel_rank()]
        self.ids = order.reshape(-1)

    def _check(self, router, routing_map: torch.Tensor) -> None:
        if router.training and torch.is_grad_enabled() and self.config.recompute_granularity == "full":
            self.counts["recomputed"] += 1
        chosen = routing_map.detach().cpu()
        want = torch.zeros_like(chosen).scatter(1, recorded(self.ids, router.layer_number - 1, self.experts), True)
        real = self.ids != PACK_PAD_ID
        self.counts["padding"] += int((~real).sum())
        self.counts["checked"] += int(real.sum())
        self.counts["mismatched"] += int((chosen[real] != want[real]).any(dim=1).sum())


def routes_of(ids: torch.Tensor, lengths: torch.Tensor, layers: int, experts: int) -> torch.Tensor:
    """``[N, S, layers, 2]`` recorded routes of the batch's real tokens, ``NO_ROUTE`` on padding."""
    layer = torch.arange(layers).reshape(1, 1, layers)
    routes = recorded(ids.unsqueeze(-1) + 0 * layer, layer, experts)  # [N, S, layers, 2]
    real = torch.arange(ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return torch.where(real[..., None, None], routes, torch.full_like(routes, NO_ROUTE)).to(torch.int16)


class CannedEngine:
    """Returns each prompt's recorded response and routes (the prompt's first token is its index)."""

    def __init__(self, responses: list[list[int]], routes: list[torch.Tensor]) -> None:
        self.responses, self.routes = responses, routes

    def generate(self, prompts, params):
        return [GenerateOutput(self.responses[ids[0]], "", None, "stop", self.routes[ids[0]].to(torch.int32))
                for ids in prompts]


class NoVerdicts:
    def verify_batch(self, golds, preds):
        return [SimpleNamespace(correct=None)] * len(preds)


def shared_routes(responses, routes: torch.Tensor, lengths: torch.Tensor, counts: dict) -> torch.Tensor:
    """``routes`` as the trainer gets them: the rollouts generated on the model-parallel group's leader
    (:func:`generate_groups`, a canned engine that returns each rollout's routes) and shared with the
    group, their routes by :func:`share_routes` (one tensor, not pickled), laid out by :func:`route_batch`.
    ``counts["pickled_routes"]``: samples whose pickled part held routes."""
    per_rollout = [routes[i, :n].reshape(int(n), -1) for i, n in enumerate(lengths.tolist())]
    prompts = [Prompt(str(i), "q", "a", token_ids=[i]) for i in range(len(responses))]
    leader = parallel_state.get_tensor_model_parallel_rank() == 0
    real = rollouts.broadcast_object_in_model_parallel_group

    def watched(obj):
        out = real(obj)
        counts["pickled_routes"] += sum(s.routed_experts is not None for g in out for s in g.samples)
        return out

    rollouts.broadcast_object_in_model_parallel_group = watched
    try:
        groups = generate_groups(CannedEngine(responses, per_rollout) if leader else None,
                                 NoVerdicts() if leader else None, prompts, 1, SamplingParams(), 0)
    finally:
        rollouts.broadcast_object_in_model_parallel_group = real
    share_routes(groups)
    _, _, layers, topk = routes.shape
    return route_batch([s.routed_experts for g in groups for s in g.samples], routes.shape[1], layers, topk)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    parallel = ParallelConfig(tp=args.tp, ep=args.ep, sequence_parallel=args.tp > 1)
    init_distributed(parallel)
    arch, _, dtype = read_meta(args.policy)
    model = build_model(arch, parallel, dtype=dtype, init_weights=False, recompute=True)
    load_model_checkpoint(model, args.policy, arch)
    assert enable_routing_replay(model) == sum(arch.moe_layers())
    checker = Checker(model, arch.moe.num_experts)
    g = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
    prompts = [torch.randint(1, arch.vocab_size, (int(n),), generator=g).tolist() for n in (3, 5, 4, 2)]
    responses = [torch.randint(1, arch.vocab_size, (int(n),), generator=g).tolist() for n in (6, 2, 7, 3)]
    batch = build_token_batch(prompts, responses, pad_id=PACK_PAD_ID)
    routes = routes_of(batch.input_ids, batch.lengths, arch.num_layers, arch.moe.num_experts)
    checker.counts["pickled_routes"] = 0
    if dist.get_world_size(parallel_state.get_model_parallel_group()) > 1:
        checker.counts["shared"] = True
        routes = shared_routes(responses, routes, batch.lengths, checker.counts)
    with replaying(model, routes):
        batch.old_logp = compute_logprobs(model, batch, MicroBatching(2))
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-3), per_token_loss=True)
    with replaying(model, routes):
        update = policy_update(ddp, opt, batch, MicroBatching(size=4, max_tokens=24, pack=True), GRPOLoss())
    with open(f"{args.out}.{dist.get_rank()}", "w", encoding="utf-8") as f:
        json.dump({**checker.counts, "loss": update.loss, "grad_norm": update.grad_norm}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
