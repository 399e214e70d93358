"""Typed configuration of a Cooper run: one dataclass section per component.

A run's config is built from the defaults below, a YAML preset (``examples/*.yaml``) and
command-line overrides in dotted form (``algo.kl_coef=0.01 rollout.group_size=8``), merged with
OmegaConf's structured configs, so types are checked and unknown keys are errors. Each part of
the trainer receives only its own section. :func:`validate` rejects impossible settings before
any work starts.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from cooper_mcore.parallel import ParallelConfig

REWARD_MODES = ("rule", "static_rm", "cooper")
NEGATIVE_KINDS = ("assistant", "policy", "perturb", "random")


@dataclass
class ModelConfig:
    """The models. Paths are Megatron checkpoints (``cooper convert hf-to-mcore``) and the HF
    folders their tokenizers/engines load from.

    Attributes:
        policy_ckpt: Megatron checkpoint of the initial policy (also the frozen reference).
        policy_hf: HF folder of the same policy (rollout engine start, tokenizer).
        rm_ckpt: Megatron checkpoint of the VerifyRM (reward model); unused in ``rule`` mode.
        dtype: "float32" or "bfloat16".
    """

    policy_ckpt: str = ""
    policy_hf: str = ""
    rm_ckpt: str = ""
    dtype: str = "float32"


@dataclass
class DataConfig:
    """Prompt data (see :mod:`cooper_mcore.data.datasets`)."""

    train_path: str = ""
    eval_path: str = ""
    question_key: str = "question"
    answer_key: str = "answer"
    template: str = "{question}"
    use_chat_template: bool = False
    skip_malformed: bool = False
    eval_limit: int = 0


@dataclass
class RolloutConfig:
    """Sampling and the rollout engine.

    Attributes:
        engine: "hf" (transformers, CPU/small GPU) or "sglang".
        group_size: completions per prompt (G).
        bucket_mb: weight-sync bucket size.
    """

    engine: str = "hf"
    group_size: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    bucket_mb: int = 512
    sglang_mem_fraction: float = 0.5


@dataclass
class RewardConfig:
    """Rewards: ``rule`` (math-verify 0/1), ``static_rm`` (frozen VerifyRM), ``cooper``
    (VerifyRM updated every step). In RM modes the policy reward is sigmoid(RM logit)."""

    mode: str = "cooper"
    verifier_timeout_s: float = 5.0
    verifier_workers: int = 2


@dataclass
class AlgoConfig:
    """GRPO (paper settings by default)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 1e-3
    kl_kind: str = "low_var_kl"
    adv_eps: float = 1e-6
    entropy_coef: float = 0.0


@dataclass
class OptimSection:
    """One model's optimizer (AdamW) and schedule (linear warm-up, then constant)."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    warmup_steps: int = 0


@dataclass
class RMUpdateConfig:
    """The reward model's contrastive update (cooper mode).

    Attributes:
        negatives: "assistant" (LLM over an OpenAI-compatible API), "policy" (the policy's own
            wrong rollouts), "perturb" (answer perturbation) or "random" (paper ablation).
        assistant_url / assistant_model / api_key_env: the assistant LLM endpoint.
    """

    negatives: str = "assistant"
    assistant_url: str = ""
    assistant_model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5, warmup_steps=0))


@dataclass
class OffloadConfig:
    """What to move to CPU memory while another phase runs (colocation)."""

    policy_params: bool = False
    policy_grads: bool = False
    policy_optimizer: bool = False
    rm_params: bool = False
    rm_grads: bool = False
    rm_optimizer: bool = False
    release_engine: bool = True


@dataclass
class TrainConfig:
    """The loop.

    Attributes:
        steps: Cooper steps.
        prompts_per_step: prompts per step across all data-parallel ranks.
        micro_batch_size: sequences per forward/backward.
        mini_batches: policy updates per step (1 = one update on the whole batch).
    """

    steps: int = 100
    prompts_per_step: int = 32
    micro_batch_size: int = 8
    mini_batches: int = 1
    seed: int = 1234


@dataclass
class EvalConfig:
    """Held-out evaluation: avg@k accuracy, temperature 0.7, top-p 0.95 (as the paper)."""

    every: int = 0
    k: int = 1
    temperature: float = 0.7
    top_p: float = 0.95
    max_new_tokens: int = 512


@dataclass
class CheckpointConfig:
    """Checkpoints under ``<out>/checkpoints``; ``resume: auto`` continues from the newest."""

    every: int = 0
    keep: int = 2
    resume: str = "none"


@dataclass
class LoggingConfig:
    wandb: bool = True
    wandb_project: str = "cooper_mcore"
    run_name: str = ""
    hacking_window: int = 10
    stop_on_hacking: bool = False


@dataclass
class CooperConfig:
    """A whole run."""

    out: str = "runs/cooper"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimSection = field(default_factory=OptimSection)
    rm: RMUpdateConfig = field(default_factory=RMUpdateConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def load_config(preset: Optional[str] = None, overrides: Optional[list[str]] = None) -> CooperConfig:
    """Defaults <- YAML preset <- dotted overrides, type-checked.

    Raises:
        ValueError: unknown key, wrong type, or a missing preset file (naming it).
    """
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.structured(CooperConfig)
    try:
        if preset:
            if not os.path.isfile(preset):
                raise FileNotFoundError(f"config preset {preset!r} not found")
            cfg = OmegaConf.merge(cfg, OmegaConf.load(preset))
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ValueError(f"bad config ({preset or 'defaults'}): {e}") from None
    result: CooperConfig = OmegaConf.to_object(cfg)
    return result


def to_dict(cfg: CooperConfig) -> dict[str, Any]:
    return asdict(cfg)


def save_config(cfg: CooperConfig, path: str) -> None:
    """Write the resolved config as YAML."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), path)


def validate(cfg: CooperConfig, world_size: int) -> None:
    """One clear error for an impossible run, before any work starts."""
    cfg.parallel.validate(world_size)
    dp = world_size // (cfg.parallel.tp * cfg.parallel.pp)
    r, t = cfg.reward, cfg.train
    if r.mode not in REWARD_MODES:
        raise ValueError(f"reward.mode must be one of {REWARD_MODES}, got {r.mode!r}")
    if cfg.rm.negatives not in NEGATIVE_KINDS:
        raise ValueError(f"rm.negatives must be one of {NEGATIVE_KINDS}, got {cfg.rm.negatives!r}")
    if r.mode == "cooper" and cfg.rm.negatives == "assistant" and not cfg.rm.assistant_url:
        raise ValueError("rm.negatives=assistant needs rm.assistant_url (or choose policy/perturb/random)")
    if cfg.rollout.engine not in ("hf", "sglang"):
        raise ValueError(f"rollout.engine must be 'hf' or 'sglang', got {cfg.rollout.engine!r}")
    if cfg.model.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.dtype must be float32 or bfloat16, got {cfg.model.dtype!r}")
    if t.prompts_per_step % dp:
        raise ValueError(f"train.prompts_per_step={t.prompts_per_step} is not divisible by the "
                         f"data-parallel size {dp}")
    per_rank = t.prompts_per_step // dp * cfg.rollout.group_size
    if per_rank % (t.micro_batch_size * t.mini_batches):
        raise ValueError(f"{per_rank} sequences per data-parallel rank are not divisible by "
                         f"micro_batch_size*mini_batches = {t.micro_batch_size}*{t.mini_batches}")
    if cfg.rollout.group_size < 2:
        raise ValueError("rollout.group_size must be >= 2 (GRPO normalizes within a group)")
    paths = [("model.policy_ckpt", cfg.model.policy_ckpt), ("model.policy_hf", cfg.model.policy_hf),
             ("data.train_path", cfg.data.train_path)]
    if r.mode != "rule":
        paths.append(("model.rm_ckpt", cfg.model.rm_ckpt))
    if cfg.eval.every:
        paths.append(("data.eval_path", cfg.data.eval_path))
    for name, path in paths:
        if not path:
            raise ValueError(f"{name} is not set")
        if not os.path.exists(path):
            raise ValueError(f"{name}: {path!r} does not exist")
    if cfg.checkpoint.resume not in ("none", "auto") and not os.path.isdir(cfg.checkpoint.resume):
        raise ValueError(f"checkpoint.resume must be 'none', 'auto' or a checkpoint folder; got "
                         f"{cfg.checkpoint.resume!r}")
