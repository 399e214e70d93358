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

from cooper_mcore.algo.losses import KL_ESTIMATORS as KL_KINDS
from cooper_mcore.parallel import ParallelConfig

REWARD_MODES = ("rule", "static_rm", "cooper")
NEGATIVE_KINDS = ("assistant", "policy", "perturb", "random")
FAILURE_ACTIONS = ("mask", "stop")


@dataclass
class ModelConfig:
    """The models. Paths are Megatron checkpoints (``cooper convert hf-to-mcore``) and the HF
    folders their tokenizers/engines load from.

    Attributes:
        policy_ckpt: Megatron checkpoint of the initial policy (also the frozen reference).
        policy_hf: HF folder of the same policy (rollout engine start, tokenizer).
        rm_ckpt: Megatron checkpoint of the VerifyRM (reward model); unused in ``rule`` mode.
        dtype: "float32" or "bfloat16".
        trust_remote_code: let transformers run Python code shipped with a model folder (its
            tokenizer or config); off unless asked, as executing a downloaded folder's code is
            executing untrusted code.
    """

    policy_ckpt: str = ""
    policy_hf: str = ""
    rm_ckpt: str = ""
    dtype: str = "float32"
    trust_remote_code: bool = False


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
        assistant_url / assistant_model / api_key_env: the assistant LLM endpoint; the API key is
            read from the environment variable named by ``api_key_env``, never from the config.
        assistant_timeout_s / assistant_max_retries: per-attempt timeout and retries (exponential
            backoff from 1 s) of each assistant request.
        on_assistant_failure: when a request still fails after its retries: "mask" (that prompt's
            pair is left out of the RM update and counted in ``pairs/assistant_failed``; the run
            goes on) or "stop" (the run stops with an error naming the endpoint).
    """

    negatives: str = "assistant"
    assistant_url: str = ""
    assistant_model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    assistant_timeout_s: float = 60.0
    assistant_max_retries: int = 3
    on_assistant_failure: str = "mask"
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
        max_nonfinite_steps: stop (with a checkpoint, exit code 3) after this many steps in a
            row whose policy or RM update was skipped for a non-finite loss or gradient norm;
            0 never stops.
    """

    steps: int = 100
    prompts_per_step: int = 32
    micro_batch_size: int = 8
    mini_batches: int = 1
    seed: int = 1234
    max_nonfinite_steps: int = 3


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
    """Write the resolved config as YAML, without secrets (:func:`cooper_mcore.redaction.scrub_config`:
    API keys live in the environment; a key pasted into a setting by mistake is written as ``***``)."""
    from cooper_mcore.redaction import scrub_config

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    OmegaConf.save(OmegaConf.create(scrub_config(to_dict(cfg))), path)


def validate(cfg: CooperConfig, world_size: int) -> None:
    """One clear error for an impossible run, before any work starts.

    Checks the parallel layout against the world size and against the models' architectures
    (read from the checkpoints' ``cooper_model.json``: attention heads, key/value heads and the
    vocabulary divisible by TP, layers by PP), that the batch sizes divide (prompts per step by the
    data-parallel size; each rank's ``prompts * group_size`` sequences by ``micro_batch_size *
    mini_batches``), the choices and ranges of the settings, and that every path the run reads
    exists.

    Args:
        cfg: the run's config.
        world_size: the number of processes (``WORLD_SIZE``).

    Raises:
        ValueError: listing every problem found, one per line.
    """
    problems = config_problems(cfg, world_size)
    if problems:
        raise ValueError(f"invalid config ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n"
                         + "\n".join(f"  - {p}" for p in problems))


def config_problems(cfg: CooperConfig, world_size: int) -> list[str]:
    """Every problem :func:`validate` reports, in a fixed order (empty when the config is fine)."""
    out: list[str] = []
    t, ro, r = cfg.train, cfg.rollout, cfg.reward
    choices = [("reward.mode", r.mode, REWARD_MODES), ("rm.negatives", cfg.rm.negatives, NEGATIVE_KINDS),
               ("rm.on_assistant_failure", cfg.rm.on_assistant_failure, FAILURE_ACTIONS),
               ("rollout.engine", ro.engine, ("hf", "sglang")),
               ("model.dtype", cfg.model.dtype, ("float32", "bfloat16")), ("algo.kl_kind", cfg.algo.kl_kind, KL_KINDS)]
    out += [f"{name} must be one of {allowed}, got {value!r}"
            for name, value, allowed in choices if value not in allowed]
    if r.mode == "cooper" and cfg.rm.negatives == "assistant":
        out += [f"rm.negatives=assistant needs rm.{k} (or choose negatives policy/perturb/random)"
                for k in ("assistant_url", "assistant_model") if not getattr(cfg.rm, k)]
    ranges = [("train.steps", t.steps, 0), ("train.prompts_per_step", t.prompts_per_step, 1),
              ("train.micro_batch_size", t.micro_batch_size, 1), ("train.mini_batches", t.mini_batches, 1),
              ("rollout.group_size", ro.group_size, 2), ("rollout.max_new_tokens", ro.max_new_tokens, 1),
              ("rollout.bucket_mb", ro.bucket_mb, 1), ("reward.verifier_workers", r.verifier_workers, 1),
              ("rm.assistant_max_retries", cfg.rm.assistant_max_retries, 0), ("eval.every", cfg.eval.every, 0),
              ("eval.k", cfg.eval.k, 1), ("checkpoint.every", cfg.checkpoint.every, 0),
              ("checkpoint.keep", cfg.checkpoint.keep, 1)]
    out += [f"{name} must be >= {low}, got {value}" for name, value, low in ranges if value < low]
    positive = [("reward.verifier_timeout_s", r.verifier_timeout_s),
                ("rm.assistant_timeout_s", cfg.rm.assistant_timeout_s)]
    out += [f"{name} must be > 0, got {value}" for name, value in positive if not value > 0]
    non_negative = [("algo.clip_low", cfg.algo.clip_low), ("algo.clip_high", cfg.algo.clip_high),
                    ("algo.kl_coef", cfg.algo.kl_coef), ("optim.lr", cfg.optim.lr), ("rm.optim.lr", cfg.rm.optim.lr),
                    ("rollout.temperature", ro.temperature)]
    out += [f"{name} must be >= 0, got {value}" for name, value in non_negative if not value >= 0]
    out += [f"{name} must be in (0, 1], got {value}" for name, value in
            (("rollout.top_p", ro.top_p), ("eval.top_p", cfg.eval.top_p)) if not 0 < value <= 1]
    if "{question}" not in cfg.data.template:
        out.append(f"data.template {cfg.data.template!r} has no {{question}} placeholder")
    out += _layout_problems(cfg, world_size)
    out += _path_problems(cfg)
    return out


def _layout_problems(cfg: CooperConfig, world_size: int) -> list[str]:
    """The parallel layout against the world size, the batch sizes and the models' shapes."""
    par, t = cfg.parallel, cfg.train
    if par.tp < 1 or par.pp < 1:
        return [f"parallel.tp and parallel.pp must be >= 1, got tp={par.tp} pp={par.pp}"]
    out = []
    if par.sequence_parallel and par.tp == 1:
        out.append("parallel.sequence_parallel needs parallel.tp > 1")
    if world_size % (par.tp * par.pp):
        out.append(f"the world size {world_size} is not divisible by tp*pp = {par.tp}*{par.pp}")
    else:
        dp = world_size // (par.tp * par.pp)
        if t.prompts_per_step % dp:
            out.append(f"train.prompts_per_step={t.prompts_per_step} is not divisible by the data-parallel "
                       f"size {dp} (world {world_size} / tp {par.tp} / pp {par.pp})")
        elif t.micro_batch_size >= 1 and t.mini_batches >= 1:
            per_rank = t.prompts_per_step // dp * cfg.rollout.group_size
            if per_rank % (t.micro_batch_size * t.mini_batches):
                out.append(f"{per_rank} sequences per data-parallel rank (prompts_per_step {t.prompts_per_step} / "
                           f"dp {dp} * group_size {cfg.rollout.group_size}) are not divisible by "
                           f"micro_batch_size*mini_batches = {t.micro_batch_size}*{t.mini_batches}")
    models = [("model.policy_ckpt", cfg.model.policy_ckpt)]
    if cfg.reward.mode != "rule":
        models.append(("model.rm_ckpt", cfg.model.rm_ckpt))
    for name, ckpt in models:
        arch, dtype = _checkpoint_arch(ckpt)
        if arch is None:
            continue
        for field_name, what, size, by in (("num_attention_heads", "attention heads", par.tp, "tp"),
                                           ("num_query_groups", "key/value heads", par.tp, "tp"),
                                           ("vocab_size", "vocabulary entries", par.tp, "tp"),
                                           ("num_layers", "layers", par.pp, "pp")):
            value = arch.get(field_name)
            if isinstance(value, int) and value % size:
                out.append(f"{name} ({ckpt}) has {value} {what}, not divisible by parallel.{by}={size}")
        if name == "model.policy_ckpt" and dtype is not None and dtype != cfg.model.dtype:
            out.append(f"model.dtype={cfg.model.dtype} but {ckpt} holds {dtype} weights; convert the "
                       "checkpoint in the dtype you train in")
    return out


def _checkpoint_arch(ckpt: str) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """(arch fields, dtype) from a checkpoint's ``cooper_model.json``; (None, None) when unreadable
    (the path checks report that)."""
    import json

    try:
        with open(os.path.join(ckpt, "cooper_model.json"), encoding="utf-8") as f:
            meta = json.load(f)
        return dict(meta["arch"]), meta.get("dtype")
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def _path_problems(cfg: CooperConfig) -> list[str]:
    """Every file or folder the run reads must exist (and be of the right kind)."""
    m, d = cfg.model, cfg.data
    ckpts = [("model.policy_ckpt", m.policy_ckpt)]
    if cfg.reward.mode != "rule":
        ckpts.append(("model.rm_ckpt", m.rm_ckpt))
    files = [("data.train_path", d.train_path)] + ([("data.eval_path", d.eval_path)] if cfg.eval.every else [])
    out = []
    for name, path in ckpts + [("model.policy_hf", m.policy_hf)] + files:
        if not path:
            out.append(f"{name} is not set")
        elif not os.path.exists(path):
            out.append(f"{name}: {path!r} does not exist")
    for name, path in ckpts:
        if path and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "cooper_model.json")):
            out.append(f"{name}: {path!r} is not a cooper_mcore checkpoint (no cooper_model.json; "
                       "make one with `cooper convert hf-to-mcore`)")
    if m.policy_hf and os.path.isdir(m.policy_hf) and not os.path.isfile(os.path.join(m.policy_hf, "config.json")):
        out.append(f"model.policy_hf: {m.policy_hf!r} has no config.json (an HF model folder is expected)")
    for name, path in files:
        if path and os.path.exists(path):
            if not os.path.isfile(path):
                out.append(f"{name}: {path!r} is not a file")
            elif not path.lower().endswith((".jsonl", ".json", ".ndjson", ".parquet", ".pq")):
                out.append(f"{name}: {path!r} is neither JSONL (.jsonl/.json/.ndjson) nor Parquet (.parquet/.pq)")
    if cfg.checkpoint.resume not in ("none", "auto") and not os.path.isdir(cfg.checkpoint.resume):
        out.append(f"checkpoint.resume must be 'none', 'auto' or a checkpoint folder; got {cfg.checkpoint.resume!r}")
    return out
