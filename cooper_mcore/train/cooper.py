"""The Cooper trainer: GRPO on the policy with rewards from a reward model that is itself
updated every step (``cooper``), kept frozen (``static_rm``) or replaced by the rule verifier
(``rule``).

One step (:func:`cooper_step`): rollouts -> rule verification -> rewards -> group advantages ->
old/reference log-probabilities -> GRPO update -> preference pairs -> RM update -> weight sync.
As in the reference implementation, the policy step of step t uses the RM before its step-t
update.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from cooper_mcore.algo import group_advantages, reward_from_logits
from cooper_mcore.config import CooperConfig, save_config
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.train import stages
from cooper_mcore.train.policy import build_token_batch, compute_logprobs, policy_update
from cooper_mcore.types import Prompt, RolloutGroup

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a step needs, built once by :func:`build_run`."""

    cfg: CooperConfig
    policy: Any  # megatron DDP
    policy_opt: Any
    policy_sched: Any
    policy_arch: Any
    tokenizer: Any
    reference: Any = None  # ReferenceSwap, when kl_coef > 0
    rm: Any = None  # the RM module (static_rm) or its DDP (cooper)
    rm_opt: Any = None
    rm_sched: Any = None
    rm_arch: Any = None
    rm_tokenizer: Any = None
    engine: Any = None  # on model-parallel group leaders
    verifier: Any = None  # on model-parallel group leaders
    negatives_client: Any = None
    data: Any = None  # PromptIterator
    eval_prompts: list[Prompt] = field(default_factory=list)
    step: int = 0
    extra: dict = field(default_factory=dict)


def score_rewards(run: Run, groups: list[RolloutGroup]) -> torch.Tensor:
    """Rewards ``[num_prompts, G]``: rule 0/1, or sigmoid(RM logit) in the RM modes."""
    cfg = run.cfg
    rule = torch.tensor([[1.0 if s.rule_correct else 0.0 for s in g.samples] for g in groups])
    if cfg.reward.mode == "rule":
        return rule
    triples = [(g.prompt.question, g.prompt.answer, s.text) for g in groups for s in g.samples]
    ids, lengths = stages.rm_token_batch(run.rm_tokenizer, triples, _pad_id(run.rm_tokenizer),
                                         run.rm_arch.max_position_embeddings)
    rm_module = run.rm.module if hasattr(run.rm, "module") else run.rm
    logits = stages.rm_scores(rm_module, ids, lengths, cfg.train.micro_batch_size)
    return reward_from_logits(logits).view_as(rule)


def update_reward_model(run: Run, groups: list[RolloutGroup]) -> dict[str, float]:
    """Cooper's RM step: verified-correct positive vs verified-wrong negative per prompt."""
    from cooper_mcore.reward.negatives import build_pairs, check_negative_failures, make_negative_generator, pair_stats
    from cooper_mcore.train.reward_model import pairwise_train_step

    cfg = run.cfg
    pairs = None
    if stages.is_group_leader():
        gen = make_negative_generator(cfg.rm.negatives, run.verifier, client=run.negatives_client,
                                      seed=cfg.train.seed + run.step)
        pairs = build_pairs(groups, gen)
    pairs = stages.broadcast_in_model_parallel_group(pairs)
    # assistant requests that failed after retries: masked and counted, or a stop naming the endpoint
    failed = check_negative_failures(pairs, cfg.rm.on_assistant_failure, cfg.rm.assistant_url)
    valid = torch.tensor([p.valid for p in pairs])
    pad = _pad_id(run.rm_tokenizer)
    max_len = run.rm_arch.max_position_embeddings
    chosen = stages.rm_token_batch(run.rm_tokenizer, [(p.prompt.question, p.prompt.answer, p.chosen or "")
                                                      for p in pairs], pad, max_len)
    rejected = stages.rm_token_batch(run.rm_tokenizer, [(p.prompt.question, p.prompt.answer, p.rejected or "")
                                                        for p in pairs], pad, max_len)
    metrics = pairwise_train_step(run.rm, run.rm_opt, chosen, rejected, valid, cfg.train.micro_batch_size)
    if not metrics["nonfinite"]:
        run.rm_sched.step(1)
    stats = pair_stats(pairs)
    return {"rm/loss": metrics["loss"], "rm/pair_acc": metrics["pair_acc"], "rm/nonfinite": float(metrics["nonfinite"]),
            "pairs/valid": float(stats["valid"]),
            "pairs/no_positive": float(stats["no_positive"]), "pairs/no_negative": float(stats["no_negative"]),
            "pairs/assistant_failed": float(failed)}


def cooper_step(run: Run, prompts: list[Prompt], timer) -> dict[str, float]:
    """One Cooper step on this data-parallel rank's prompts; returns its metrics."""
    cfg, m = run.cfg, {}
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, stop=list(cfg.rollout.stop),
                            seed=cfg.train.seed * 100003 + run.step * 1009 + dist.get_rank())
    with timer.phase("offload"):
        _move_training_state(run, offload=True)
    with timer.phase("rollout"):
        _engine_memory(run, resume=True)
        groups = stages.generate_groups(run.engine, run.verifier, prompts, cfg.rollout.group_size, params,
                                        run.step)
        _engine_memory(run, resume=False)
    with timer.phase("offload"):
        _move_training_state(run, offload=False)
    with timer.phase("rm_score"):
        rewards = score_rewards(run, groups)
    advantages = group_advantages(rewards, eps=cfg.algo.adv_eps)
    samples = [s for g in groups for s in g.samples]
    batch = build_token_batch([g.prompt.token_ids for g in groups for _ in g.samples],
                              [s.token_ids for s in samples], _pad_id(run.tokenizer))
    batch.advantages = advantages.flatten()
    with timer.phase("logprobs"):
        batch.old_logp = compute_logprobs(run.policy.module, batch, cfg.train.micro_batch_size)
        if run.reference is not None:
            with run.reference.swapped():
                batch.ref_logp = compute_logprobs(run.policy.module, batch, cfg.train.micro_batch_size)
    with timer.phase("policy_update"):
        per_mini = len(batch) // cfg.train.mini_batches
        updates = []
        for i in range(cfg.train.mini_batches):
            updates.append(policy_update(run.policy, run.policy_opt, batch.slice(i * per_mini, (i + 1) * per_mini),
                                         cfg.train.micro_batch_size, cfg.algo.clip_low, cfg.algo.clip_high,
                                         cfg.algo.kl_coef, cfg.algo.kl_kind))
            if not updates[-1]["nonfinite"]:  # as megatron: a skipped update does not advance the schedule
                run.policy_sched.step(1)
        skipped = sum(u.pop("nonfinite") for u in updates)
        m.update({k: sum(u[k] for u in updates if k in u) / len(updates) for k in updates[0]})
    if cfg.reward.mode == "cooper":
        with timer.phase("rm_update"):
            m.update(update_reward_model(run, groups))
            skipped += m.pop("rm/nonfinite")
    m["skipped/nonfinite"] = float(skipped)
    with timer.phase("weight_sync"):
        sync(run, version=run.step + 1)
    rule = torch.tensor([1.0 if s.rule_correct else 0.0 for s in samples])
    m.update({"reward/mean": float(rewards.mean()), "rule/acc": float(rule.mean()),
              "reward_rule_gap": float(rewards.mean() - rule.mean()),
              "response/length": float(sum(len(s.token_ids) for s in samples) / len(samples)),
              "rule/unverifiable": float(sum(s.rule_correct is None for s in samples) / len(samples)),
              "lr": float(run.policy_opt.param_groups[0]["lr"])})
    if cfg.reward.mode != "rule":
        m["rm/reward_correct"] = _mean([r for r, s in zip(rewards.flatten().tolist(), samples) if s.rule_correct])
        m["rm/reward_wrong"] = _mean([r for r, s in zip(rewards.flatten().tolist(), samples) if not s.rule_correct])
    return m


def sync(run: Run, version: int) -> None:
    """Push the policy's weights into this model-parallel group's engine."""
    from cooper_mcore.rollout.weight_sync import sync_weights

    engine = run.engine if stages.is_group_leader() else None
    if engine is not None:
        _engine_memory(run, resume=True)
    sync_weights(run.policy, run.policy_arch, engine, version,
                 bucket_bytes=run.cfg.rollout.bucket_mb * 2**20)
    if engine is not None:
        _engine_memory(run, resume=False)


def _move_training_state(run: Run, offload: bool) -> None:
    """Move the chosen parameters/gradients/optimizer states of the policy and the RM off the
    device while the rollout engine runs, and back (see ``OffloadConfig``)."""
    o = run.cfg.offload
    for name, offloader in run.extra.get("offloaders", {}).items():
        flags = dict(params=getattr(o, f"{name}_params"), grads=getattr(o, f"{name}_grads"),
                     optimizer=getattr(o, f"{name}_optimizer"))
        if any(flags.values()):
            (offloader.offload if offload else offloader.onload)(**flags)


def _engine_memory(run: Run, resume: bool) -> None:
    if run.engine is None or not run.cfg.offload.release_engine:
        return
    (run.engine.resume_memory if resume else run.engine.release_memory)()


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: a temporary failure, run the same command again


class TrainingStopped(RuntimeError):
    """The run stopped early on purpose after writing a checkpoint; ``exit_code`` is the CLI's."""

    def __init__(self, message: str, exit_code: int, checkpoint: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.checkpoint = checkpoint


class _SigtermFlag:
    """Catch SIGTERM (preemption) into a flag checked at the end of every step; restore on exit."""

    def __init__(self) -> None:
        self.caught = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.caught:
            logger.warning("SIGTERM: will write a checkpoint and exit at the end of this step")
        self.caught = True

    def any_rank(self) -> bool:
        """Whether any rank caught SIGTERM (collective: every rank must call it once per step)."""
        flag = torch.tensor([1.0 if self.caught else 0.0], device=_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _device() -> torch.device:
    from cooper_mcore.parallel import device

    return device()


def _resume_path(ckpt_dir: str, resume: str) -> str | None:
    """Rank 0 verifies the candidates (reading them once) and tells the others (collective)."""
    from cooper_mcore.train.checkpoint import find_resume

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


def train(cfg: CooperConfig) -> dict[str, float]:
    """Run (or resume) a Cooper training job; return the last step's metrics.

    Faults: ``checkpoint.resume: auto`` continues from the newest checkpoint that verifies against
    its manifest (see :mod:`cooper_mcore.train.checkpoint`). SIGTERM (preemption) is caught; at the
    end of the current step every rank writes a checkpoint and :class:`TrainingStopped` is raised
    with ``EXIT_PREEMPTED`` (75). A step whose policy or RM update is skipped for a non-finite loss
    or gradient norm is logged (``skipped/nonfinite``); after ``train.max_nonfinite_steps`` such
    steps in a row a checkpoint is written and :class:`TrainingStopped` is raised with
    ``EXIT_NONFINITE`` (3).
    """
    from cooper_mcore.metrics import MetricsLogger, ProgressBar, RewardHackingDetector, reduce_metrics
    from cooper_mcore.train.checkpoint import load_training_checkpoint, save_training_checkpoint
    from cooper_mcore.train.faults import FaultPhaseTimer
    from cooper_mcore.train.run_setup import build_run, eval_params

    run = build_run(cfg)
    ckpt_dir = os.path.join(cfg.out, "checkpoints")
    models = {"policy": (run.policy, run.policy_opt, run.policy_sched)}
    if cfg.reward.mode == "cooper":
        models["rm"] = (run.rm, run.rm_opt, run.rm_sched)
    resume = _resume_path(ckpt_dir, cfg.checkpoint.resume)
    streak = 0  # consecutive steps with a skipped (non-finite) update
    if resume:
        state = load_training_checkpoint(resume, models)
        run.step = state["step"]
        run.data.load_state_dict(state["data"])
        streak = state.get("nonfinite_streak", 0)
    else:  # torch is seeded by init_distributed; seed the host RNGs too, so checkpoints are reproducible
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed % 2**32)
    sync(run, version=run.step)
    main = dist.get_rank() == 0
    if main:
        save_config(cfg, os.path.join(cfg.out, "config.yaml"))
    logger_ = MetricsLogger(cfg.out, run_name=cfg.logging.run_name or None, config=_plain(cfg),
                            use_wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, is_main=main)
    timer = FaultPhaseTimer(step=lambda: run.step + 1)
    detector = RewardHackingDetector(window=cfg.logging.hacking_window,
                                     action="stop" if cfg.logging.stop_on_hacking else "warn")
    bar = ProgressBar(cfg.train.steps, start_step=run.step, enabled=main)
    sigterm = _SigtermFlag()

    def checkpoint() -> str:
        return save_training_checkpoint(
            ckpt_dir, run.step, models, {"data": run.data.state_dict(), "nonfinite_streak": streak},
            run.extra["archs"], keep=cfg.checkpoint.keep,
            extra_dirs={"policy": os.path.join(cfg.model.policy_ckpt, "hf_extra"),
                        "rm": os.path.join(cfg.model.rm_ckpt, "hf_extra")})

    metrics: dict[str, float] = {}
    try:
        while run.step < cfg.train.steps:
            prompts = run.data.next_batch()
            metrics = cooper_step(run, prompts, timer)
            run.step += 1
            if cfg.eval.every and run.step % cfg.eval.every == 0:
                with timer.phase("eval"):
                    _engine_memory(run, resume=True)
                    acc = stages.evaluate(run.engine, run.verifier, run.eval_prompts, cfg.eval.k, eval_params(cfg))
                    _engine_memory(run, resume=False)
                metrics["eval/acc"] = stages.broadcast_in_model_parallel_group(acc)
            metrics.update(timer.pop())
            metrics = reduce_metrics(metrics)
            logger_.log(run.step, metrics)
            bar.update(run.step, metrics)
            streak = streak + 1 if metrics["skipped/nonfinite"] > 0 else 0
            if streak:
                logger.warning("step %d: non-finite loss or gradient norm, %d update(s) skipped "
                               "(%d step(s) in a row, the limit is %d)", run.step, int(metrics["skipped/nonfinite"]),
                               streak, cfg.train.max_nonfinite_steps)
            preempted = sigterm.any_rank()
            nonfinite_stop = 0 < cfg.train.max_nonfinite_steps <= streak
            hacking_stop = False
            if cfg.reward.mode != "rule" and detector.update(run.step, metrics["reward/mean"], metrics["rule/acc"]):
                hacking_stop = detector.should_stop
            due = cfg.checkpoint.every and (run.step % cfg.checkpoint.every == 0 or run.step == cfg.train.steps)
            if due or preempted or nonfinite_stop:
                path = checkpoint()
            if preempted:
                raise TrainingStopped(f"preempted (SIGTERM) after step {run.step}: checkpoint {path} written; "
                                      f"run the same command with --resume auto to continue", EXIT_PREEMPTED, path)
            if nonfinite_stop:
                raise TrainingStopped(f"stopping: {streak} steps in a row had a non-finite loss or gradient norm "
                                      f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); checkpoint "
                                      f"{path} written; lower the learning rate or check the data before resuming",
                                      EXIT_NONFINITE, path)
            if hacking_stop:
                logger.error("stopping: reward hacking detected")
                break
    finally:
        sigterm.restore()
        bar.close()
        logger_.close()
        if run.verifier is not None:
            run.verifier.close()
    return metrics


def _plain(cfg: CooperConfig) -> dict[str, Any]:
    from cooper_mcore.config import to_dict

    return to_dict(cfg)

