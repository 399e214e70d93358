"""The Cooper training loop: GRPO on the policy with rewards from a reward model that is itself
updated every step (``cooper``), kept frozen (``static_rm``) or replaced by the rule verifier
(``rule``).

Per step: :func:`cooper_mcore.rl.step.cooper_step`, then evaluation, metrics, checkpoints and the
stop conditions. Faults: ``checkpoint.resume: auto`` continues from the newest checkpoint that
verifies against its manifest (:mod:`cooper_mcore.mcore.checkpoint`). SIGTERM (preemption) or
SIGUSR1 (the early warning a scheduler sends before its time limit, e.g. ``#SBATCH
--signal=B:USR1@600`` forwarded by the launcher) is caught; at the end of the current step every
rank writes a checkpoint and :class:`TrainingStopped` is raised with ``EXIT_PREEMPTED`` (75). A
step whose policy or RM update is skipped for a non-finite loss or gradient norm is logged
(``skipped/nonfinite``); after ``train.max_nonfinite_steps`` such steps in a row a checkpoint is
written and :class:`TrainingStopped` is raised with ``EXIT_NONFINITE`` (3).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from cooper_mcore.collectives import any_rank
from cooper_mcore.config import CooperConfig, save_config, to_dict
from cooper_mcore.hacking import RewardHackingDetector
from cooper_mcore.mcore.checkpoint import find_resume, load_training_checkpoint, save_training_checkpoint
from cooper_mcore.mcore.faults import FaultPhaseTimer
from cooper_mcore.metrics import MetricsLogger, ProgressBar, cuda_peak_memory, reduce_metrics
from cooper_mcore.parallel import owned_world
from cooper_mcore.rl.rollouts import evaluate
from cooper_mcore.rl.setup import Run, build_run
from cooper_mcore.rl.step import cooper_step

logger = logging.getLogger(__name__)

EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: a temporary failure, run the same command again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingStopped(RuntimeError):
    """The run stopped early on purpose after writing a checkpoint; ``exit_code`` is the CLI's."""

    def __init__(self, message: str, exit_code: int, checkpoint: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint


class StopSignal:
    """Catch SIGTERM and SIGUSR1 into a flag checked at the end of every step; restore on exit."""

    def __init__(self) -> None:
        self.caught: Optional[str] = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.caught is None:
            logger.warning("%s: will write a checkpoint and exit at the end of this step", signal.Signals(signum).name)
        self.caught = signal.Signals(signum).name

    def any_rank(self) -> bool:
        """Whether any rank caught a stop signal (collective: every rank calls it once per step)."""
        return any_rank(self.caught is not None)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def resume_path(ckpt_dir: str, resume: str) -> Optional[str]:
    """Rank 0 verifies the candidates (reading them once) and tells the others (collective)."""
    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            answer = [("ok", find_resume(ckpt_dir, resume))]
        except ValueError as e:
            answer = [("error", str(e))]
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise ValueError(value)
    return value


@owned_world()  # the world build_run makes is destroyed on exit: an in-process run leaves none behind
def train(cfg: CooperConfig) -> dict[str, float]:
    """Run (or resume) a Cooper training job; return the last step's metrics (see the module doc)."""
    run = build_run(cfg)
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    streak = restore(run, resume_path(ckpt_dir, cfg.checkpoint.resume))
    main = dist.get_rank() == 0
    if main:
        save_config(cfg, os.path.join(cfg.out, "config.yaml"))
    metrics_log = MetricsLogger(cfg.out, run_name=cfg.logging.run_name or None, config=to_dict(cfg),
                                use_wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, is_main=main)
    cuda = torch.cuda.is_available()  # on a GPU: phases timed after their kernels, and their peak memory
    timer = FaultPhaseTimer(step=lambda: run.step + 1, sync=torch.cuda.synchronize if cuda else None,
                            peak_memory=cuda_peak_memory if cuda else None)
    detector = RewardHackingDetector(window=cfg.logging.hacking_window,
                                     action="stop" if cfg.logging.stop_on_hacking else "warn")
    bar = ProgressBar(cfg.train.steps, start_step=run.step, enabled=main)
    stop_signal = StopSignal()
    no_pairs = 0  # cooper steps in a row without a valid pair

    def checkpoint() -> str:
        return save_training_checkpoint(ckpt_dir, run.step, run.trained_models,
                                        {"data": run.data.state_dict(), "nonfinite_streak": streak},
                                        keep=cfg.checkpoint.keep)

    metrics: dict[str, float] = {}
    try:
        while run.step < cfg.train.steps:
            metrics = cooper_step(run, run.data.next_batch(), timer)
            run.step += 1
            eval_acc = None
            if cfg.eval.every and run.step % cfg.eval.every == 0:
                with run.colocation.generating(version=run.step, timer=timer) as engine, timer.phase("eval"):
                    eval_acc = evaluate(engine, run.verifier, run.eval_prompts, cfg.eval.k, run.eval_sampling())
            metrics.update(timer.pop())
            # the slowest rank sets the pace and the fullest GPU the limit: time/* and memory/* are maxima;
            # the rest are means over the ranks
            metrics = reduce_metrics(metrics, max_keys=[k for k in metrics if k.startswith(("time/", "memory/"))])
            if eval_acc is not None:  # already over the world
                metrics["eval/acc"] = eval_acc.accuracy
            metrics_log.log(run.step, metrics)
            bar.update(run.step, metrics)
            streak = streak + 1 if metrics["skipped/nonfinite"] > 0 else 0
            if streak:
                logger.warning("step %d: non-finite loss or gradient norm, %d update(s) skipped "
                               "(%d step(s) in a row, the limit is %d)", run.step, int(metrics["skipped/nonfinite"]),
                               streak, cfg.train.max_nonfinite_steps)
            no_pairs = no_pairs + 1 if metrics.get("pairs/valid") == 0 else 0
            if no_pairs and no_pairs == cfg.train.max_steps_without_pairs:
                logger.warning("%d steps in a row without a single valid reward-model pair: the reward model is not "
                               "learning (pairs/no_positive %d, pairs/no_negative %d, pairs/assistant_failed %d); "
                               "check rm.negatives and the assistant endpoint %s", no_pairs,
                               metrics["pairs/no_positive"], metrics["pairs/no_negative"],
                               metrics["pairs/assistant_failed"], cfg.rm.assistant_url or "(none)")
            preempted = stop_signal.any_rank()
            nonfinite_stop = 0 < cfg.train.max_nonfinite_steps <= streak
            hacking_stop = False
            if cfg.reward.mode.uses_rm and detector.update(run.step, metrics["reward/mean"], metrics["rule/acc"]):
                hacking_stop = detector.should_stop
            due = cfg.checkpoint.every and (run.step % cfg.checkpoint.every == 0 or run.step == cfg.train.steps)
            if due or preempted or nonfinite_stop:
                path = checkpoint()
            if preempted:
                raise TrainingStopped(f"preempted ({stop_signal.caught or 'a stop signal on another rank'}) after "
                                      f"step {run.step}: checkpoint {path} written; run the same command with "
                                      "--resume auto to continue", EXIT_PREEMPTED, path)
            if nonfinite_stop:
                raise TrainingStopped(f"stopping: {streak} steps in a row had a non-finite loss or gradient norm "
                                      f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); checkpoint "
                                      f"{path} written; lower the learning rate or check the data before resuming",
                                      EXIT_NONFINITE, path)
            if hacking_stop:
                logger.error("stopping: reward hacking detected")
                break
    finally:
        stop_signal.restore()
        bar.close()
        metrics_log.close()
        if run.verifier is not None:
            run.verifier.close()
    return metrics


def restore(run: Run, path: Optional[str]) -> int:
    """Load the checkpoint at ``path`` into the run (models, optimizers, schedules, RNG, data
    position, step); return the non-finite streak it had. Without one, seed the host RNGs so
    checkpoints are reproducible (torch is seeded by ``init_distributed``)."""
    if path is None:
        random.seed(run.cfg.train.seed)
        np.random.seed(run.cfg.train.seed % 2**32)
        return 0
    state = load_training_checkpoint(path, run.trained_models)
    run.step = state["step"]
    run.data.load_state_dict(state["data"])
    return state.get("nonfinite_streak", 0)
