"""What a Cooper step returns: typed records of its rollouts, its policy update and its
reward-model update (and how far the rollout engine's log-probabilities were from the trainer's), and
the one mapping of them to the metric keys of
:mod:`cooper_mcore.metric_names` (:meth:`StepResult.to_metrics`).

Control decisions read the fields (a skipped update does not step the schedule; the loop counts
steps with skipped updates) or the world's metrics line (:func:`steps_without_signal`: steps in a row
that gave the run nothing to learn from the rule verifier); only :meth:`StepResult.to_metrics` turns
the records into a metrics dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from cooper_mcore.hacking_detector import reward_rule_gap
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.types import PreferencePair


@dataclass(frozen=True)
class EngineAgreement:
    """How far the engine's per-token log-probabilities are from the trainer's, over the world's
    response tokens of one step (the same on every rank).

    Attributes:
        diff_mean: mean ``|engine - trainer|`` (nats).
        diff_max: largest ``|engine - trainer|``.
        kl: k3 estimate of KL(engine || trainer) from the engine's samples.
        tis_weight_mean: mean truncated importance-sampling weight (None without ``algo.tis_cap``).
        tis_capped_frac: share of the tokens whose weight the cap truncated (None without it).
    """

    diff_mean: float
    diff_max: float
    kl: float
    tis_weight_mean: Optional[float] = None
    tis_capped_frac: Optional[float] = None

    def to_metrics(self) -> dict[str, float]:
        """The ``rollout/*`` keys of a metrics line (the TIS ones only with a cap)."""
        m = {K.LOGPROB_DIFF_MEAN: self.diff_mean, K.LOGPROB_DIFF_MAX: self.diff_max, K.LOGPROB_KL: self.kl}
        if self.tis_weight_mean is not None and self.tis_capped_frac is not None:
            m[K.TIS_WEIGHT_MEAN] = self.tis_weight_mean
            m[K.TIS_CAPPED_FRAC] = self.tis_capped_frac
        return m


@dataclass(frozen=True)
class PipelineStats:
    """What the asynchronous rollouts did for one step (this rank's; the engine's times on the model-parallel
    group's leader, 0 elsewhere: the world's maximum is the leader's).

    Attributes:
        staleness_mean / staleness_max: the step minus each rollout's policy version.
        dropped_stale: rollouts over the bound left out (0: generation waits for the version it may use).
        trainer_wait_s: seconds the trainer waited for the step's rollouts.
        engine_idle_s: seconds the engine waited for weights or prompts since the step before.
        weight_push_s: seconds the engine spent receiving weights since the step before.
    """

    staleness_mean: float
    staleness_max: int
    dropped_stale: int = 0
    trainer_wait_s: float = 0.0
    engine_idle_s: float = 0.0
    weight_push_s: float = 0.0

    def to_metrics(self) -> dict[str, float]:
        """The ``rollout/staleness_*``, ``rollout/dropped_stale`` and engine-time keys of a metrics line."""
        return {K.STALENESS_MEAN: self.staleness_mean, K.STALENESS_MAX: float(self.staleness_max),
                K.DROPPED_STALE: float(self.dropped_stale), K.TRAINER_WAIT: self.trainer_wait_s,
                K.ENGINE_IDLE: self.engine_idle_s, K.WEIGHT_PUSH: self.weight_push_s}


@dataclass(frozen=True)
class RolloutStats:
    """This rank's rollouts of one step.

    Attributes:
        reward_mean: mean reward the policy got (the rule's 0/1, or the reward model's).
        rule_acc: share of the rollouts the rule verifier marked correct.
        rule_unverifiable: share of the rollouts the rule verifier could not verify.
        rule_gold_unreadable: share of the prompts whose reference the rule verifier cannot read.
        response_length: mean completion length in tokens.
        rm_reward_correct: mean reward-model reward of the rule-correct rollouts (NaN without one);
            None when no reward model scored them (rule mode).
        rm_reward_wrong: the same for the rule-wrong rollouts.
        engine: the engine's log-probabilities against the trainer's (over the world); None when
            the engine gave none.
    """

    reward_mean: float
    rule_acc: float
    rule_unverifiable: float
    response_length: float
    rule_gold_unreadable: float = 0.0
    rm_reward_correct: Optional[float] = None
    rm_reward_wrong: Optional[float] = None
    engine: Optional[EngineAgreement] = None

    @property
    def reward_rule_gap(self) -> float:
        """:func:`cooper_mcore.hacking_detector.reward_rule_gap` of this step's reward and rule accuracy."""
        return reward_rule_gap(self.reward_mean, self.rule_acc)

    def to_metrics(self) -> dict[str, float]:
        """The rollout keys of a metrics line (the RM's rewards only when a reward model scored them, the
        engine's agreement with the trainer only when it gave log-probabilities)."""
        m = {K.REWARD_MEAN: self.reward_mean, K.RULE_ACC: self.rule_acc, K.REWARD_RULE_GAP: self.reward_rule_gap,
             K.RESPONSE_LENGTH: self.response_length, K.RULE_UNVERIFIABLE: self.rule_unverifiable,
             K.RULE_GOLD_UNREADABLE: self.rule_gold_unreadable}
        if self.rm_reward_correct is not None and self.rm_reward_wrong is not None:
            m[K.RM_REWARD_CORRECT] = self.rm_reward_correct
            m[K.RM_REWARD_WRONG] = self.rm_reward_wrong
        if self.engine is not None:
            m.update(self.engine.to_metrics())
        return m


@dataclass(frozen=True)
class GRPOUpdate:
    """One GRPO optimizer step of the policy (:func:`cooper_mcore.rl.policy.policy_update`): means
    over this rank's response tokens.

    Attributes:
        loss: the GRPO loss (surrogate + KL term - entropy bonus).
        kl: KL to the reference by the loss's estimator (0 without a KL term).
        ratio_mean: importance ratio pi / pi_old.
        clip_frac: share of the tokens the PPO or the dual clip left without gradient.
        entropy: token entropy of the policy.
        grad_norm: the global gradient norm (NaN when the update was skipped).
        nonfinite: the update was skipped because the loss or the gradient norm was not finite
            (the same on every rank).
        moe_aux_loss: the routers' load-balancing loss (mixture-of-experts policies), else None.
    """

    loss: float
    kl: float
    ratio_mean: float
    clip_frac: float
    entropy: float
    grad_norm: float
    nonfinite: bool
    moe_aux_loss: Optional[float] = None


@dataclass(frozen=True)
class PolicyUpdate:
    """The step's policy update: means over its ``train.mini_batches`` :class:`GRPOUpdate` records.

    Attributes:
        loss, kl, ratio_mean, clip_frac, entropy, grad_norm: means over the updates.
        skipped: updates skipped for a non-finite loss or gradient norm.
        lr: the learning rate after the updates (and the schedule's steps).
        moe_aux_loss: the mean of the updates' load-balancing losses (mixture-of-experts
            policies), else None.
    """

    loss: float
    kl: float
    ratio_mean: float
    clip_frac: float
    entropy: float
    grad_norm: float
    skipped: int
    lr: float
    moe_aux_loss: Optional[float] = None

    @classmethod
    def mean_of(cls, updates: Sequence[GRPOUpdate], lr: float) -> PolicyUpdate:
        """The mean of ``updates`` (one or more), the number skipped, and the learning rate ``lr``."""
        def mean(values: Iterable[float]) -> float:
            return sum(values) / len(updates)

        return cls(loss=mean(u.loss for u in updates), kl=mean(u.kl for u in updates),
                   ratio_mean=mean(u.ratio_mean for u in updates), clip_frac=mean(u.clip_frac for u in updates),
                   entropy=mean(u.entropy for u in updates), grad_norm=mean(u.grad_norm for u in updates),
                   skipped=sum(u.nonfinite for u in updates), lr=lr,
                   moe_aux_loss=None if updates[0].moe_aux_loss is None else mean(u.moe_aux_loss for u in updates))

    def to_metrics(self) -> dict[str, float]:
        """The policy keys of a metrics line, but ``skipped/nonfinite`` (:meth:`StepResult.to_metrics`)."""
        m = {K.LOSS: self.loss, K.KL: self.kl, K.RATIO_MEAN: self.ratio_mean, K.CLIP_FRAC: self.clip_frac,
             K.ENTROPY: self.entropy, K.GRAD_NORM: self.grad_norm, K.LR: self.lr}
        if self.moe_aux_loss is not None:
            m[K.MOE_AUX_LOSS] = self.moe_aux_loss
        return m


@dataclass(frozen=True)
class PairCounts:
    """The step's preference pairs, counted (the same on every rank of a model-parallel group).

    Attributes:
        valid: pairs with a positive and a negative.
        no_positive: prompts without a rule-correct rollout.
        no_negative: prompts with a positive but no negative (failures included).
        assistant_failed: prompts whose negative's generator failed (the assistant endpoint).
    """

    valid: int
    no_positive: int
    no_negative: int
    assistant_failed: int

    def to_metrics(self) -> dict[str, float]:
        """The ``pairs/*`` keys of a metrics line."""
        return {K.PAIRS_VALID: float(self.valid), K.PAIRS_NO_POSITIVE: float(self.no_positive),
                K.PAIRS_NO_NEGATIVE: float(self.no_negative), K.PAIRS_ASSISTANT_FAILED: float(self.assistant_failed)}


@dataclass(frozen=True)
class RMUpdate:
    """The reward model's pairwise update of one step (global over the ranks).

    Attributes:
        loss: the RM's loss (pairwise + weighted anchor); 0 without a valid pair.
        pairwise_loss: the pairwise term.
        anchor_loss: the anchor term, unweighted.
        pair_acc: share of the valid pairs ordered right (NaN without one).
        threshold_acc: share of the pairs' rows on the right side of logit 0 (NaN without one).
        nonfinite: the update was skipped because the loss or the gradient norm was not finite.
        pair_counts: the step's pairs, counted.
        moe_aux_loss: the routers' load-balancing loss (mixture-of-experts RMs; None when no pair
            was valid or the RM is dense).
    """

    loss: float
    pairwise_loss: float
    anchor_loss: float
    pair_acc: float
    threshold_acc: float
    nonfinite: bool
    pair_counts: PairCounts
    moe_aux_loss: Optional[float] = None

    def to_metrics(self) -> dict[str, float]:
        """The ``rm/*`` and ``pairs/*`` keys of a metrics line."""
        m = {K.RM_LOSS: self.loss, K.RM_PAIRWISE_LOSS: self.pairwise_loss, K.RM_ANCHOR_LOSS: self.anchor_loss,
             K.RM_PAIR_ACC: self.pair_acc, K.RM_THRESHOLD_ACC: self.threshold_acc, **self.pair_counts.to_metrics()}
        if self.moe_aux_loss is not None:
            m[K.RM_MOE_AUX_LOSS] = self.moe_aux_loss
        return m


@dataclass(frozen=True)
class StepResult:
    """One Cooper step on this rank (:func:`cooper_mcore.rl.step.cooper_step`).

    Attributes:
        rollouts: the rollouts' statistics.
        policy: the policy's update.
        rm: the reward model's update; None when the reward model is not trained (rule, static_rm).
        pairs: the preference pairs the reward model was trained on (empty without an RM update).
        pipeline: what the asynchronous rollouts did (None with a colocated engine).
    """

    rollouts: RolloutStats
    policy: PolicyUpdate
    rm: Optional[RMUpdate] = None
    pairs: list[PreferencePair] = field(default_factory=list)
    pipeline: Optional[PipelineStats] = None

    @property
    def skipped_updates(self) -> int:
        """Updates skipped this step for a non-finite loss or gradient norm (the policy's and the RM's)."""
        return self.policy.skipped + (1 if self.rm is not None and self.rm.nonfinite else 0)

    def to_metrics(self) -> dict[str, float]:
        """This step's metrics line (this rank's values), keyed by :mod:`cooper_mcore.metric_names`."""
        metrics = {**self.policy.to_metrics(), K.SKIPPED_NONFINITE: float(self.skipped_updates)}
        if self.rm is not None:
            metrics.update(self.rm.to_metrics())
        metrics.update(self.rollouts.to_metrics())
        if self.pipeline is not None:
            metrics.update(self.pipeline.to_metrics())
        return metrics


def no_rule_signal(rule_unverifiable: float, rule_trains: bool) -> bool:
    """Whether a step gave the run nothing to learn from the rule verifier: the rule drives the training
    (``rule_trains``: reward.mode rule, where its verdict is the reward, or cooper, where it picks the reward
    model's positives) and not one rollout of the world got a verdict (``rule_unverifiable``, the world's
    ``rule/unverifiable``, is 1: every reference unreadable, or every item timed out). Rollouts all judged
    wrong (a policy that is always wrong) or all right (one already perfect) are verdicts, not their absence.
    """
    return rule_trains and rule_unverifiable >= 1.0


def steps_without_signal(count: int, metrics: Mapping[str, float], rule_trains: bool) -> int:
    """Steps in a row with :func:`no_rule_signal`, after the step whose world metrics line is ``metrics``
    (every rank counts the same: the line is the world's)."""
    return count + 1 if no_rule_signal(metrics[K.RULE_UNVERIFIABLE], rule_trains) else 0


def no_signal_message(count: int, metrics: Mapping[str, float], uses_rm: bool, train_path: str,
                      checkpoint: Optional[str]) -> str:
    """The one line a run stopped by :func:`steps_without_signal` ends with: how long, why (the share of the
    last step's prompts whose reference the rule cannot read), what it costs in this reward mode, the
    checkpoint kept and what to do."""
    lost = ("the reward model gets no preference pair (no positive can be verified), so it never learns"
            if uses_rm else "reward.mode=rule has no reward to train on")
    unreadable = metrics[K.RULE_GOLD_UNREADABLE]
    why = f"{unreadable:.0%} of the last step's prompts have a reference the rule verifier cannot read"
    if unreadable < 1.0:
        why += ", the other rollouts timed out or failed in the verifier"
    return (f"stopping: {count} steps in a row without a rule verdict on any rollout ({why}): {lost}; checkpoint "
            f"{checkpoint or '(none)'} kept; check the references of data.train_path {train_path} (`cooper verify`), "
            "or set train.max_steps_without_signal=0 to train on")
