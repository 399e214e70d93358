"""The Cooper training loop: GRPO on the policy with rewards from a reward model that is itself
updated every step (``cooper``), kept frozen (``static_rm``) or replaced by the rule verifier
(``rule``).

Per step: :func:`cooper_mcore.rl.step.cooper_step`, then evaluation, metrics, checkpoints and the
stop conditions. Faults: ``checkpoint.resume: auto`` continues from the newest checkpoint that
verifies against its manifest (:mod:`cooper_mcore.checkpoint.training`). SIGTERM (preemption),
SIGUSR1 (the early warning a scheduler sends before its time limit, e.g. ``#SBATCH
--signal=B:USR1@600`` forwarded by the launcher) or a first Ctrl-C (SIGINT) is caught; at the end of
the current step (or right after the checkpoint being written when it came) every rank writes a
checkpoint and :class:`TrainingStopped` is raised with ``EXIT_PREEMPTED`` (75). A second Ctrl-C
stops at once: the checkpoint being written, if any, is left incomplete (``step_<n>.tmp``, which
resume ignores), megatron-core's writer processes are killed, and :class:`TrainingStopped` is
raised with ``EXIT_INTERRUPTED`` (130) naming the newest complete checkpoint. Forked children
(megatron-core's checkpoint writers) ignore the stop signals: the trainer decides. A checkpoint
that cannot be written (a full disk, ...) stops the run with ``EXIT_CHECKPOINT_FAILED`` (74). A
step whose policy or RM update is skipped for a non-finite loss or gradient norm is logged
(``skipped/nonfinite``); after ``train.max_nonfinite_steps`` such steps in a row a checkpoint is
written and :class:`TrainingStopped` is raised with ``EXIT_NONFINITE`` (3). Likewise after
``train.max_steps_without_signal`` steps in a row in which no rollout got a rule verdict where the rule
trains the run (references it cannot read: :func:`~cooper_mcore.rl.results.steps_without_signal`), with
``EXIT_NO_SIGNAL`` (2).

A run folder belongs to one run: rank 0 holds its lock for the whole run
(:func:`cooper_mcore.job.hold_run_folder`), and a run starts or continues there only as
:mod:`cooper_mcore.rl.run_folder` allows (a folder holding another run is refused unless resumed or
overwritten; a resume whose settings change what is trained is refused unless allowed, and
becomes a new version of the folder's ``config.yaml``).

The world, metrics log, progress bar, stop signal and checkpoint room are the job skeleton's
(:func:`cooper_mcore.job.job`), shared with SFT and VerifyRM training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from cooper_mcore.checkpoint.training import CheckpointWriteError, load_training_checkpoint, save_training_checkpoint
from cooper_mcore.config.schema import CooperConfig, to_dict
from cooper_mcore.hacking_detector import RewardHackingDetector
from cooper_mcore.job import (
    CHECKPOINTS_DIR,
    EXIT_CHECKPOINT_FAILED,
    EXIT_ENGINE_LOST,
    EXIT_NO_SIGNAL,
    EXIT_NONFINITE,
    JobRoom,
    TrainingStopped,
    hold_run_folder,
    job_room,
    resume_path,
)
from cooper_mcore.metric_names import MEMORY_PREFIX, TIME_PREFIX, Phase
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.metrics import cuda_peak_memory, reduce_metrics
from cooper_mcore.parallel import owned_world
from cooper_mcore.rl.async_rollouts import RolloutsFailed, publish_policy
from cooper_mcore.rl.results import StepResult, no_signal_message, steps_without_signal
from cooper_mcore.rl.rollouts import eval_samples_path, evaluate
from cooper_mcore.rl.run_folder import check_run_folder, open_run_folder, record_config
from cooper_mcore.rl.setup import Run, assemble_run, open_pipeline, start_world
from cooper_mcore.rl.step import cooper_step
from cooper_mcore.rollout.base import RolloutEngine
from cooper_mcore.train.faults import FaultPhaseTimer

logger = logging.getLogger(__name__)

__all__ = ["restore", "run_steps", "train"]


@owned_world()  # the world start_world makes is destroyed on exit: an in-process run leaves none behind
def train(cfg: CooperConfig) -> dict[str, float]:
    """Run (or resume) a Cooper training job; return the last step's metrics (see the module doc)."""
    check_run_folder(cfg.out, cfg.checkpoint.resume, cfg.checkpoint.overwrite)  # every rank, before any work
    start_world(cfg)
    with hold_run_folder(cfg.out, lambda: open_run_folder(cfg)) as start:  # checked again, cleared, compared
        checkpoint = resume_path(os.path.join(cfg.out, CHECKPOINTS_DIR), cfg.checkpoint.resume)
        run = assemble_run(cfg)
        try:
            restored = restore(run, checkpoint)
            run.pipeline = open_pipeline(run, restored.kept_steps, restored.pending)
            if dist.get_rank() == 0:
                record_config(cfg, start, run.step)
            with job_room(cfg.out, cfg.train.steps, start_step=run.step, config=to_dict(cfg),
                          use_wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project,
                          run_name=cfg.logging.run_name or None) as room:
                return run_steps(run, room, restored.nonfinite_streak)
        finally:
            run.close()


def run_steps(run: Run, room: JobRoom, streak: int) -> dict[str, float]:
    """The loop: steps until ``train.steps``, each logged, checkpointed when due, and the stop
    conditions checked after it; return the last step's metrics."""
    cfg = run.cfg
    cuda = torch.cuda.is_available()  # on a GPU: phases timed after their kernels, and their peak memory
    timer = FaultPhaseTimer(step=lambda: run.step + 1, sync=torch.cuda.synchronize if cuda else None,
                            peak_memory=cuda_peak_memory if cuda else None)
    detector = RewardHackingDetector(window=cfg.logging.hacking_window,
                                     action="stop" if cfg.logging.stop_on_hacking else "warn")
    no_pairs = 0  # cooper steps in a row without a valid pair
    silent = 0  # steps in a row without a rule verdict, where the rule trains the run
    metrics: dict[str, float] = {}
    while run.step < cfg.train.steps:
        with engine_lost_stops(run, room):
            result = cooper_step(run, None if run.pipeline else run.data.next_batch(), timer)
            run.step += 1
            room.step = run.step
            if run.pipeline is not None:
                with timer.phase(Phase.WEIGHT_SYNC):
                    publish_policy(run.pipeline, run.policy, run.step)
            eval_metrics: dict[str, float] = {}
            if cfg.eval.every and run.step % cfg.eval.every == 0:
                with evaluation_engine(run, timer) as engine, timer.phase(Phase.EVAL):
                    eval_metrics = run_evaluation(run, engine)
        metrics = world_metrics(run, result, timer.pop(), eval_metrics)
        room.log(run.step, metrics)
        streak = nonfinite_streak(streak, result, run.step, cfg.train.max_nonfinite_steps)
        no_pairs = steps_without_pairs(no_pairs, metrics, run.step, cfg)
        silent = steps_without_signal(silent, metrics, cfg.reward.mode.rule_trains)
        if end_of_step(run, room, detector, metrics, streak, silent):
            break
    return metrics


@contextlib.contextmanager
def engine_lost_stops(run: Run, room: JobRoom) -> Iterator[None]:
    """A rollout engine lost for good (:class:`~cooper_mcore.rl.async_rollouts.RolloutsFailed`, raised on every
    rank) stops the run in one line naming the newest complete checkpoint.

    Raises:
        TrainingStopped: with ``EXIT_ENGINE_LOST``.
    """
    try:
        yield
    except RolloutsFailed as e:
        last = room.newest_checkpoint()
        raise TrainingStopped(f"stopping after step {run.step}: {e}. The newest complete checkpoint is "
                              f"{last or 'none (the run would start over)'}: run the same command with --resume "
                              "auto to continue from it", EXIT_ENGINE_LOST, last) from e


@contextlib.contextmanager
def evaluation_engine(run: Run, timer: FaultPhaseTimer) -> Iterator[Optional[RolloutEngine]]:
    """The engine with the policy's current weights for an evaluation (collective): the colocated one
    readied around it, or the pipeline's between two of its generations."""
    if run.pipeline is not None:
        yield run.pipeline.generate_with(run.step)
        run.pipeline.check()
        return
    with run.colocation.generating(version=run.step, timer=timer) as engine:
        yield engine


def end_of_step(run: Run, room: JobRoom, detector: RewardHackingDetector, metrics: dict[str, float],
                streak: int, silent: int = 0) -> bool:
    """Checkpoint when due or stopping, and the stop conditions (collective: every rank decides the
    same). Return whether reward hacking stops the run.

    Raises:
        TrainingStopped: a stop signal (after its checkpoint), ``train.max_nonfinite_steps``
            non-finite steps in a row, or ``train.max_steps_without_signal`` steps without a rule verdict.
    """
    cfg = run.cfg
    preempted = room.stop_requested()
    nonfinite_stop = 0 < cfg.train.max_nonfinite_steps <= streak
    silent_stop = 0 < cfg.train.max_steps_without_signal <= silent
    hacking_stop = False
    # the world's reward and rule accuracy (means over the ranks): every rank decides the same
    if cfg.reward.mode.uses_rm and detector.update(run.step, metrics[K.REWARD_MEAN], metrics[K.RULE_ACC]):
        hacking_stop = detector.should_stop
    due = cfg.checkpoint.every and (run.step % cfg.checkpoint.every == 0 or run.step == cfg.train.steps)
    path: Optional[str] = None
    if due or preempted or nonfinite_stop or silent_stop:
        path = write_checkpoint(run, room, streak)
        # a stop signal during the write: stop now, with the checkpoint just written
        preempted = preempted or room.stop_requested()
    if preempted:
        raise room.stopped(run.step, path)
    if nonfinite_stop:
        raise TrainingStopped(f"stopping: {streak} steps in a row had a non-finite loss or gradient norm "
                              f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); checkpoint "
                              f"{path} written; lower the learning rate or check the data before resuming",
                              EXIT_NONFINITE, path)
    if silent_stop:
        raise TrainingStopped(no_signal_message(silent, metrics, cfg.reward.mode.uses_rm, cfg.data.train_path, path),
                              EXIT_NO_SIGNAL, path)
    if hacking_stop:
        logger.error("stopping: reward hacking detected")
    return hacking_stop


def write_checkpoint(run: Run, room: JobRoom, streak: int) -> str:
    """The run's training checkpoint after ``run.step`` in the job's checkpoint room.

    Raises:
        TrainingStopped: it could not be written (``EXIT_CHECKPOINT_FAILED``, naming the newest complete one).
    """
    pipeline, rank_state = run.pipeline, None
    data = run.data.state_dict() if pipeline is None else pipeline.data_state(run.step)
    if pipeline is not None:  # the rollouts generated ahead (the leaders'), so that a resume trains on them
        with engine_lost_stops(run, room):
            pending = pipeline.pending(run.step)
        rank_state = {"pending": pending} if pending is not None else None
    kept = pipeline.kept_steps(run.step) if pipeline is not None else 0
    try:
        return save_training_checkpoint(room.ckpt_dir, run.step, run.trained_models,
                                        {"data": data, "nonfinite_streak": streak, "kept_steps": kept},
                                        keep=run.cfg.checkpoint.keep, rank_state=rank_state)
    except CheckpointWriteError as e:
        last = room.newest_checkpoint()
        raise TrainingStopped(f"stopping after step {run.step}: {e}. The newest complete checkpoint is "
                              f"{last or 'none (the run would start over)'}; fix the cause (free disk space, "
                              "...), then run the same command with --resume auto to continue from it",
                              EXIT_CHECKPOINT_FAILED, last) from e


def world_metrics(run: Run, result: StepResult, times: dict[str, float],
                  eval_metrics: dict[str, float]) -> dict[str, float]:
    """The step's metrics line, the same on every rank (collective): the step's
    :meth:`~cooper_mcore.rl.results.StepResult.to_metrics`, ``data/skipped_too_long`` and the phase
    timings reduced over the ranks (``time/*`` and ``memory/*``: the slowest rank sets the pace and
    the fullest GPU the limit, so maxima; the rest means), and the evaluation's (already over the world)."""
    metrics = {**result.to_metrics(), K.DATA_SKIPPED_TOO_LONG: run.skipped_too_long, **times}
    metrics = reduce_metrics(metrics, max_keys=[k for k in metrics if k.startswith((TIME_PREFIX, MEMORY_PREFIX))
                                                or k == K.STALENESS_MAX])
    metrics.update(eval_metrics)
    return metrics


def nonfinite_streak(streak: int, result: StepResult, step: int, limit: int) -> int:
    """Steps in a row with an update skipped for a non-finite loss or gradient norm, after ``step``
    (warned). Every rank counts the same: :func:`~cooper_mcore.train.step.guarded_step`
    decides a skip over the world."""
    streak = streak + 1 if result.skipped_updates else 0
    if streak:
        logger.warning("step %d: non-finite loss or gradient norm, %d update(s) skipped "
                       "(%d step(s) in a row, the limit is %d)", step, result.skipped_updates, streak, limit)
    return streak


def steps_without_pairs(count: int, metrics: dict[str, float], step: int, cfg: CooperConfig) -> int:
    """Cooper steps in a row without a valid reward-model pair in the world (``metrics``: the
    world's line), warned once at ``train.max_steps_without_pairs``."""
    count = count + 1 if metrics.get(K.PAIRS_VALID) == 0 else 0
    if count and count == cfg.train.max_steps_without_pairs:
        logger.warning("%d steps in a row without a single valid reward-model pair: the reward model is not "
                       "learning (pairs/no_positive %d, pairs/no_negative %d, pairs/assistant_failed %d); "
                       "check rm.negatives and the assistant endpoint %s", count, metrics[K.PAIRS_NO_POSITIVE],
                       metrics[K.PAIRS_NO_NEGATIVE], metrics[K.PAIRS_ASSISTANT_FAILED],
                       cfg.rm.assistant_url or "(none)")
    return count


def run_evaluation(run: Run, engine: Optional[RolloutEngine]) -> dict[str, float]:
    """Evaluate the engine's current weights on the held-out prompts (collective over the world):
    ``eval/acc`` by ``eval.verifier``'s checker, and ``eval/rule_acc`` (the rule verifier's) beside
    it when that is the oracle; with ``eval.save_samples`` each replica's completions go to
    :func:`~cooper_mcore.rl.rollouts.eval_samples_path`."""
    cfg = run.cfg
    path = eval_samples_path(cfg.out, run.step) if cfg.eval.save_samples else None
    result = evaluate(engine, run.verifier, run.eval_prompts, cfg.eval.k, run.eval_sampling(), oracle=run.oracle,
                      samples_path=path)
    metrics = {K.EVAL_ACC: result.accuracy}
    if cfg.eval.uses_oracle:
        metrics[K.EVAL_RULE_ACC] = result.rule_accuracy
    return metrics


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives the loop besides the models and the data position.

    Attributes:
        nonfinite_streak: steps in a row with a skipped update before it.
        kept_steps: steps ahead whose rollouts it kept (an asynchronous run's; 0 otherwise).
        pending: those rollouts, on an engine's rank (None elsewhere).
    """

    nonfinite_streak: int = 0
    kept_steps: int = 0
    pending: Optional[list] = None


def restore(run: Run, path: Optional[str]) -> Restored:
    """Load the checkpoint at ``path`` into the run (models, optimizers, schedules, RNG, data
    position, step); return what else it kept. Without one, seed the host RNGs so checkpoints are
    reproducible (torch is seeded by ``init_distributed``).

    Raises:
        ValueError: it kept rollouts generated ahead, and this run does not generate ahead (a colocated one).
    """
    if path is None:
        random.seed(run.cfg.train.seed)
        np.random.seed(run.cfg.train.seed % 2**32)
        return Restored()
    state = load_training_checkpoint(path, run.trained_models)
    run.step = state["step"]
    run.data.load_state_dict(state["data"])
    kept = state.get("kept_steps", 0)
    if kept and not run.cfg.rollout.disaggregated:
        raise ValueError(f"{path} keeps the rollouts of {kept} steps generated ahead by a disaggregated engine: resume "
                         "it with rollout.placement=disaggregated")
    return Restored(state.get("nonfinite_streak", 0), kept, (state["rank_state"] or {}).get("pending"))
