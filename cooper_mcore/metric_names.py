"""The trainers' metric schema: every key ``cooper train`` (and ``cooper train-rm``, in its own
section) writes to ``metrics.jsonl`` (and wandb), named once here with a one-line description.

Code refers to the constants (:class:`MetricKey`, :class:`Phase`, :func:`time_key`,
:func:`memory_key`), never to the strings; :data:`SCHEMA` lists every key with where it is written
and what it means, and :func:`render_page` renders it as ``docs/metrics.md`` (a unit test keeps the
checked-in page equal to the rendering)::

    python -m cooper_mcore.metric_names > docs/metrics.md

This module is at the bottom of the import order: it imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MEMORY_PREFIX", "SCHEMA", "SECTIONS", "TIME_PREFIX", "Metric", "MetricKey", "Phase", "memory_key",
           "render_page", "time_key"]

#: the prefix of a phase's wall seconds (the slowest rank's; :func:`time_key`)
TIME_PREFIX = "time/"
#: the prefix of a phase's peak GPU memory (the fullest rank's; :func:`memory_key`)
MEMORY_PREFIX = "memory/"

#: the page's sections, in order: title and what the section's keys have in common
SECTIONS = {
    "run": ("Run", "the loop's own keys"),
    "rollouts": ("Rollouts", "this step's rollouts: means over the step's rollouts"),
    "policy": ("Policy update", "the GRPO update: token means over the response tokens, means over the step's "
                                "`train.mini_batches` updates"),
    "rm": ("Reward-model update", "the reward model's pairwise update on the step's preference pairs "
                                  "(`reward.mode: cooper`)"),
    "async": ("Asynchronous rollouts", "with `rollout.placement: disaggregated`: rollouts generated ahead by an engine "
                                       "apart from the trainer, at most `rollout.max_staleness` policy versions old "
                                       "(docs/async.md)"),
    "eval": ("Evaluation", "on the steps that evaluate (every `eval.every` steps): held-out avg@k at the eval "
                           "sampling (temperature 0.7, top-p 0.95 by default), split across the data-parallel "
                           "replicas, counted over the world"),
    "verify_rm": ("VerifyRM training", "`cooper train-rm`'s `<out>/metrics.jsonl`: a line per training step "
                                       "(`rm_train/*`) and a line per evaluation (`rm_eval/*`, step 0: before "
                                       "training); over the world"),
    "timing": ("Timing and memory", "per phase of the step (`metrics.PhaseTimer`); `time/*` are the slowest "
                                    "rank's, `memory/*` the fullest rank's"),
}


@dataclass(frozen=True)
class Metric:
    """One key of a ``metrics.jsonl`` line.

    Attributes:
        key: the key as written.
        section: its section of :data:`SECTIONS`.
        written: when a line holds it (every step, a reward mode, the evaluation steps, a GPU).
        description: what it means, in one line.
    """

    key: str
    section: str
    written: str
    description: str


_SCHEMA: list[Metric] = []
_EVERY = "every step"
_RM = "reward.mode static_rm, cooper"
_COOPER = "reward.mode cooper"
_MOE = "mixture-of-experts models"
_ASYNC = "every step, rollout.placement disaggregated"
_ENGINE_LOGPROBS = "every step (when the engine returns log-probabilities: both engines do)"


def _define(key: str, section: str, written: str, description: str) -> str:
    """Add `key` to the schema and return it (so that each key is spelled once, where it is described)."""
    if section not in SECTIONS:
        raise ValueError(f"unknown section {section!r} of metric {key!r}")
    if any(m.key == key for m in _SCHEMA):
        raise ValueError(f"metric {key!r} defined twice")
    _SCHEMA.append(Metric(key, section, written, description))
    return key


class MetricKey:
    """The keys of a ``metrics.jsonl`` line; the per-phase ``time/*`` and ``memory/*`` keys come from
    :func:`time_key` and :func:`memory_key`."""

    STEP = _define("step", "run", "every line", "finished steps; the first key of each line (not a metric)")

    REWARD_MEAN = _define("reward/mean", "rollouts", _EVERY,
                          "the policy's reward: the rule's 0/1 (rule) or the reward model's (static_rm, cooper)")
    RULE_ACC = _define("rule/acc", "rollouts", _EVERY, "share of the rollouts math-verify marks correct")
    RULE_UNVERIFIABLE = _define("rule/unverifiable", "rollouts", _EVERY,
                                "share of the rollouts math-verify could not verify; `train.max_steps_without_signal` "
                                "steps in a row at 1 stop a rule or cooper run (exit code 2)")
    RULE_GOLD_UNREADABLE = _define("rule/gold_unreadable", "rollouts", _EVERY,
                                   "share of the step's prompts whose reference answer math-verify cannot read as a "
                                   "value (counted when one of their rollouts is unverifiable for it): those rollouts "
                                   "are unverifiable (no positive, no negative; rule reward "
                                   "`reward.unverifiable_reward`); one math-verify matches with the reference as "
                                   "written (the same string) is right")
    REWARD_RULE_GAP = _define("reward_rule_gap", "rollouts", _EVERY,
                              "`reward/mean - rule/acc` (`hacking_detector.reward_rule_gap`); it grows "
                              "when the policy hacks the reward model")
    RESPONSE_LENGTH = _define("response/length", "rollouts", _EVERY, "tokens per completion")
    RM_REWARD_CORRECT = _define("rm/reward_correct", "rollouts", _RM,
                                "mean reward-model reward of the rule-correct rollouts (NaN without one)")
    RM_REWARD_WRONG = _define("rm/reward_wrong", "rollouts", _RM,
                              "mean reward-model reward of the rule-wrong rollouts (NaN without one; unverifiable "
                              "ones are in neither mean)")
    LOGPROB_DIFF_MEAN = _define("rollout/logprob_diff_mean", "rollouts", _ENGINE_LOGPROBS,
                                "mean |engine - trainer| log-probability of the response tokens (nats; the "
                                "trainer's before the update); far above bf16 rounding: the engine's weights are "
                                "not the policy's (the first step stops above `algo.logprob_diff_guard`)")
    LOGPROB_DIFF_MAX = _define("rollout/logprob_diff_max", "rollouts", _ENGINE_LOGPROBS,
                               "largest |engine - trainer| log-probability of a response token, over the world")
    LOGPROB_KL = _define("rollout/logprob_kl", "rollouts", _ENGINE_LOGPROBS,
                         "k3 estimate of KL(engine || trainer) from the engine's samples: mean of "
                         "r - 1 - log r, r = exp(trainer - engine)")
    TIS_WEIGHT_MEAN = _define("rollout/tis_weight_mean", "rollouts", "algo.tis_cap set",
                              "mean truncated importance-sampling weight min(exp(trainer - engine), "
                              "`algo.tis_cap`) of the response tokens")
    TIS_CAPPED_FRAC = _define("rollout/tis_capped_frac", "rollouts", "algo.tis_cap set",
                              "share of the response tokens whose importance weight the cap truncated")

    STALENESS_MEAN = _define("rollout/staleness_mean", "async", _ASYNC,
                             "mean over the step's rollouts of the step minus the policy version that generated them")
    STALENESS_MAX = _define("rollout/staleness_max", "async", _ASYNC,
                            "largest staleness of the step's rollouts, over the world (never above "
                            "`rollout.max_staleness`)")
    DROPPED_STALE = _define("rollout/dropped_stale", "async", _ASYNC,
                            "rollouts left out for being older than the bound: 0, generation waits for the policy "
                            "version each step may use")
    TRAINER_WAIT = _define(TIME_PREFIX + "trainer_wait", "async", _ASYNC,
                           "seconds the trainer waited for the step's rollouts (within `time/rollout`)")
    ENGINE_IDLE = _define(TIME_PREFIX + "engine_idle", "async", _ASYNC,
                          "seconds the engine waited for weights or prompts since the step before")
    WEIGHT_PUSH = _define(TIME_PREFIX + "weight_push", "async", _ASYNC,
                          "seconds the engine spent receiving weights over its weight group since the step before "
                          "(beside training; the trainer's part is `time/weight_sync`)")

    LOSS = _define("loss", "policy", _EVERY, "the GRPO loss (clipped surrogate + KL term - entropy bonus)")
    KL = _define("kl", "policy", _EVERY, "KL of the policy to the reference by `algo.kl_kind` (0 with "
                                         "`algo.kl_coef` 0)")
    RATIO_MEAN = _define("ratio/mean", "policy", _EVERY, "importance ratio pi / pi_old of the sampled tokens")
    CLIP_FRAC = _define("clip_frac", "policy", _EVERY,
                        "share of the tokens the PPO clip or the dual clip leaves without gradient")
    ENTROPY = _define("entropy", "policy", _EVERY, "token entropy of the policy on the responses")
    GRAD_NORM = _define("grad_norm", "policy", _EVERY,
                        "the policy's global gradient norm before clipping (NaN for a skipped update)")
    LR = _define("lr", "policy", _EVERY, "the policy's learning rate after the step's updates")
    MOE_AUX_LOSS = _define("moe_aux_loss", "policy", _MOE,
                           "the routers' load-balancing loss (coef x sum over sparse layers of E sum_i f_i P_i, "
                           "mean over micro-batches; `train.moe_aux`)")
    SKIPPED_NONFINITE = _define("skipped/nonfinite", "policy", _EVERY,
                                "updates (policy mini-batches + the RM's) skipped for a non-finite loss or "
                                "gradient norm; `train.max_nonfinite_steps` such steps in a row stop the run")

    RM_LOSS = _define("rm/loss", "rm", _COOPER, "the RM's loss: pairwise loss + `rm.anchor_weight` x anchor")
    RM_PAIRWISE_LOSS = _define("rm/pairwise_loss", "rm", _COOPER, "the pairwise loss -logsigmoid(s_pos - s_neg)")
    RM_MOE_AUX_LOSS = _define("rm/moe_aux_loss", "rm", f"{_COOPER}, mixture-of-experts RM",
                              "the RM routers' load-balancing loss, as `moe_aux_loss` (not on a step without "
                              "a valid pair)")
    RM_ANCHOR_LOSS = _define("rm/anchor_loss", "rm", _COOPER,
                             "the calibration anchor (BCE on each pair's own labels, unweighted)")
    RM_PAIR_ACC = _define("rm/pair_acc", "rm", _COOPER,
                          "share of the valid pairs the RM orders right (s_pos > s_neg; NaN without a valid pair)")
    RM_THRESHOLD_ACC = _define("rm/threshold_acc", "rm", _COOPER,
                               "share of the pairs' rows on the right side of logit 0 (NaN without a valid pair)")
    PAIRS_VALID = _define("pairs/valid", "rm", _COOPER, "preference pairs with a positive and a negative; "
                                                        "`train.max_steps_without_pairs` steps in a row without "
                                                        "one give a warning")
    PAIRS_NO_POSITIVE = _define("pairs/no_positive", "rm", _COOPER, "prompts without a rule-correct rollout")
    PAIRS_NO_NEGATIVE = _define("pairs/no_negative", "rm", _COOPER,
                                "prompts with a positive but no negative (assistant failures included)")
    PAIRS_ASSISTANT_FAILED = _define("pairs/assistant_failed", "rm", _COOPER,
                                     "prompts whose assistant request failed after its retries (masked)")

    DATA_SKIPPED_TOO_LONG = _define("data/skipped_too_long", "run", _EVERY,
                                    "training prompts left out at start-up: prompt + `rollout.max_new_tokens` "
                                    "exceeds the policy's `max_position_embeddings` (a warning names how many and "
                                    "the first ids)")

    EVAL_ACC = _define("eval/acc", "eval", "evaluation steps",
                       "held-out avg@k by `eval.verifier`: the rule verifier, or `arithmetic_oracle` (the arithmetic "
                       "task's truth, which also reads answers math-verify does not, such as `\\boxed{14.}`)")
    EVAL_RULE_ACC = _define("eval/rule_acc", "eval", "evaluation steps, eval.verifier arithmetic_oracle",
                            "the rule verifier's held-out accuracy on the same completions")

    RM_TRAIN_LOSS = _define("rm_train/loss", "verify_rm", _EVERY, "mean binary cross-entropy of the step's rows")
    RM_TRAIN_ACC = _define("rm_train/acc", "verify_rm", _EVERY,
                           "share of the step's rows on the right side of logit 0")
    RM_TRAIN_MEAN_SCORE = _define("rm_train/mean_score", "verify_rm", _EVERY, "mean logit of the step's rows")
    RM_TRAIN_NUM_SAMPLES = _define("rm_train/num_samples", "verify_rm", _EVERY,
                                   "rows of the step (the last batch of an epoch may be short)")
    RM_TRAIN_GRAD_NORM = _define("rm_train/grad_norm", "verify_rm", _EVERY,
                                 "global gradient norm before clipping (NaN for a skipped update)")
    RM_TRAIN_MOE_AUX_LOSS = _define("rm_train/moe_aux_loss", "verify_rm", _MOE,
                                    "the RM routers' load-balancing loss, as `moe_aux_loss`")
    RM_TRAIN_NONFINITE = _define("rm_train/nonfinite", "verify_rm", _EVERY,
                                 "1 when the update was skipped for a non-finite loss or gradient norm")
    RM_TRAIN_LR = _define("rm_train/lr", "verify_rm", _EVERY, "the learning rate (constant)")
    RM_TRAIN_SECONDS = _define("rm_train/seconds", "verify_rm", _EVERY, "wall seconds of the step")
    RM_EPOCH = _define("rm/epoch", "verify_rm", "every line", "epochs done, fractional within an epoch")
    RM_EVAL_ACCURACY = _define("rm_eval/accuracy", "verify_rm", "evaluation lines",
                               "share of the evaluation rows judged right at `train.threshold`")
    RM_EVAL_N = _define("rm_eval/n", "verify_rm", "evaluation lines", "evaluation rows")
    RM_EVAL_MEAN_PROB = _define("rm_eval/mean_prob", "verify_rm", "evaluation lines",
                                "mean sigmoid of the logits of the evaluation rows")
    RM_EVAL_ACC_CORRECT = _define("rm_eval/acc_correct", "verify_rm", "evaluation lines",
                                  "accuracy on the rows labeled correct (null without one)")
    RM_EVAL_ACC_INCORRECT = _define("rm_eval/acc_incorrect", "verify_rm", "evaluation lines",
                                    "accuracy on the rows labeled incorrect (null without one)")

    TIME_STEP = _define(TIME_PREFIX + "step", "timing", _EVERY, "seconds of the step: the sum of its outermost "
                                                                "phases")


class Phase:
    """The timed phases of a step: ``with timer.phase(Phase.ROLLOUT)`` writes ``time/rollout`` (and,
    on a GPU, ``memory/rollout``); the names are also ``COOPER_FAULT``'s fault points."""

    OFFLOAD = "offload"
    WEIGHT_SYNC = "weight_sync"
    ROLLOUT = "rollout"
    RM_SCORE = "rm_score"
    LOGPROBS = "logprobs"
    POLICY_UPDATE = "policy_update"
    RM_UPDATE = "rm_update"
    NEGATIVES = "negatives"
    EVAL = "eval"


_PHASES = (
    (Phase.OFFLOAD, _EVERY, "moving training state to and from host memory around each generation"),
    (Phase.WEIGHT_SYNC, "steps that push weights", "pushing the policy's new weights into the rollout engine"),
    (Phase.ROLLOUT, _EVERY, "generating the rollouts and verifying them by the rule"),
    (Phase.RM_SCORE, _EVERY, "scoring the rollouts with the reward model (none in rule mode)"),
    (Phase.LOGPROBS, _EVERY, "the old (and, with a KL term, the reference) log-probabilities"),
    (Phase.POLICY_UPDATE, _EVERY, "the policy's GRPO update"),
    (Phase.RM_UPDATE, _COOPER, "building the preference pairs and the reward model's update"),
    (Phase.NEGATIVES, _COOPER, "building the preference pairs (the negatives: assistant requests or the CPU "
                               "generators), within rm_update"),
    (Phase.EVAL, "evaluation steps", "the held-out evaluation"),
)


def time_key(phase: str) -> str:
    """`time/<phase>`: the phase's wall seconds this step."""
    return TIME_PREFIX + phase


def memory_key(phase: str) -> str:
    """`memory/<phase>`: the phase's peak allocated GPU memory this step, GiB."""
    return MEMORY_PREFIX + phase


for _phase, _written, _what in _PHASES:
    _define(time_key(_phase), "timing", _written, f"seconds: {_what}")
for _phase, _written, _what in _PHASES:
    _define(memory_key(_phase), "timing", f"{_written}, on a GPU", f"peak GiB (torch.cuda.max_memory_allocated): "
                                                                  f"{_what}")

#: every key of a `metrics.jsonl` line, by key
SCHEMA: dict[str, Metric] = {m.key: m for m in _SCHEMA}


def render_page() -> str:
    """`docs/metrics.md`: one table per section of :data:`SCHEMA`."""
    lines = ["# Metrics reference", "",
             "<!-- generated from cooper_mcore/metric_names.py by "
             "`python -m cooper_mcore.metric_names > docs/metrics.md`; do not edit -->", "",
             "Every key `cooper train` (and `cooper train-rm`, in its own section) writes to `<out>/metrics.jsonl`, "
             "one JSON object per step (and to wandb). "
             "Values are means over the data-parallel ranks unless said otherwise; a non-finite value is written "
             "as `null`. The keys are named once, in `cooper_mcore/metric_names.py`: code refers to its "
             "constants.", ""]
    for section, (title, about) in SECTIONS.items():
        lines += [f"## {title}", "", about[0].upper() + about[1:] + ".", "", "| key | written | meaning |",
                  "|---|---|---|"]
        lines += [f"| `{m.key}` | {m.written} | {m.description} |" for m in _SCHEMA if m.section == section]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_page(), end="")
