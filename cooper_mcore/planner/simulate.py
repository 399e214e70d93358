"""One rank of a run's real layout through a whole Cooper step on fake tensors, each phase's peak memory
by kind (``cooper plan --simulate``).

The step is the trainer's own: the models are built by :func:`cooper_mcore.rl.setup.random_model` at
the run's layout (megatron DDP, the distributed optimizer), the reference by
:class:`~cooper_mcore.train.offload.ReferenceSwap`, the engine's colocation by
:class:`~cooper_mcore.rl.colocate.Colocation`, and one :func:`cooper_mcore.rl.step.cooper_step` runs
every phase: offload, weight push, rollout bookkeeping, reward-model scores, old and reference
log-probabilities, the policy's update, the negatives and the reward model's update, reload. What
stands in (:mod:`cooper_mcore.planner.stand_ins`): the rollout engine, the rule verifier, the assistant
and the tokenizer; and the device itself, as fake tensors on a fake process group
(:mod:`cooper_mcore.planner.fake_device`), the one seam. A phase's peak is the most its tensors' live
bytes reached (:mod:`cooper_mcore.planner.memory_tracker`), timed by the trainer's own
:class:`~cooper_mcore.metrics.PhaseTimer`.

The step runs with fewer micro-batches than the run, each the same (:func:`simulation_config`): a
data-parallel rank gets ``2 x pp`` prompts of 2 rollouts per reward-model pair (one right, one
wrong), every rollout at full length, so each pass
makes full micro-batches (the token budget's packs, the reward model's pairs) and a pipeline has its
stages' 1F1B micro-batches in flight. Memory per phase does not depend on the count beyond that (a
pass holds one micro-batch per stage in flight); time does.

With pipeline parallelism each stage's first rank is simulated in turn, the last first (its own
process group; the other stages' weight-sync metadata made beforehand from their models; the host
values the last stage broadcasts, such as the loss sums, replayed to the earlier ones), as the
planner plans each stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron.core import parallel_state

from cooper_mcore.config.model_shapes import ModelShape
from cooper_mcore.config.schema import CooperConfig
from cooper_mcore.data.iterator import PromptIterator
from cooper_mcore.metric_names import TIME_PREFIX
from cooper_mcore.metrics import PhaseTimer
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.routing_replay import enable_routing_replay
from cooper_mcore.planner.fake_device import BroadcastLog, simulated_device, simulated_world
from cooper_mcore.planner.memory_tracker import MemoryTracker, PhasePeak
from cooper_mcore.planner.stand_ins import (
    StandInAssistant,
    StandInEngine,
    StandInVerifier,
    WordTokenizer,
    stand_in_prompts,
)
from cooper_mcore.rl.colocate import Colocation
from cooper_mcore.rl.setup import DTYPES, Run, random_model
from cooper_mcore.rl.step import cooper_step
from cooper_mcore.rollout.weight_sync import StageMeta, stage_metadata
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.train.offload import CATEGORIES, ReferenceSwap, host_buffer

__all__ = ["PROMPTS_PER_STAGE", "ROLLOUTS_PER_PAIR", "RankSimulation", "simulate", "simulate_rank",
           "simulation_config", "stage_ranks"]

#: prompts per data-parallel rank and pipeline stage in the simulated step
PROMPTS_PER_STAGE = 2
#: rollouts per prompt and reward-model pair in the simulated step (one right, one wrong)
ROLLOUTS_PER_PAIR = 2


@dataclass
class RankSimulation:
    """What one simulated rank held during a Cooper step.

    Attributes:
        rank: the global rank simulated.
        stage: its pipeline stage.
        peaks: each phase's peak by kind (``offload``, ``weight_sync``, ``rollout``, ...).
        host_peak: the most host memory its copies of device state took (the reference, offloads).
        engine_resident: per phase, the engine memory the trainer had resumed (``weights``,
            ``kv_cache``, ``cuda_graph``): the planner's engine terms that phase holds.
        seconds: each phase's wall seconds here (fake tensors: the Python work, not the GPU's).
        pushed_bytes: bytes the weight push handed the engine.
    """

    rank: int
    stage: int
    peaks: dict[str, PhasePeak]
    host_peak: int
    engine_resident: dict[str, list[str]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    pushed_bytes: int = 0


def simulation_config(cfg: CooperConfig, world_size: int) -> tuple[CooperConfig, list[str]]:
    """``cfg`` with the simulated step's batch (see the module docstring), and what changed.

    Raises:
        ValueError: the layout does not fit ``world_size``.
    """
    cfg.parallel.validate(world_size)
    dp = world_size // (cfg.parallel.tp * cfg.parallel.pp)
    prompts = dp * PROMPTS_PER_STAGE * cfg.parallel.pp
    group = ROLLOUTS_PER_PAIR * cfg.rm.pairs_per_prompt  # as many wrong rollouts as the pairs need
    sim = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, prompts_per_step=prompts, mini_batches=1),
                              rollout=dataclasses.replace(cfg.rollout, group_size=group))
    notes = []
    run = (cfg.train.prompts_per_step, cfg.rollout.group_size, cfg.train.mini_batches)
    if run != (prompts, group, 1):
        notes.append(f"simulated batch: train.prompts_per_step={prompts} rollout.group_size={group} "
                     f"train.mini_batches=1 (the run: {cfg.train.prompts_per_step}, {cfg.rollout.group_size}, "
                     f"{cfg.train.mini_batches}): the same micro-batches, fewer of them")
    return sim, notes


def stage_ranks(cfg: CooperConfig, world_size: int) -> list[int]:
    """The first rank of each pipeline stage (megatron orders ranks tp-cp-ep-dp-pp): the ranks simulated."""
    return [stage * (world_size // cfg.parallel.pp) for stage in range(cfg.parallel.pp)]


class _TrackedTimer(PhaseTimer):
    """The trainer's phase timer; each phase's memory from the tracker, by kind, and the engine memory
    the trainer had resumed in it."""

    def __init__(self, tracker: MemoryTracker, engine: StandInEngine) -> None:
        super().__init__(peak_memory=tracker.interval_peak)
        self.tracker = tracker
        self.engine = engine
        self.resident: dict[str, set[str]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with super().phase(name), self.tracker.phase(name):
            self.resident.setdefault(name, set()).update(self.engine.resident)
            yield


def _label_state(tracker: MemoryTracker, models: list[Optional[ModelState]]) -> None:
    for model in models:
        if model is not None:
            for category in CATEGORIES:
                tracker.label(f"{model.name}_{category}", model.offloader.storages(category))


def _build_run(cfg: CooperConfig, policy: ModelShape, rm: Optional[ModelShape], device: Any,
               tracker: MemoryTracker, prompt_tokens: int) -> tuple[Run, StandInEngine]:
    """The models (as ``model.init: random`` builds them), the reference, the colocation and the data."""
    tokenizer = WordTokenizer(policy.arch.vocab_size)
    mode = cfg.reward.mode
    with device.building_state():
        steps = cfg.train.steps * cfg.train.mini_batches  # the policy's schedule, as build_models makes it
        policy_state = random_model("policy", policy, cfg, tokenizer, cfg.optim, steps, cfg.train.seed)
        rm_state = (random_model("rm", rm, cfg, tokenizer, cfg.rm.optim if mode.trains_rm else None, cfg.train.steps,
                                 cfg.train.seed + 1) if rm is not None and mode.uses_rm else None)
    _label_state(tracker, [policy_state, rm_state])
    if cfg.model.moe_routing_replay:
        enable_routing_replay(policy_state.module)
    arch = policy.arch
    engine = StandInEngine(cfg.rollout.uses_sglang, (arch.num_layers, arch.moe.experts_per_token, arch.moe.num_experts)
                           if cfg.model.moe_routing_replay and arch.moe is not None else None)
    colocation = Colocation(engine, policy_state, rm_state, cfg.offload, bucket_bytes=cfg.rollout.bucket_mb * 2**20)
    template = cfg.data.template if cfg.rm.question_as_prompted else None
    prompts = stand_in_prompts(cfg.train.prompts_per_step, prompt_tokens, cfg.rollout.max_new_tokens, template)
    data = PromptIterator(prompts, cfg.train.prompts_per_step, parallel_state.get_data_parallel_rank(),
                          parallel_state.get_data_parallel_world_size(), seed=cfg.train.seed, shuffle=False)
    run = Run(cfg=cfg, policy=policy_state, rm=rm_state,
              reference=ReferenceSwap(policy_state.module) if cfg.algo.kl_coef else None, colocation=colocation,
              verifier=StandInVerifier(), assistant=StandInAssistant() if cfg.uses_assistant else None, data=data,
              engine_checked=True)  # the engine's agreement with the trainer is a check of values: placeholders here
    return run, engine


def simulate_rank(cfg: CooperConfig, policy: ModelShape, rm: Optional[ModelShape], world_size: int, rank: int,
                  prompt_tokens: int, remote_objects: Optional[dict[int, Any]] = None, seed: int = 0,
                  broadcasts: Optional[BroadcastLog] = None) -> RankSimulation:
    """Rank ``rank`` of ``world_size`` through one Cooper step of ``cfg`` on fake tensors.

    Args:
        cfg: the run's config (its batch as given: see :func:`simulation_config`).
        policy / rm: the models' shapes (``rm`` None in rule mode).
        world_size / rank: the job and the rank simulated.
        prompt_tokens: every prompt's length in tokens.
        remote_objects: what other stages broadcast to this rank (:func:`simulate` makes them).
        seed: seed of the placeholder values.
        broadcasts: the host values ranks simulated before broadcast (recorded here for the later ones).
    """
    stage = rank // (world_size // cfg.parallel.pp)
    tracker = MemoryTracker({policy.arch.vocab_size // cfg.parallel.tp})
    with simulated_world(cfg.parallel, world_size, rank, cfg.train.seed, remote_objects, broadcasts), \
            simulated_device(tracker, seed, host_functions=[host_buffer]) as device:
        run, engine = _build_run(cfg, policy, rm, device, tracker, prompt_tokens)
        timer = _TrackedTimer(tracker, engine)
        cooper_step(run, run.data.next_batch(), timer)
        seconds = {k[len(TIME_PREFIX):]: v for k, v in timer.pop().items() if k.startswith(TIME_PREFIX)}
    return RankSimulation(rank, stage, dict(tracker.peaks), tracker.host_peak,
                          {k: sorted(v) for k, v in timer.resident.items()}, seconds, engine.pushed_bytes)


def _stage_metas(cfg: CooperConfig, policy: ModelShape, world_size: int) -> dict[int, StageMeta]:
    """Each pipeline stage's weight-sync metadata (what it broadcasts before its weights), by its first
    rank: its policy stage built on fake tensors in a world where this process is that rank."""
    metas = {}
    moe = policy.arch.moe is not None
    for rank in stage_ranks(cfg, world_size):
        with simulated_world(cfg.parallel, world_size, rank, cfg.train.seed), \
                simulated_device(MemoryTracker()) as device, device.building_state():
            model = build_model(policy.arch, cfg.parallel, dtype=DTYPES[cfg.model.dtype], init_weights=False)
            metas[rank] = stage_metadata(model, cfg.parallel.tp, cfg.parallel.ep if moe else 1,
                                         cfg.parallel.expert_tp if moe else 1)
    return metas


def simulate(cfg: CooperConfig, policy: ModelShape, rm: Optional[ModelShape], world_size: int,
             prompt_tokens: int = 512, seed: int = 0) -> tuple[list[RankSimulation], CooperConfig, list[str]]:
    """Every pipeline stage's first rank through one Cooper step of ``cfg`` with the simulated batch
    (:func:`simulation_config`).

    Returns:
        The ranks' simulations (one per stage), the config they ran and notes on what changed.

    Raises:
        ValueError: the layout does not fit ``world_size``, or a torch.distributed world exists already.
    """
    sim_cfg, notes = simulation_config(cfg, world_size)
    metas = _stage_metas(sim_cfg, policy, world_size) if cfg.parallel.pp > 1 else {}
    broadcasts = BroadcastLog()
    out = []
    for rank in reversed(stage_ranks(sim_cfg, world_size)):  # the last stage first: its sums reach the others
        remote = {r: meta for r, meta in metas.items() if r != rank}
        start = time.perf_counter()
        out.append(simulate_rank(sim_cfg, policy, rm, world_size, rank, prompt_tokens, remote, seed, broadcasts))
        out[-1].seconds["total"] = time.perf_counter() - start
    return out[::-1], sim_cfg, notes
