"""How the Megatron training state and the rollout engine share the GPUs around each generation.

The order (as SGLang's memory saver needs it, and as slime does it):

1. offload the training state chosen in ``offload`` (gradients, optimizer states, the reward
   model), keeping the policy's parameters for the weight push, and free the allocator's cache;
2. resume the engine's ``weights`` memory;
3. push the policy's current weights into it: every time when the engine releases its memory (the
   released weights are gone), else whenever the engine's version is behind the policy's (after
   every update, and at the start of a run);
4. offload the policy's parameters if chosen;
5. resume the engine's KV cache and CUDA graphs;
6. generate (rollouts or evaluation);
7. release all of the engine's memory and bring the training state back.

The engine's weights are released without a CPU copy, so their memory holds nothing useful after a
resume until step 3 refills it; generating without step 3 would sample from undefined weights.
There is no end-of-step sync: the next generation pushes what it needs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Optional

import torch

from cooper_mcore.collectives import is_group_leader
from cooper_mcore.config.schema import OffloadConfig
from cooper_mcore.metric_names import Phase
from cooper_mcore.metrics import PhaseTimer
from cooper_mcore.rollout.base import RolloutEngine
from cooper_mcore.rollout.weight_sync import sync_weights
from cooper_mcore.train.model_state import ModelState

logger = logging.getLogger(__name__)


class Colocation:
    """The rollout engine of this model-parallel group and the models that share its GPUs.

    Args:
        engine: the engine (on the model-parallel group's leader; None on the other ranks).
        policy: the policy (its weights are pushed into the engine).
        rm: the reward model, if the run has one.
        offload: what leaves the device during generation.
        bucket_bytes: weight-push bucket size.
        per_tp_rank: push one payload per TP rank from that rank's GPU (an SGLang engine with the
            policy's TP size; see :func:`~cooper_mcore.rollout.weight_sync.sync_weights`).
    """

    def __init__(self, engine: Optional[RolloutEngine], policy: ModelState, rm: Optional[ModelState],
                 offload: OffloadConfig, bucket_bytes: int, per_tp_rank: bool = False) -> None:
        self.engine = engine
        self.policy = policy
        self.rm = rm
        self.offload = offload
        self.bucket_bytes = bucket_bytes
        self.per_tp_rank = per_tp_rank
        self.synced_version: Optional[int] = None  # the policy version last pushed, on every rank
        self._release = engine is not None and offload.release_engine  # this rank drives the engine's memory

    def push_needed(self, version: int) -> bool:
        """Whether :meth:`generating` pushes the weights of ``version``.

        The push is collective over the model-parallel group, so the answer must be the same on
        every rank of it: it reads the config and the version pushed last, both shared, and never
        whether this rank holds the engine. Released weights are lost, so a releasing engine gets
        them every time; otherwise only a version it has not had yet.
        """
        return self.offload.release_engine or self.synced_version != version

    def _moves(self, policy_params: bool) -> list[tuple[ModelState, dict[str, bool]]]:
        o = self.offload
        moves = [(self.policy, {"params": policy_params and o.policy_params, "grads": o.policy_grads,
                                "optimizer": o.policy_optimizer})]
        if self.rm is not None:
            moves.append((self.rm, {"params": o.rm_params, "grads": o.rm_grads and self.rm.trains,
                                    "optimizer": o.rm_optimizer and self.rm.trains}))
        return [(m, flags) for m, flags in moves if any(flags.values())]

    @contextlib.contextmanager
    def generating(self, version: int, timer: PhaseTimer) -> Iterator[Optional[RolloutEngine]]:
        """Ready the engine with the policy's weights of ``version`` for the body (collective:
        every rank of the model calls it); yields the engine (None off the group leader)."""
        with timer.phase(Phase.OFFLOAD):
            for model, flags in self._moves(policy_params=False):
                model.offloader.offload(**flags)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if self._release:
            self.engine.resume_memory(["weights"])
        if self.push_needed(version):
            with timer.phase(Phase.WEIGHT_SYNC):
                sync_weights(self.policy.model, self.policy.arch, self.engine if is_group_leader() else None,
                             version, bucket_bytes=self.bucket_bytes, per_tp_rank=self.per_tp_rank)
                self.synced_version = version
        params_moved = self.offload.policy_params
        if params_moved:
            with timer.phase(Phase.OFFLOAD):
                self.policy.offloader.offload(params=True, grads=False, optimizer=False)
        if self._release:
            self.engine.resume_memory(["kv_cache", "cuda_graph"])
        try:
            yield self.engine
        finally:
            if self._release:
                self.engine.release_memory()
            with timer.phase(Phase.OFFLOAD):
                if params_moved:
                    self.policy.offloader.onload(params=True, grads=False, optimizer=False)
                for model, flags in self._moves(policy_params=False):
                    model.offloader.onload(**flags)
