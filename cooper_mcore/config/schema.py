"""Typed configuration of the training jobs: one dataclass section per component.

Three jobs have a config here: a Cooper run (:class:`CooperConfig`, ``cooper train``), SFT of a
policy (:class:`SFTConfig`, ``cooper sft``) and VerifyRM training (:class:`VerifyRMConfig`,
``cooper train-rm``); :data:`JOB_CONFIGS` names them for ``cooper config --job``. They share the
sections that mean the same thing (the parallel layout, the optimizer). A job's config is built
from the defaults below, a YAML preset (``examples/*.yaml``, ``examples/jobs/*.yaml``) and
command-line overrides in dotted form (``algo.kl_coef=0.01 rollout.group_size=8``), merged with
OmegaConf's structured configs, so types are checked and unknown keys are errors. Each part of
the trainer receives only its own section. :func:`cooper_mcore.config.checks.validate` rejects impossible
settings before any work starts.
"""

from __future__ import annotations

import ast
import difflib
import errno
import functools
import inspect
import json
import os
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Literal, Optional, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from cooper_mcore.config.presets import resolve_preset
from cooper_mcore.config.versions import newest_config
from cooper_mcore.parallel_layout import ParallelConfig
from cooper_mcore.redaction import scrub_config

T = TypeVar("T")
Dtype = Literal["float32", "bfloat16"]
#: the KL estimators of :func:`cooper_mcore.algo.kl_penalty` (a test keeps them equal to ``KL_ESTIMATORS``)
KLKind = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
#: the negative generators of :func:`cooper_mcore.negatives.pairs.make_negative_generator` (tested equal)
NegativeKind = Literal["assistant", "policy", "rewrite", "perturb", "random"]
RewriteKind = Literal["step", "copy", "final"]
FailureAction = Literal["mask", "stop"]
EngineKind = Literal["hf", "sglang"]
Placement = Literal["colocated", "disaggregated"]
#: where a run's model weights come from (``model.init``)
ModelInit = Literal["checkpoint", "random"]
RMQuestion = Literal["prompt", "question"]
#: the checkers of held-out accuracy (``eval.verifier``; :func:`cooper_mcore.rl.setup.build_eval_oracle`)
EvalVerifier = Literal["rule", "arithmetic_oracle"]
#: the final-answer styles of the arithmetic task (:data:`cooper_mcore.data.mathgen.STYLES`; tested equal)
AnswerStyle = Literal["boxed", "gsm8k", "boxed_period"]
#: the evaluation-data formats of :func:`cooper_mcore.data.rm_data.read_eval_examples`
RMEvalFormat = Literal["auto", "labeled", "verifybench"]
# The choices below are the library's own (named in each comment; a test keeps each equal to it), written
# here so that the configs load without torch: `cooper config KEY` answers at once.
#: the transforms of :func:`cooper_mcore.algo.reward_from_logits` (``RewardTransform``)
RewardTransform = Literal["sigmoid", "sigmoid_bf16", "binary"]
#: the picks of :func:`cooper_mcore.algo.pairs.select_positives` (``PositivePick``)
PositivePick = Literal["first", "hardest", "random"]
#: the picks of :func:`cooper_mcore.algo.pairs.select_negatives` (``NegativePick``)
NegativePick = Literal["hardest", "random", "first"]
#: the requests of :mod:`cooper_mcore.negatives.assistant` (``AssistantPrompt``)
AssistantPrompt = Literal["reference", "with_gold"]
#: the answer forms of :mod:`cooper_mcore.negatives.rewrites` (``RewriteForms``)
RewriteForms = Literal["positive", "rollouts"]
#: :data:`cooper_mcore.algo.vocab.DEFAULT_CHUNK_TOKENS`
DEFAULT_CHUNK_TOKENS = 1024


class RewardMode(str, Enum):
    """Where the policy's reward comes from."""

    rule = "rule"
    """math-verify's 0/1 verdict (the rule-only baseline)."""
    static_rm = "static_rm"
    """sigmoid of a frozen VerifyRM's logit (the reward-hacking baseline)."""
    cooper = "cooper"
    """sigmoid of a VerifyRM that is itself updated every step (Cooper)."""

    @property
    def uses_rm(self) -> bool:
        """Whether the policy's reward comes from the reward model."""
        return self is not RewardMode.rule

    @property
    def trains_rm(self) -> bool:
        """Whether the reward model is updated during the run."""
        return self is RewardMode.cooper

    @property
    def rule_trains(self) -> bool:
        """Whether the rule verifier's verdicts train the run: the reward (rule) or the reward model's positives
        (cooper); static_rm's frozen reward model needs none."""
        return self is not RewardMode.static_rm


@dataclass
class ModelConfig:
    """The models: Megatron checkpoints (``cooper convert hf-to-mcore``) and the HF folder the
    policy's tokenizer and rollout engine load from; or, with ``init: random``, random weights
    built on the device at the models' shapes."""

    policy_ckpt: str = ""
    """Megatron checkpoint of the initial policy (also the frozen KL reference); unused with init=random."""
    policy_hf: str = ""
    """HF folder of the same policy (the rollout engine's start and the tokenizer); with init=random only its
    tokenizer is read (and its config.json when model.policy_config is empty)."""
    rm_ckpt: str = ""
    """Megatron checkpoint of the VerifyRM reward model (unused in rule mode and with init=random)."""
    dtype: Dtype = "float32"
    """Parameter dtype of both models; the checkpoints must hold it."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped with a model folder (off: that code is untrusted)."""
    moe_aux_loss_coef: Optional[float] = None
    """Weight of the routers' load-balancing loss of mixture-of-experts models (policy and RM, >= 0);
    unset: each checkpoint's HF ``router_aux_loss_coef``."""
    moe_routing_replay: bool = False
    """Rollout routing replay: the MoE policy's trainer forwards reuse the experts the engine chose per token."""
    init: ModelInit = "checkpoint"
    """checkpoint: load model.policy_ckpt and model.rm_ckpt; random: build the policy, its reference and the RM
    with random weights directly on the device at the shapes of model.policy_config and model.rm_config, and fill
    the rollout engine through the weight push (nothing read or converted: to measure time and memory at a real
    shape in seconds; the models learn nothing useful)."""
    policy_config: str = ""
    """With init=random: the policy's HF config (a config.json, a folder holding one, or a shipped name such as
    qwen2.5-1.5b-instruct); empty: model.policy_hf's config.json."""
    rm_config: str = ""
    """With init=random: the reward model's HF config (as model.policy_config); empty: the policy's backbone with
    a scalar head (VerifyRM is a fine-tuned model of the policy's size)."""

    @property
    def random_init(self) -> bool:
        """Whether the models are built with random weights rather than loaded (``init: random``)."""
        return self.init == "random"


@dataclass
class DataConfig:
    """Prompt data (see :mod:`cooper_mcore.data.datasets`)."""

    train_path: str = ""
    """Training prompts, JSONL or Parquet with a question and a reference answer per row."""
    eval_path: str = ""
    """Held-out prompts for evaluation (same format); needed when eval.every > 0."""
    question_key: str = "question"
    """Field holding the question."""
    answer_key: str = "answer"
    """Field holding the reference (gold) answer."""
    template: str = "{question}"
    """Prompt template; {question} is replaced by the question."""
    use_chat_template: bool = False
    """Wrap the templated prompt in the tokenizer's chat template as a user turn."""
    skip_malformed: bool = False
    """Skip and count malformed rows instead of stopping with an error naming file:line."""
    eval_limit: int = 0
    """Use only the first N held-out prompts (0: all)."""


@dataclass
class RolloutConfig:
    """Sampling and the rollout engine."""

    engine: EngineKind = "hf"
    """hf (transformers, CPU or a small GPU) or sglang."""
    group_size: int = 16
    """Completions per prompt (G of GRPO)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    top_p: float = 1.0
    """Nucleus sampling mass of the rollouts (1.0: off)."""
    max_new_tokens: int = 512
    """Longest completion in tokens."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion."""
    bucket_mb: int = 512
    """Size of the weight-sync buckets pushed into the engine, in MiB."""
    sglang_mem_fraction: float = 0.5
    """SGLang's mem_fraction_static: share of the GPU memory for its weights and KV cache."""
    sglang_base_port: int = 30000
    """First HTTP port of this node's SGLang engines (local rank r: +10r, NCCL port +1): differ per job on a node."""
    placement: Placement = "colocated"
    """colocated (the engine shares the trainer's devices, swapped in turn) or disaggregated (a process of its own)."""
    max_staleness: int = 0
    """Disaggregated: rollouts may come from weights up to this many policy versions old (0: every step waits)."""
    engine_threads: int = 0
    """Disaggregated on CPU: torch threads of the engine's process (0: torch's default)."""
    engine_restarts: int = 1
    """Disaggregated: times a dead engine process is started again and re-synced before the run stops (exit 71)."""

    @property
    def uses_sglang(self) -> bool:
        """Whether the rollouts come from SGLang (else from the transformers engine)."""
        return self.engine == "sglang"

    @property
    def disaggregated(self) -> bool:
        """Whether the engine runs apart from the trainer (its own process), fed over a weight group."""
        return self.placement == "disaggregated"


@dataclass
class RewardConfig:
    """The policy's reward."""

    mode: RewardMode = RewardMode.cooper
    """rule (math-verify 0/1), static_rm (frozen VerifyRM) or cooper (VerifyRM updated every step)."""
    rm_transform: RewardTransform = "sigmoid"
    """RM logit -> reward: sigmoid (fp32), sigmoid_bf16 (the reference's bf16 grid) or binary (0/1 at 0.5)."""
    verifier_timeout_s: float = 5.0
    """Hard time limit of one math-verify call; a timeout makes the item unverifiable."""
    verifier_workers: int = 2
    """Processes verifying answers (on every model-parallel group leader)."""
    unverifiable_reward: float = 0.0
    """Rule mode: the reward of a rollout the rule cannot verify (a timeout, a crash, a reference it cannot read)."""

    def __post_init__(self) -> None:
        if isinstance(self.mode, str) and not isinstance(self.mode, RewardMode):
            try:
                self.mode = RewardMode(self.mode)
            except ValueError:
                raise ValueError(f"reward.mode must be one of {[m.value for m in RewardMode]}, "
                                 f"got {self.mode!r}") from None


@dataclass
class AlgoConfig:
    """GRPO (the paper's settings by default)."""

    clip_low: float = 0.2
    """PPO ratio clip below 1 (eps_low)."""
    clip_high: float = 0.2
    """PPO ratio clip above 1 (eps_high; > clip_low is DAPO's clip-higher)."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual clip (verl's): a negative-advantage token's loss is capped at ratio clip_ratio_c (> 1; null: off)."""
    kl_coef: float = 1e-3
    """Weight of the KL-to-reference loss term (0: no reference model is kept)."""
    kl_kind: KLKind = "low_var_kl"
    """KL estimator of the loss term (low_var_kl is k3, clamped, as the paper)."""
    adv_eps: float = 1e-6
    """Added to the group's reward std before dividing (GRPO advantage)."""
    adv_std_floor: float = 0.0
    """Minimum group std in the advantage's divisor, so tiny RM differences stay small (0: plain GRPO)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the loss (the paper: 0)."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling: token policy loss x min(exp(old - engine log-prob), tis_cap) (null: off)."""
    logprob_diff_guard: Optional[float] = 0.5
    """Stop at the first step if the engine's log-probs differ from the trainer's by more (mean nats; null: off)."""


@dataclass
class OptimSection:
    """One model's optimizer (AdamW) and schedule (linear warm-up, then constant)."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to lr."""


@dataclass
class RMUpdateConfig:
    """The reward model's contrastive update (cooper mode)."""

    negatives: NegativeKind = "assistant"
    """assistant (an LLM rewrites a verified-correct solution, the paper), policy (the policy's own
    wrong rollouts), rewrite (a programmatic wrong rewrite of the positive's worked chain), perturb
    (the positive's final answer perturbed) or random (another prompt's response, the paper's ablation)."""
    pairs_per_prompt: int = 1
    """Preference pairs per prompt (the paper: 1)."""
    positive_pick: PositivePick = "first"
    """Which rule-correct rollout is the positive: first (the reference code), hardest (lowest RM score) or random."""
    negative_pick: NegativePick = "random"
    """negatives=policy: which rule-wrong rollout: random, hardest (highest RM score: the exploit) or first."""
    assistant_rounds: int = 3
    """negatives=assistant: requests per prompt at most, asking again while the rewrite is still correct (3)."""
    assistant_prompt: AssistantPrompt = "reference"
    """negatives=assistant: the reference's request (problem and correct solution, no gold answer) or with_gold."""
    rewrite_kinds: list[RewriteKind] = field(default_factory=lambda: ["step", "copy", "final"])
    """negatives=rewrite: one step off, an intermediate copied as the answer, a near-miss final line."""
    rewrite_forms: RewriteForms = "positive"
    """negatives=rewrite: the final answer written as in the positive, or in the form of one of the prompt's rollouts"""
    anchor_weight: float = 0.0
    """Weight of a BCE anchor on each pair's own labels added to the pairwise loss (0: the paper)."""
    question: RMQuestion = "prompt"
    """The RM's <question>: the question through data.template as the policy reads it (the reference) or bare."""
    assistant_url: str = ""
    """OpenAI-compatible endpoint of the assistant LLM."""
    assistant_model: str = ""
    """Model name sent to the assistant endpoint."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the assistant's API key (never the key itself)."""
    assistant_timeout_s: float = 60.0
    """Time limit of one assistant request attempt."""
    assistant_max_retries: int = 3
    """Retries of a failed assistant request (exponential backoff from 1 s)."""
    on_assistant_failure: FailureAction = "mask"
    """A request still failing after its retries: mask (leave that pair out, counted) or stop the run."""
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5, warmup_steps=0))
    """The reward model's optimizer and schedule."""

    @property
    def question_as_prompted(self) -> bool:
        """Whether the RM's ``<question>`` is the question through ``data.template`` (else bare)."""
        return self.question == "prompt"


@dataclass
class OffloadConfig:
    """What leaves the GPU while the rollout engine generates (colocation)."""

    policy_params: bool = False
    """Move the policy's parameters to host memory during rollouts."""
    policy_grads: bool = False
    """Free the policy's gradient buffers during rollouts (the next step zeroes them anyway)."""
    policy_optimizer: bool = False
    """Move the policy's optimizer state (fp32 main params, Adam moments) to host memory."""
    rm_params: bool = False
    """Move the reward model's parameters to host memory during rollouts."""
    rm_grads: bool = False
    """Free the reward model's gradient buffers during rollouts."""
    rm_optimizer: bool = False
    """Move the reward model's optimizer state to host memory during rollouts."""
    release_engine: bool = True
    """Release the engine's weights and KV cache between rollouts (weights are pushed again)."""


@dataclass
class TrainConfig:
    """The loop."""

    steps: int = 100
    """Cooper steps."""
    prompts_per_step: int = 32
    """Prompts per step over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (when max_tokens_per_micro_batch is 0)."""
    max_tokens_per_micro_batch: int = 0
    """Form micro-batches by this token budget in all four passes instead of micro_batch_size (0: off)."""
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Positions per chunk when log-probs and entropy are read from the logits (fp32 temporaries: chunk x vocab/tp)."""
    pack_sequences: bool = False
    """With the token budget, pack each micro-batch's sequences into one row (no padding; thd attention)."""
    mini_batches: int = 1
    """Policy updates per step (1: one update on the whole batch)."""
    seed: int = 1234
    """Seed of the data order, sampling and megatron's RNG."""
    max_nonfinite_steps: int = 3
    """Stop (checkpoint, exit code 3) after this many steps in a row with a skipped non-finite update (0: never)."""
    max_steps_without_pairs: int = 5
    """Warn loudly when this many cooper steps in a row formed no valid RM pair (0: never)."""
    max_steps_without_signal: int = 5
    """Stop (checkpoint, exit code 2) after this many steps in a row without a rule verdict on any rollout, in the
    modes the rule trains (rule: the reward; cooper: the RM's positives), e.g. unreadable references (0: never)."""


@dataclass
class EvalConfig:
    """Held-out evaluation: avg@k accuracy, temperature 0.7, top-p 0.95 (as the paper)."""

    every: int = 0
    """Evaluate every N steps (0: never)."""
    k: int = 1
    """Samples per held-out prompt (avg@k)."""
    temperature: float = 0.7
    """Sampling temperature of the evaluation."""
    top_p: float = 0.95
    """Nucleus sampling mass of the evaluation."""
    max_new_tokens: int = 512
    """Longest evaluation completion in tokens."""
    verifier: EvalVerifier = "rule"
    """Checker of eval/acc: the rule verifier, or arithmetic_oracle (cooper_mcore.verify.oracle, the arithmetic
    task's truth, reads every answer form the task writes; the rule's accuracy is then logged as eval/rule_acc)."""
    save_samples: bool = False
    """Write each evaluation's completions with both verdicts to <out>/eval_samples/step_<N>.jsonl (one file per
    data-parallel replica: step_<N>.dp<r>.jsonl when dp > 1)."""

    @property
    def uses_oracle(self) -> bool:
        """Whether eval/acc is the arithmetic oracle's (else the rule verifier's)."""
        return self.verifier == "arithmetic_oracle"


@dataclass
class CheckpointConfig:
    """Training checkpoints under ``<out>/checkpoints``."""

    every: int = 0
    """Write a checkpoint every N steps and after the last (0: never)."""
    keep: int = 2
    """Newest complete checkpoints kept."""
    resume: str = "none"
    """none, auto (the newest checkpoint that verifies) or a checkpoint folder."""
    overwrite: bool = False
    """Start over in an out folder that holds a run, deleting its metrics and checkpoints (default: refuse)."""
    allow_config_change: bool = False
    """Resume with settings that change what is trained (reward, models, data, algorithm...), recorded as a new
    version in config.yaml (default: refuse, listing them)."""


@dataclass
class LoggingConfig:
    """Metrics and reward-hacking detection."""

    wandb: bool = True
    """Log to Weights & Biases too (offline without credentials)."""
    wandb_project: str = "cooper_mcore"
    """wandb project."""
    run_name: str = ""
    """wandb run name (default: wandb's)."""
    hacking_window: int = 10
    """Steps of the reward-hacking detector's window."""
    stop_on_hacking: bool = False
    """Stop the run when the detector fires (default: warn)."""


@dataclass
class CooperConfig:
    """A whole run."""

    out: str = "runs/cooper"
    """Run folder: config.yaml, metrics.jsonl, checkpoints/."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The models."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The model-parallel layout shared by the policy and the reward model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and the rollout engine."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The policy's reward."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """GRPO."""
    optim: OptimSection = field(default_factory=OptimSection)
    """The policy's optimizer and schedule."""
    rm: RMUpdateConfig = field(default_factory=RMUpdateConfig)
    """The reward model's update (cooper mode)."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Colocation: what leaves the GPU while the engine generates."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Training checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and reward-hacking detection."""

    @property
    def uses_assistant(self) -> bool:
        """Whether the RM's negatives come from the assistant LLM (cooper mode, ``rm.negatives=assistant``);
        an invalid ``reward.mode`` (reported by the config checks) counts as not training the RM."""
        mode = self.reward.mode
        return isinstance(mode, RewardMode) and mode.trains_rm and self.rm.negatives == "assistant"


@dataclass
class SFTDataConfig:
    """SFT examples: worked solutions of the arithmetic task (:func:`cooper_mcore.jobs.sft.math_sft_examples`)."""

    num_examples: int = 256
    """Distinct train-split problems, one example each."""
    seed: int = 0
    """Draws the problems and which of them get a wrong solution."""
    template: str = "{question}"
    """Prompt template; {question} is replaced by the question (as the trainer's data.template)."""
    use_chat_template: bool = False
    """Wrap the templated prompt in the tokenizer's chat template as a user turn."""
    mix_wrong: float = 0.0
    """Share in [0, 1] of the responses that are a plausible wrong worked solution (0: plain SFT)."""
    style: AnswerStyle = "boxed"
    """Final-answer style of the responses."""


@dataclass
class SFTTrainConfig:
    """The SFT loop: a seeded stream of shuffled epochs cut into global batches."""

    steps: int = 100
    """Optimizer steps."""
    global_batch_size: int = 32
    """Examples per step over all data-parallel ranks."""
    micro_batch_size: int = 8
    """Examples per forward/backward; global_batch_size must be a multiple of micro_batch_size * dp."""
    min_lr: Optional[float] = None
    """null: optim.lr stays constant after the warm-up; a value in [0, lr]: cosine decay to it."""
    seed: int = 0
    """Shuffling seed (and megatron's RNG seed when the job sets up the world)."""
    log_every: int = 10
    """Log loss, gradient norm and throughput every N steps (0: only the last step)."""


@dataclass
class SFTConfig:
    """Supervised fine-tuning of a policy checkpoint (``cooper sft``)."""

    ckpt: str = ""
    """The cooper_mcore causal-LM checkpoint to start from (hf-to-mcore output or an earlier SFT's)."""
    out: str = "runs/sft/policy_mcore"
    """The output model checkpoint folder; must not exist."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The model-parallel layout; data parallelism is the rest of the world."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """The examples (``cooper sft`` builds them; the library call takes them as given)."""
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5))
    """The optimizer (AdamW) and linear warm-up."""
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    """The loop."""


@dataclass
class RMDataConfig:
    """VerifyRM training and evaluation data (:mod:`cooper_mcore.jobs.verify_rm`)."""

    train_path: str = ""
    """Labeled training rows, JSONL or Parquet: question, reference, completion, label."""
    eval_path: str = ""
    """Evaluation data, labeled or VerifyBench format ("": no evaluation)."""
    eval_format: RMEvalFormat = "auto"
    """Format of eval_path: auto (told apart by its first row), labeled or verifybench."""
    question_key: str = "question"
    """Training-data field holding the question."""
    reference_key: str = "reference"
    """Training-data field holding the reference answer."""
    completion_key: str = "completion"
    """Training-data field holding the completion to judge."""
    label_key: str = "label"
    """Training-data field holding whether the completion is correct."""
    skip_malformed: bool = False
    """Skip and count malformed rows instead of stopping with an error naming file:line."""
    max_length: Optional[int] = None
    """Token limit per row (null: the model's max_position_embeddings)."""


@dataclass
class RMTrainConfig:
    """The VerifyRM loop: seeded epochs of global batches (the last one may be short)."""

    epochs: int = 3
    """Passes over the training data (the paper: 3)."""
    global_batch_size: int = 32
    """Rows per optimizer step over all data-parallel ranks; a multiple of micro_batch_size * dp."""
    micro_batch_size: int = 4
    """Rows per forward/backward micro-batch."""
    eval_every: int = 0
    """Evaluate every N steps (0: only after each epoch)."""
    eval_at_start: bool = True
    """Evaluate the initial model too (step 0)."""
    threshold: float = 0.5
    """Probability threshold of "correct" in the evaluation accuracy."""
    save_every: int = 0
    """Also keep a model checkpoint every N steps (0: only final)."""
    seed: int = 1234
    """Data order and megatron's RNG seed."""
    gate: float = 0.0
    """Stop after the first epoch whose evaluation accuracy reaches this in every answer type (0: run every epoch)."""
    keep_best: bool = False
    """final/ is the epoch whose evaluation was best (its lowest accuracy over the answer types), not the last."""


@dataclass
class VerifyRMConfig:
    """VerifyRM training with binary cross-entropy on labeled triples (``cooper train-rm``)."""

    ckpt: str = ""
    """The reward-model checkpoint to start from (hf-to-mcore --model-type reward)."""
    out: str = "runs/verify_rm"
    """Output folder (must not exist or be empty): metrics.jsonl, checkpoints/, final/, summary.json."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The model-parallel layout; data parallelism is the rest of the world."""
    data: RMDataConfig = field(default_factory=RMDataConfig)
    """Training and evaluation data."""
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=2e-5))
    """The optimizer (AdamW at a constant learning rate: warmup_steps must be 0; the paper: lr 2e-5)."""
    train: RMTrainConfig = field(default_factory=RMTrainConfig)
    """The loop."""


#: the jobs with a typed config, by the name ``cooper config --job`` takes
JOB_CONFIGS: dict[str, type] = {"train": CooperConfig, "sft": SFTConfig, "train-rm": VerifyRMConfig}


def load_config(preset: Optional[str] = None, overrides: Optional[list[str]] = None,
                cls: type[T] = CooperConfig) -> T:  # type: ignore[assignment]
    """Defaults <- YAML preset <- dotted overrides, type-checked, into a job's config class
    (:class:`CooperConfig` by default, or any of :data:`JOB_CONFIGS`).

    A value outside a setting's choices (a ``Literal`` or enum field) is kept as given and
    reported by :func:`cooper_mcore.config.checks.validate` together with every other problem of
    the config; an unknown key or a value of the wrong type is an error at once.

    Raises:
        ValueError: one line naming the key and its source: an unknown key (with a did-you-mean), an
            override without ``=``, a wrong type, a broken interpolation; or an unreadable preset
            (naming it: a YAML error with its line, an empty preset, a top level that is not a
            mapping of sections).
        FileNotFoundError / IsADirectoryError: the preset does not exist / is a folder.
    """
    return load_sections(cls, preset, overrides)


def load_sections(cls: type[T], preset: Optional[str] = None, overrides: Optional[list[str]] = None,
                  presets: Optional[Mapping[str, Mapping[str, Any]]] = None) -> T:
    """A config dataclass of sections (``cls``): defaults <- preset <- dotted overrides, type-checked.

    The loader of :func:`load_config`, for every config of sections (the demo's too). Values
    outside a setting's choices are kept as given, for the caller's checks to report
    (:func:`cooper_mcore.config.checks.choice_problems`).

    Args:
        cls: the config dataclass.
        preset: a YAML file's path; or, with ``presets``, one of its names.
        overrides: dotted ``key=value`` settings, applied in order after the preset.
        presets: named presets (nested mappings of sections) that ``preset`` chooses from.

    Raises:
        ValueError: an unknown key or preset name, a wrong type, or an unreadable preset.
        FileNotFoundError / IsADirectoryError: a preset path that does not exist / is a folder.
    """
    if presets is not None and preset is not None and preset not in presets:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(presets)}")
    cfg = OmegaConf.structured(cls)
    off_choice: dict[str, Any] = {}
    for source, key, value in _settings(cls, preset, overrides, presets):
        try:
            cfg.merge_with(_nested(key, value))  # in place: a merge copies the whole config each time
            off_choice.pop(key, None)
        except OmegaConfBaseException as e:
            if not _is_choice(cls, key):
                raise ValueError(f"bad config ({source}): {_library_problem(key, e)}") from None
            off_choice[key] = value
    try:
        result: T = OmegaConf.to_object(cfg)  # resolves ${...} interpolations
    except OmegaConfBaseException as e:
        raise ValueError(f"bad config ({preset or 'overrides'}): {_library_problem('', e)}") from None
    for key, value in off_choice.items():  # left for the caller's checks to report with the rest
        *path, name = key.split(".")
        obj: Any = result
        for part in path:
            obj = getattr(obj, part)
        object.__setattr__(obj, name, value)
    return result


def _settings(cls: type, preset: Optional[str], overrides: Optional[list[str]],
              presets: Optional[Mapping[str, Mapping[str, Any]]]) -> list[tuple[str, str, Any]]:
    """``(source, dotted key, value)`` of the preset's settings, then of the overrides, each key a
    setting of ``cls`` (an empty section of a preset is left out).

    Raises:
        ValueError: one line naming the source and the key: an unknown key (with a did-you-mean), a
            section given a value, an override without ``=``, or an unreadable value.
    """
    items: list[tuple[str, str, Any]] = []
    if preset:
        tree = presets[preset] if presets is not None else _read_preset(preset)
        items += [(preset, k, v) for k, v in _leaves(tree) if v != {}]
    for item in overrides or []:
        key = item.partition("=")[0].strip()
        if "=" not in item:
            raise ValueError(f"override {item!r} has no '=': write {key}=VALUE (null to unset); "
                             f"`cooper config {key}` shows its value and doc")
        try:
            tree = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as e:
            raise ValueError(f"bad config (override {item!r}): {_library_problem(key, e)}") from None
        leaves = _leaves(tree)
        if key in setting_keys(cls) and any(k != key for k, _ in leaves):  # data.template={question}
            raise ValueError(f"bad config (override {item!r}): the value of {key} reads as a YAML mapping; quote "
                             f"it: {key}='{item.partition('=')[2]}'")
        items += [(f"override {item!r}", k, v) for k, v in leaves]
    for source, key, _ in items:
        problem = key_problem(cls, key)
        if problem:
            raise ValueError(f"bad config ({source}): {problem}")
    return items


def _library_problem(key: str, e: OmegaConfBaseException) -> str:
    """One line for an error of the config library about ``key``: the key it names (OmegaConf's own
    ``full_key``, else ``key``) and the first line of its message (the rest repeats the key and
    names OmegaConf's node types)."""
    lines = str(e).strip().splitlines()
    text = lines[0].strip() if lines else type(e).__name__
    name = getattr(e, "full_key", None) or key
    if "is not a ListConfig" in text:  # a bare value given to a list setting
        text = f"a list is expected: write {name}=[a,b] ([] for none)"
    return f"{name}: {text}" if name else text


def setting_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted key of every leaf setting of the config dataclass ``cls``, in declaration order."""
    return list(_setting_keys(cls, prefix))


@functools.cache
def _setting_keys(cls: type, prefix: str) -> tuple[str, ...]:
    """:func:`setting_keys`, once per class (every key of a preset is checked against them; type hints
    are slow to evaluate)."""
    keys: list[str] = []
    for name, hint in typing.get_type_hints(cls).items():
        if name not in {f.name for f in fields(cls)}:
            continue
        if is_dataclass(hint):
            keys += _setting_keys(hint, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return tuple(keys)


def key_problem(cls: type, key: str) -> Optional[str]:
    """Why ``key`` is no setting of the config dataclass ``cls`` (an unknown key with a did-you-mean,
    a section, or a setting addressed as a section), or None when it is one."""
    keys = setting_keys(cls)
    if key in keys:
        return None
    if not key:
        return "a setting without a name (key=value is expected)"
    parts = key.split(".")
    for i in range(1, len(parts)):
        head = ".".join(parts[:i])
        if head in keys:
            return f"{head} is a setting, not a section: write {head}=VALUE"
    inside = [k for k in keys if k.startswith(key + ".")]
    if inside:
        return (f"{key} is a section, not a setting: name one of its settings ({', '.join(inside[:3])}"
                f"{', ...' if len(inside) > 3 else ''})")
    return f"unknown setting {key}{did_you_mean(key, keys)}"


def did_you_mean(key: str, keys: list[str]) -> str:
    """`` (did you mean a or b?)`` for the keys closest to ``key`` ('' when none is close): the keys
    with ``key``'s last part, else the closest spellings of the whole key or of its last part."""
    leaf = key.rsplit(".", 1)[-1]
    leaves = {k: k.rsplit(".", 1)[-1] for k in keys}
    close = [k for k, last in leaves.items() if last == leaf]
    close = close or difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    close = close or [k for k, last in leaves.items() if difflib.get_close_matches(leaf, [last], cutoff=0.8)]
    return f" (did you mean {' or '.join(close[:3])}?)" if close else ""


def dotted(settings: Mapping[str, Any]) -> list[str]:
    """``{dotted key: value}`` as override strings for :func:`load_sections` (each value written as
    JSON, which the override parser reads back as the same string, number, boolean or list)."""
    return [f"{key}={json.dumps(value.value if isinstance(value, Enum) else value)}"
            for key, value in settings.items()]


def _read_preset(path: str) -> dict[str, Any]:
    """A YAML preset's top-level mapping of sections; ``path`` may name a shipped preset
    (:func:`cooper_mcore.config.presets.resolve_preset`) or a run folder's ``config.yaml`` (its newest
    version, :func:`cooper_mcore.config.versions.newest_config`).

    Raises:
        FileNotFoundError / IsADirectoryError: no such file or shipped preset; a folder.
        ValueError: not UTF-8, a YAML error (with the file's line and column), an empty preset, or
            a top level that is not a mapping.
    """
    path = resolve_preset(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    try:
        tree = newest_config(OmegaConf.to_container(OmegaConf.load(path)))
    except yaml.YAMLError as e:
        raise ValueError(f"preset {path}: {_yaml_problem(e, path)}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"preset {path} is not UTF-8 text (byte {e.start}): is it the right file?") from None
    if not tree:
        raise ValueError(f"preset {path} is empty: give it sections such as `train:` (see examples/tiny_cpu.yaml), "
                         f"or leave out --config to use the defaults")
    if not isinstance(tree, dict):
        raise ValueError(f"preset {path} must be a mapping of sections (model:, train:, ...), got a "
                         f"{'list' if isinstance(tree, list) else type(tree).__name__}")
    return tree


def _yaml_problem(e: yaml.YAMLError, path: str) -> str:
    """One line: where in the file and what is wrong (a tab indent and a repeated key explained)."""
    mark = getattr(e, "problem_mark", None)
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    if mark is not None and _char_at(path, mark.line, mark.column) == "\t":
        problem += " (a tab: YAML indents with spaces only)"
    elif problem.startswith("found duplicate key"):
        context_mark = getattr(e, "context_mark", None)
        section = f" (in the mapping that starts on line {context_mark.line + 1})" if context_mark is not None else ""
        problem += f"{section}: each key may appear once"
    return f"{where}{problem}"


def _char_at(path: str, line: int, column: int) -> str:
    """The character of a text file at a 0-based line and column ('' past the end)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, text in enumerate(f):
            if i == line:
                return text[column:column + 1]
    return ""


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of nested mappings (lists are leaves)."""
    if isinstance(tree, dict) and tree:
        return [kv for k, v in tree.items() for kv in _leaves(v, f"{prefix}{k}.")]
    return [(prefix[:-1], tree)]


def _nested(key: str, value: Any) -> Any:
    for part in reversed(key.split(".")):
        value = {part: value}
    return OmegaConf.create(value)


def _is_choice(config_cls: type, key: str) -> bool:
    """Whether ``key`` names a ``Literal`` or enum setting of the config dataclass ``config_cls``."""
    cls: Any = config_cls
    hint: Any = None
    for part in key.split("."):
        if not is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        hint = cls = hints[part]
    return typing.get_origin(hint) is Literal or (isinstance(hint, type) and issubclass(hint, Enum))


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (enums as their values)."""
    return json.loads(json.dumps(asdict(cfg), default=lambda v: v.value if isinstance(v, Enum) else str(v)))


def save_config(cfg: Any, path: str) -> None:
    """Write the resolved config as YAML, without secrets (:func:`cooper_mcore.redaction.scrub_config`:
    API keys live in the environment; a key pasted into a setting by mistake is written as ``***``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    OmegaConf.save(OmegaConf.create(scrub_config(to_dict(cfg))), path)


def field_docs(cls: type) -> dict[str, str]:
    """The one-line doc written under each field of a config dataclass (megatron-core's style)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cfg: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``(dotted key, value, doc)`` of every leaf setting of ``cfg``, in declaration order."""
    docs = field_docs(type(cfg))
    rows = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            rows += describe(value, key + ".")
        else:
            rows.append((key, value.value if isinstance(value, Enum) else value, docs.get(f.name, "")))
    return rows


def format_settings(cfg: Any, keys: Optional[list[str]] = None) -> str:
    """Settings of a config of sections (:class:`CooperConfig`, the demo's) with their values and
    docs, one per line (``cooper config --show``, ``cooper demo --show``): every setting, or those
    ``keys`` name (a key names a setting, or a section and so each of its settings).

    Raises:
        ValueError: a key that names neither (with the closest keys: a did-you-mean).
    """
    rows = describe(cfg)
    if keys:
        chosen = []
        for key in keys:
            picked = [r for r in rows if r[0] == key or r[0].startswith(key + ".")]
            if not picked:
                raise ValueError(f"unknown setting {key!r}{did_you_mean(key, [r[0] for r in rows])}; "
                                 "`cooper config` lists every setting")
            chosen += [r for r in picked if r not in chosen]
        rows = chosen
    width = max(len(k) + 2 + len(json.dumps(v)) for k, v, _ in rows)
    return "\n".join(f"{(k + '=' + json.dumps(v)):<{width}}  # {doc}" for k, v, doc in rows)
