"""Rollout routing replay: the experts the rollout engine routed each token to, reused by the policy's
routers in the trainer's forwards (old log-probabilities, reference, update).

A mixture-of-experts policy's engine (bf16 kernels, another summation order) and trainer can pick
different experts for a token whose router logits nearly tie; each flip changes that token's
computation, and the log-probability ratios of the update then measure the flips rather than the
policy's change. Replaying the engine's choice in the trainer removes that source of mismatch
(Megatron-LM, NeMo-RL, slime and others do this; without it Qwen3-30B-A3B GRPO runs collapsed,
Megatron-LM#4168). The routing weights are still the trainer's: the softmax (or renormalised top-k)
of its own logits at the replayed experts, so the router keeps its gradient. The load-balancing
loss keeps the router's own top-k.

How it is wired, for the policy only (the reward model's routers are never touched):

* :func:`enable_routing_replay` gives each of the model's megatron ``TopKRouter`` a
  :class:`RouteReplay` as its ``router_replay``, the hook megatron's top-k calls
  (``topk_routing_with_score_function``); megatron's own ``RouterReplay`` keeps every instance in
  one process-wide list, which two models in a process would share, and is not used.
* :func:`replaying` holds one batch's routes ``[N, S, layers, top_k]`` (row and token positions of
  the batch the passes take, -1 where none was recorded) for the duration of its passes.
* Each micro-batch's forward (:meth:`cooper_mcore.micro_batching.runner.MicroBatch.forward`) hands
  this stage's routers their layers' routes in the micro-batch's layout (:func:`arm`), in the
  token order a router sees: ``[s, b]`` flattened, this rank's slice under sequence parallelism,
  copied to the device once per micro-batch (queued, the host does not wait) for all its layers.
* With full activation recomputation a router runs again in the backward pass, after later
  micro-batches were armed (pipelining); each :class:`RouteReplay` keeps the routes it used, in
  order, and a recomputing call (a checkpointed training forward with gradients on) takes the
  oldest: the schedules run backward passes in the order of their forwards.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

from cooper_mcore.models.forward import unwrap
from cooper_mcore.models.transfer import to_device_async

#: what marks a position without recorded routes (and fills past a sequence's end)
NO_ROUTE = -1
_ROUTES_ATTR = "_cooper_replay_routes"


class RouteReplay:
    """One router's replay (megatron's ``router_replay`` hook: :meth:`get_replay_topk`).

    Args:
        router: the router it serves (its ``training`` flag and config tell a recomputing call).
    """

    def __init__(self, router: TopKRouter) -> None:
        self._router = router
        self._pending: deque[torch.Tensor] = deque()  # armed, for the coming first passes
        self._recompute: deque[Optional[torch.Tensor]] = deque()  # used, for the backward's recomputation

    def push(self, routes: torch.Tensor) -> None:
        """Arm ``[tokens, top_k]`` expert ids (this rank's tokens, ``NO_ROUTE`` rows left to the router)."""
        self._pending.append(routes)

    def clear(self) -> None:
        self._pending.clear()
        self._recompute.clear()

    def _recomputing(self) -> bool:
        config = self._router.config
        return config.recompute_granularity == "full" and self._router.training and torch.is_grad_enabled()

    def _next(self) -> Optional[torch.Tensor]:
        if self._recomputing():
            return self._recompute.popleft() if self._recompute else None
        routes = self._pending.popleft() if self._pending else None
        if self._router.config.recompute_granularity == "full" and self._router.training:
            self._recompute.append(routes)
        return routes

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None,
                        default_compute_topk: Optional[Callable] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, indices)`` of the top-k of ``scores [tokens, experts]``: the armed experts where
        recorded (their scores gathered), the router's own elsewhere."""
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        routes = self._next()
        if routes is None:
            return values, indices
        routes = routes.to(device=scores.device, dtype=indices.dtype)
        if routes.shape != indices.shape:
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)} for a router that chose "
                             f"{tuple(indices.shape)} (tokens, top_k)")
        indices = torch.where(routes >= 0, routes, indices)
        return scores.gather(1, indices), indices


def _routers(model: torch.nn.Module) -> list[TopKRouter]:
    return [m for m in unwrap(model).modules() if isinstance(m, TopKRouter)]


def enable_routing_replay(model: torch.nn.Module) -> int:
    """Give every router of ``model`` (a mixture-of-experts policy's stage) a :class:`RouteReplay`.

    Returns:
        The number of routers on this stage (a pipeline stage may hold none).

    Raises:
        ValueError: the model has no mixture-of-experts layers.
    """
    if getattr(unwrap(model).config, "num_moe_experts", None) is None:
        raise ValueError("model.moe_routing_replay needs a mixture-of-experts policy; this one is dense")
    routers = _routers(model)
    for router in routers:
        router.router_replay = RouteReplay(router)
    return len(routers)


def _replays(model: torch.nn.Module) -> list[tuple[int, RouteReplay]]:
    """(global layer index, replay) of this stage's routers that replay."""
    return [(r.layer_number - 1, r.router_replay) for r in _routers(model) if isinstance(r.router_replay, RouteReplay)]


@contextlib.contextmanager
def replaying(model: torch.nn.Module, routes: Optional[torch.Tensor]) -> Iterator[None]:
    """Replay ``routes`` ``[N, S, layers, top_k]`` (the rows and token positions of the batch the passes
    inside take; :data:`NO_ROUTE` where none) in ``model``'s micro-batch forwards. Nothing is replayed
    with ``routes=None`` or a model without :func:`enable_routing_replay`."""
    if routes is None:
        yield
        return
    inner = unwrap(model)
    if not _replays(inner):
        yield
        return
    assert routes.dim() == 4, f"routes must be [rows, tokens, layers, top_k], got {tuple(routes.shape)}"
    setattr(inner, _ROUTES_ATTR, routes)
    try:
        yield
    finally:
        delattr(inner, _ROUTES_ATTR)
        for _, replay in _replays(inner):
            replay.clear()


def arm(model: torch.nn.Module, layout: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
    """Hand this stage's routers the routes of the micro-batch about to run, if ``model`` is replaying.

    Args:
        model: this rank's stage.
        layout: the micro-batch's layout of per-token batch values (``[N, S, ...] -> [b, s, ...]``,
            ``MicroBatch.layout``), called with the batch's routes and :data:`NO_ROUTE` as fill.
    """
    inner = unwrap(model)
    routes = getattr(inner, _ROUTES_ATTR, None)
    replays = _replays(inner)
    if routes is None or not replays:
        return
    mb = layout(routes, NO_ROUTE).transpose(0, 1)  # [s, b, layers, top_k]: the router's token order
    config = inner.config
    if config.sequence_parallel:
        mb = mb.chunk(config.tensor_model_parallel_size, dim=0)[inner.pg_collection.tp.rank()]
    # one copy to the device per micro-batch, queued without waiting, rather than one per router
    mb = to_device_async(mb.reshape(-1, *mb.shape[2:]).to(torch.int64), next(inner.parameters()).device)
    for layer, replay in replays:
        replay.push(mb[:, layer])


def route_batch(per_sequence: Sequence[torch.Tensor], width: int, layers: int, topk: int) -> torch.Tensor:
    """The batch routes ``[N, width, layers, top_k]`` (int16, :data:`NO_ROUTE` past each sequence's
    recorded positions) of the sequences' engine routes, each ``[positions, layers * top_k]`` (the
    engine's :attr:`~cooper_mcore.rollout.base.GenerateOutput.routed_experts`).

    Raises:
        ValueError: routes of another number of layers or top-k, or longer than ``width``.
    """
    out = torch.full((len(per_sequence), width, layers, topk), NO_ROUTE, dtype=torch.int16)
    for i, r in enumerate(per_sequence):
        if r.dim() != 2 or r.shape[1] != layers * topk or r.shape[0] > width:
            raise ValueError(f"routing replay: sequence {i}'s routes are {tuple(r.shape)}, expected [<= {width}, "
                             f"{layers} layers x top-{topk}]; does the engine serve this policy?")
        out[i, :r.shape[0]] = r.reshape(-1, layers, topk).to(torch.int16)
    return out
