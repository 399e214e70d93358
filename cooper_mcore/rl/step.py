"""One Cooper step, top to bottom.

rollouts (G per prompt, verified by the rule) -> rewards (the RM's, or the rule's) -> group
advantages -> old and reference log-probabilities (the engine's checked against the old ones:
:mod:`cooper_mcore.rl.engine_check`) -> GRPO update of the policy -> the reward model's pairwise
update on this step's pairs (cooper mode) -> a :class:`~cooper_mcore.rl.results.StepResult` (its
:meth:`~cooper_mcore.rl.results.StepResult.to_metrics` is the step's metrics line).

As in the reference implementation, the policy step of step t uses the RM before its step-t
update. The new policy weights reach the engine at the start of the next generation
(:mod:`cooper_mcore.rl.colocate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Optional

import torch

from cooper_mcore.algo import group_advantages, reward_from_logits
from cooper_mcore.data.tokenizer import pad_id_of
from cooper_mcore.metric_names import Phase
from cooper_mcore.metrics import PhaseTimer
from cooper_mcore.models.routing_replay import replaying, route_batch
from cooper_mcore.rl.engine_check import check_engine, engine_agreement
from cooper_mcore.rl.policy import GRPOLoss, policy_update
from cooper_mcore.rl.results import EngineAgreement, PipelineStats, PolicyUpdate, RolloutStats, StepResult
from cooper_mcore.rl.rm_update import make_pairs, update_reward_model
from cooper_mcore.rl.rollouts import generate_groups, share_routes
from cooper_mcore.rl.scoring import rollout_logits, rule_rewards, rule_verdicts
from cooper_mcore.rl.setup import Run
from cooper_mcore.train.tokens import TokenBatch, build_token_batch, compute_logprobs
from cooper_mcore.types import Prompt, RolloutGroup


def cooper_step(run: Run, prompts: Optional[Sequence[Prompt]], timer: PhaseTimer) -> StepResult:
    """One Cooper step on this data-parallel rank's ``prompts`` (None: the rollouts the pipeline generated
    ahead for this step); returns what it did (this rank's)."""
    cfg = run.cfg
    groups, pipeline = rollout_groups(run, prompts, timer)
    with timer.phase(Phase.RM_SCORE):
        logits = rollout_logits(run.rm, groups, cfg, run.batching) if run.rm is not None else None
    rewards = (reward_from_logits(logits, cfg.reward.rm_transform) if logits is not None
               else rule_rewards(groups, cfg.reward.unverifiable_reward))
    record_rewards(groups, rewards)
    advantages = group_advantages(rewards, eps=cfg.algo.adv_eps, std_floor=cfg.algo.adv_std_floor)
    batch = policy_batch(run, groups, advantages)
    routes = rollout_routes(run, groups, batch)
    with timer.phase(Phase.LOGPROBS):
        fill_logprobs(run, batch, routes)
        agreement = engine_agreement(batch, cfg.algo.tis_cap)
    check_engine(agreement, cfg.algo, run.step + 1, first=not run.engine_checked)
    run.engine_checked = True
    with timer.phase(Phase.POLICY_UPDATE):
        policy = update_policy(run, batch, routes)
    rm_step, pairs = None, []
    if cfg.reward.mode.trains_rm:
        with timer.phase(Phase.RM_UPDATE):
            with timer.phase(Phase.NEGATIVES):
                pairs = make_pairs(groups, logits, cfg.rm, run.verifier, run.assistant, seed=cfg.train.seed + run.step)
            rm_step = update_reward_model(run.rm, pairs, cfg, run.batching)
    return StepResult(rollout_stats(groups, rewards, run, agreement), policy, rm_step, pairs, pipeline)


def rollout_groups(run: Run, prompts: Optional[Sequence[Prompt]],
                   timer: PhaseTimer) -> tuple[list[RolloutGroup], Optional[PipelineStats]]:
    """The step's rollouts: generated now by the colocated engine from ``prompts`` (with routing replay, the
    routes shared once the engine has released its memory: NCCL broadcasts use the device's), or (``prompts``
    None) taken from the pipeline with its staleness and waits."""
    if prompts is None:
        assert run.pipeline is not None
        with timer.phase(Phase.ROLLOUT):
            return run.pipeline.take(run.step)
    cfg = run.cfg
    with run.colocation.generating(version=run.step, timer=timer) as engine:
        with timer.phase(Phase.ROLLOUT):
            groups = generate_groups(engine, run.verifier, prompts, cfg.rollout.group_size,
                                     run.rollout_sampling(run.step), run.step)
    if cfg.model.moe_routing_replay:
        with timer.phase(Phase.ROLLOUT):
            share_routes(groups)
    return groups, None


def record_rewards(groups: Sequence[RolloutGroup], rewards: torch.Tensor) -> None:
    """Set each sample's :attr:`~cooper_mcore.types.Sample.reward` to the reward of the policy's update."""
    for group, row in zip(groups, rewards.tolist()):
        for sample, reward in zip(group.samples, row):
            sample.reward = float(reward)


def policy_batch(run: Run, groups: Sequence[RolloutGroup], advantages: torch.Tensor) -> TokenBatch:
    """The step's ``prompt + response`` sequences with their advantages, and the engine's
    log-probabilities of the responses when it gave them for every rollout."""
    samples = [s for g in groups for s in g.samples]
    engine = [s.logprobs for s in samples]
    batch = build_token_batch([g.prompt.token_ids for g in groups for _ in g.samples], [s.token_ids for s in samples],
                              pad_id_of(run.policy.tokenizer),
                              response_logprobs=engine if all(x is not None for x in engine) else None)
    batch.advantages = advantages.flatten()
    return batch


def rollout_routes(run: Run, groups: Sequence[RolloutGroup], batch: TokenBatch) -> Optional[torch.Tensor]:
    """With ``model.moe_routing_replay``, the engine's routed experts of the batch's rows
    ``[N, S, layers, top_k]`` (:func:`~cooper_mcore.models.routing_replay.route_batch`); else None."""
    if not run.cfg.model.moe_routing_replay:
        return None
    arch = run.policy.arch
    return route_batch([s.routed_experts for g in groups for s in g.samples], batch.input_ids.shape[1],
                       arch.num_layers, arch.moe.experts_per_token)


def fill_logprobs(run: Run, batch: TokenBatch, routes: Optional[torch.Tensor] = None) -> None:
    """The old policy's log-probabilities, and the reference's when the KL term is on (replaying
    ``routes``, the rollout's routing, when given)."""
    chunk = run.cfg.train.logprob_chunk_tokens
    with replaying(run.policy.module, routes):
        batch.old_logp = compute_logprobs(run.policy.module, batch, run.batching, chunk)
        if run.reference is not None:
            with run.reference.swapped():
                batch.ref_logp = compute_logprobs(run.policy.module, batch, run.batching, chunk)


def update_policy(run: Run, batch: TokenBatch, routes: Optional[torch.Tensor] = None) -> PolicyUpdate:
    """``train.mini_batches`` GRPO updates on consecutive slices of the batch (replaying ``routes`` when
    given); a skipped (non-finite) update does not advance the schedule, as in megatron."""
    cfg, policy = run.cfg, run.policy
    loss = GRPOLoss(clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high, clip_ratio_c=cfg.algo.clip_ratio_c,
                    kl_coef=cfg.algo.kl_coef, kl_kind=cfg.algo.kl_kind, entropy_coef=cfg.algo.entropy_coef,
                    tis_cap=cfg.algo.tis_cap, chunk_tokens=cfg.train.logprob_chunk_tokens)
    per_mini = len(batch) // cfg.train.mini_batches
    updates = []
    for i in range(cfg.train.mini_batches):
        rows = slice(i * per_mini, (i + 1) * per_mini)
        with contextlib.nullcontext() if routes is None else replaying(policy.module, routes[rows]):
            u = policy_update(policy.ddp, policy.optimizer, batch.slice(rows.start, rows.stop), run.batching, loss)
        if not u.nonfinite:
            policy.scheduler.step(1)
        updates.append(u)
    return PolicyUpdate.mean_of(updates, lr=float(policy.optimizer.param_groups[0]["lr"]))


def rollout_stats(groups: Sequence[RolloutGroup], rewards: torch.Tensor, run: Run,
                  engine: Optional[EngineAgreement] = None) -> RolloutStats:
    """Reward, rule accuracy, unverifiable rollouts and unreadable references, lengths, (RM modes) the
    reward of right and wrong rollouts, and the engine's agreement with the trainer."""
    samples = [s for g in groups for s in g.samples]
    flat = rewards.flatten().tolist()
    scored = run.rm is not None
    return RolloutStats(
        reward_mean=float(rewards.mean()), rule_acc=float(rule_verdicts(groups).flatten().mean()),
        rule_unverifiable=sum(s.rule_correct is None for s in samples) / len(samples),
        rule_gold_unreadable=sum(g.gold_unreadable for g in groups) / len(groups),
        response_length=sum(len(s.token_ids) for s in samples) / len(samples),
        rm_reward_correct=_mean([r for r, s in zip(flat, samples) if s.rule_correct is True]) if scored else None,
        rm_reward_wrong=_mean([r for r, s in zip(flat, samples) if s.rule_correct is False]) if scored else None,
        engine=engine)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
