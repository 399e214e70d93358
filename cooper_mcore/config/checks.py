"""Checks of a whole Cooper config before any work starts: one error listing every problem.

:func:`validate` (what ``cooper train`` calls) and :func:`config_problems` (the list it reports)
check the choices of every setting, the parallel layout against the world size and the models'
shapes (read from the checkpoints' ``cooper_model.json``), that the policy checkpoint and
``model.policy_hf`` are the same model (vocabulary and shapes), the batch sizes, and that every
path the run reads exists and its JSON metadata parses. The config's types are in
:mod:`cooper_mcore.config.schema`.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, Literal, NamedTuple, Optional

from cooper_mcore.checkpoint.model import META_FILE, checkpoint_arch_fields, is_model_checkpoint
from cooper_mcore.config.model_shapes import random_init_shapes
from cooper_mcore.config.schema import CooperConfig, RewardMode, SFTConfig, VerifyRMConfig
from cooper_mcore.files import read_json_object
from cooper_mcore.parallel import ParallelConfig

#: fields the policy checkpoint's ``cooper_model.json`` "arch" and ``model.policy_hf``'s
#: ``config.json`` must agree on: (arch field, config.json key)
_SAME_MODEL_FIELDS = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                      ("num_layers", "num_hidden_layers"), ("num_attention_heads", "num_attention_heads"),
                      ("num_query_groups", "num_key_value_heads"), ("ffn_hidden_size", "intermediate_size"))


def validate(cfg: CooperConfig | SFTConfig | VerifyRMConfig, world_size: int) -> None:
    """One clear error for an impossible run of any job (``cooper train``, ``sft``, ``train-rm``),
    before any work starts.

    Checks the parallel layout against the world size and against the models' architectures
    (read from the checkpoints' ``cooper_model.json``: attention heads, key/value heads and the
    vocabulary divisible by TP, layers by PP; with expert parallelism both models
    mixture-of-experts, experts divisible by EP, expert FFN size by ETP, the world by
    etp*ep*pp), that the batch sizes divide (prompts per step by the data-parallel size; each
    rank's ``prompts * group_size`` sequences by ``micro_batch_size * mini_batches``), the
    choices and ranges of the settings, and that every path the run reads
    exists.

    SFT and VerifyRM configs get the same checks of what they have: choices and ranges, the layout
    against the world size, the batch sizes and their checkpoint's shape, the paths they read
    (:func:`sft_problems`, :func:`verify_rm_problems`).

    Args:
        cfg: the job's config.
        world_size: the number of processes (``WORLD_SIZE``).

    Raises:
        ValueError: listing every problem found, one per line.
    """
    problems = JOB_PROBLEMS[type(cfg)](cfg, world_size)
    if problems:
        hint = ""
        if any("does not exist" in p and "tiny_assets" in p for p in problems):
            hint = ("\nThe tiny assets are made by `cooper tiny-assets --out runs/tiny_assets` "
                    "(examples/tiny_cpu.yaml reads them from there).")
        if any("does not exist" in p and "tests/fixtures/" in p for p in problems):
            hint += ("\ntests/fixtures/ is a folder of the cooper_mcore repository, not of the installed package: "
                     "run from a checkout, or point the setting at your own file.")
        raise ValueError(f"invalid config ({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n"
                         + "\n".join(f"  - {p}" for p in problems) + hint)


def config_problems(cfg: CooperConfig, world_size: int) -> list[str]:
    """Every problem :func:`validate` reports, in a fixed order (empty when the config is fine)."""
    out: list[str] = []
    t, ro, r = cfg.train, cfg.rollout, cfg.reward
    out += choice_problems(cfg)
    if cfg.uses_assistant:
        out += [f"rm.negatives=assistant needs rm.{k} (or choose negatives policy/perturb/random)"
                for k in ("assistant_url", "assistant_model") if not getattr(cfg.rm, k)]
    if t.pack_sequences and not t.max_tokens_per_micro_batch:
        out.append("train.pack_sequences needs train.max_tokens_per_micro_batch > 0 (the budget of a packed row)")
    ranges = [("train.steps", t.steps, 0), ("train.prompts_per_step", t.prompts_per_step, 1),
              ("train.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch, 0),
              ("train.micro_batch_size", t.micro_batch_size, 1), ("train.mini_batches", t.mini_batches, 1),
              ("train.logprob_chunk_tokens", t.logprob_chunk_tokens, 1),
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
    if cfg.algo.clip_ratio_c is not None and not cfg.algo.clip_ratio_c > 1:
        out.append(f"algo.clip_ratio_c must be > 1 (or null: no dual clip), got {cfg.algo.clip_ratio_c}")
    out += [f"algo.{name} must be > 0 (or null: off), got {value}" for name, value in
            (("tis_cap", cfg.algo.tis_cap), ("logprob_diff_guard", cfg.algo.logprob_diff_guard))
            if value is not None and not value > 0]
    out += [f"{name} must be in (0, 1], got {value}" for name, value in
            (("rollout.top_p", ro.top_p), ("eval.top_p", cfg.eval.top_p)) if not 0 < value <= 1]
    if "{question}" not in cfg.data.template:
        out.append(f"data.template {cfg.data.template!r} has no {{question}} placeholder")
    out += _layout_problems(cfg, world_size)
    out += _engine_problems(cfg)
    out += _path_problems(cfg)
    out += _policy_hf_problems(cfg)
    return out


def _uses_rm(cfg: CooperConfig) -> bool:
    """For the other checks: an invalid mode (reported on its own) counts as reading the RM."""
    return not isinstance(cfg.reward.mode, RewardMode) or cfg.reward.mode.uses_rm


def choice_problems(cfg: Any, prefix: str = "") -> list[str]:
    """Values outside their ``Literal``/enum choices (OmegaConf checks YAML and overrides; this also
    covers configs built in Python)."""
    out = []
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        value, hint = getattr(cfg, f.name), hints[f.name]
        name = f"{prefix}{f.name}"
        if is_dataclass(value):
            out += choice_problems(value, name + ".")
        elif typing.get_origin(hint) is Literal and value not in typing.get_args(hint):
            out.append(f"{name} must be one of {typing.get_args(hint)}, got {value!r}")
        elif isinstance(hint, type) and issubclass(hint, Enum) and not isinstance(value, hint):
            try:
                setattr(cfg, f.name, hint(value))
            except ValueError:
                out.append(f"{name} must be one of {tuple(m.value for m in hint)}, got {value!r}")
        elif typing.get_origin(hint) is list and typing.get_origin(typing.get_args(hint)[0]) is Literal:
            allowed = typing.get_args(typing.get_args(hint)[0])
            out += [f"{name} must hold some of {allowed}, got {v!r}" for v in value if v not in allowed]
    return out


def _data_parallel(par: ParallelConfig, world_size: int) -> tuple[list[str], Optional[int]]:
    """The layout's problems of its own, and the data-parallel size (None when it has none)."""
    if par.tp < 1 or par.pp < 1:
        return [f"parallel.tp and parallel.pp must be >= 1, got tp={par.tp} pp={par.pp}"], None
    out = []
    if par.sequence_parallel and par.tp == 1:
        out.append("parallel.sequence_parallel needs parallel.tp > 1")
    if world_size % (par.tp * par.pp):
        out.append(f"the world size {world_size} is not divisible by tp*pp = {par.tp}*{par.pp}")
        return out, None
    return out, world_size // (par.tp * par.pp)


def _layout_problems(cfg: CooperConfig, world_size: int) -> list[str]:
    """The parallel layout against the world size, the batch sizes and the models' shapes."""
    par, t = cfg.parallel, cfg.train
    out, dp = _data_parallel(par, world_size)
    if par.tp < 1 or par.pp < 1:
        return out
    if dp is not None:
        if t.prompts_per_step % dp:
            out.append(f"train.prompts_per_step={t.prompts_per_step} is not divisible by the data-parallel "
                       f"size {dp} (world {world_size} / tp {par.tp} / pp {par.pp})")
        elif t.micro_batch_size >= 1 and t.mini_batches >= 1:
            per_rank = t.prompts_per_step // dp * cfg.rollout.group_size
            if t.max_tokens_per_micro_batch and per_rank % t.mini_batches:
                out.append(f"{per_rank} sequences per data-parallel rank are not divisible by "
                           f"train.mini_batches={t.mini_batches}")
            elif not t.max_tokens_per_micro_batch and per_rank % (t.micro_batch_size * t.mini_batches):
                out.append(f"{per_rank} sequences per data-parallel rank (prompts_per_step {t.prompts_per_step} / "
                           f"dp {dp} * group_size {cfg.rollout.group_size}) are not divisible by "
                           f"micro_batch_size*mini_batches = {t.micro_batch_size}*{t.mini_batches}")
    if cfg.model.moe_aux_loss_coef is not None and cfg.model.moe_aux_loss_coef < 0:
        out.append(f"model.moe_aux_loss_coef must be >= 0, got {cfg.model.moe_aux_loss_coef}")
    models, problems = _run_models(cfg)
    policy = models[0] if models else None
    if cfg.model.moe_routing_replay and policy is not None and policy.arch is not None \
            and not isinstance(policy.arch.get("moe"), dict):
        out.append(f"model.moe_routing_replay needs a mixture-of-experts policy; {policy.name} ({policy.path}) "
                   "is dense")
    return out + problems + _model_layout_problems(par, models, world_size, {"model.policy_ckpt": cfg.model.dtype})


class _Model(NamedTuple):
    """A model a job builds: the setting that names it, its checkpoint or config, and its shape's
    fields (``ArchSpec.to_dict``; None when unreadable: the path checks report why) and dtype."""

    name: str
    path: str
    arch: Optional[dict[str, Any]]
    dtype: Optional[str]


def _checkpoint_model(name: str, ckpt: str) -> _Model:
    return _Model(name, ckpt, *checkpoint_arch_fields(ckpt))


def _run_models(cfg: CooperConfig) -> tuple[list[_Model], list[str]]:
    """A Cooper run's models (the RM when it has one): their checkpoints, or with ``model.init: random``
    their configs (:func:`~cooper_mcore.config.model_shapes.random_init_shapes`); and why a config cannot be read."""
    if not cfg.model.random_init:
        names = [("model.policy_ckpt", cfg.model.policy_ckpt)] + ([("model.rm_ckpt", cfg.model.rm_ckpt)]
                                                                  if _uses_rm(cfg) else [])
        return [_checkpoint_model(name, ckpt) for name, ckpt in names], []
    try:
        shapes = random_init_shapes(cfg.model, _uses_rm(cfg))
    except ValueError as e:
        return [], [str(e)]
    return [_Model(name, s.source, s.arch.to_dict(), None)
            for name, s in zip(("model.policy_config", "model.rm_config"), shapes) if s is not None], []


def _model_layout_problems(par: ParallelConfig, models: list[_Model], world_size: int,
                           dtypes: Optional[dict[str, str]] = None) -> list[str]:
    """``models`` against the layout: heads, key/value heads and vocabulary by tp, layers by pp,
    experts by ep/etp (:func:`_expert_model_problems`), and the dtype a model is trained in
    (``dtypes``: setting name -> dtype) against its weights'."""
    out = _dense_only_problems(par, models)
    for name, ckpt, arch, dtype in models:
        if arch is None:
            continue
        for field_name, what, size, by in (("num_attention_heads", "attention heads", par.tp, "tp"),
                                           ("num_query_groups", "key/value heads", par.tp, "tp"),
                                           ("vocab_size", "vocabulary entries", par.tp, "tp"),
                                           ("num_layers", "layers", par.pp, "pp")):
            value = arch.get(field_name)
            if isinstance(value, int) and value % size:
                out.append(f"{name} ({ckpt}) has {value} {what}, not divisible by parallel.{by}={size}")
        want = (dtypes or {}).get(name)
        if want is not None and dtype is not None and dtype != want:
            out.append(f"model.dtype={want} but {ckpt} holds {dtype} weights; convert the "
                       "checkpoint in the dtype you train in")
        out += _expert_model_problems(name, ckpt, arch, par.ep, par.expert_tp)
        if isinstance(arch.get("moe"), dict) and par.tp > 1 and not par.sequence_parallel:
            out.append(f"{name} ({ckpt}) is a mixture-of-experts model: parallel.tp={par.tp} needs "
                       "parallel.sequence_parallel=true (megatron's MoE layer refuses to train without it)")
        drift = par.expert_drift_problem() if par.ep >= 1 and par.expert_tp >= 1 else None
        if isinstance(arch.get("moe"), dict) and drift:
            out.append(f"{name} ({ckpt}) is a mixture-of-experts model: {drift}")
    if par.ep == 1 and par.etp is None:  # the expert layout is the dense one, tp*pp
        return out
    return out + _expert_layout_problems(par.ep, par.expert_tp, par.pp, world_size)


def _expert_layout_problems(ep: int, etp: int, pp: int, world_size: int) -> list[str]:
    """The expert-parallel layout against the world size (megatron's expert groups: ``etp*ep*pp``
    must divide it, as ``tp*pp`` does for the dense layers)."""
    if ep < 1 or etp < 1:
        return [f"parallel.ep and parallel.etp must be >= 1, got ep={ep} etp={etp}"]
    if world_size % (etp * ep * pp):
        return [f"the world size {world_size} is not divisible by the expert layout etp*ep*pp = {etp}*{ep}*{pp}"]
    return []


def _expert_model_problems(name: str, ckpt: str, arch: dict[str, Any], ep: int, etp: int) -> list[str]:
    """A mixture-of-experts model's experts against ``parallel.ep``/``etp``: they must split evenly.
    A dense model beside an MoE one (one ``parallel`` section for both) is built without the expert
    layout (:func:`cooper_mcore.models.builder.build_model`); :func:`_dense_only_problems` refuses ep/etp
    when neither model has experts."""
    if ep < 1 or etp < 1 or (ep == 1 and etp == 1):
        return []
    moe = arch.get("moe")
    if not isinstance(moe, dict):
        return []
    out = []
    experts, ffn = moe.get("num_experts"), moe.get("expert_ffn_hidden_size")
    if isinstance(experts, int) and experts % ep:
        out.append(f"{name} ({ckpt}) has {experts} experts per sparse layer, not divisible by parallel.ep={ep}")
    if isinstance(ffn, int) and ffn % etp:
        out.append(f"{name} ({ckpt}) has experts of FFN size {ffn}, not divisible by parallel.etp={etp}")
    return out


def _dense_only_problems(par: ParallelConfig, models: list[_Model]) -> list[str]:
    """parallel.ep/etp > 1 (etp set, not following tp) need a mixture-of-experts model among ``models``
    (the other may be dense)."""
    if par.ep == 1 and (par.etp or 1) == 1:
        return []
    archs = [m.arch for m in models]
    if not archs or any(a is None for a in archs) or any(isinstance(a.get("moe"), dict) for a in archs):
        return []  # an unreadable checkpoint is reported by the path checks
    named = " and ".join(f"{m.name} ({m.path})" for m in models)
    settings = " / ".join(f"parallel.{k}={v}" for k, v in (("ep", par.ep), ("etp", par.etp or 1)) if v > 1)
    return [f"{settings} need{'s' if ' / ' not in settings else ''} a mixture-of-experts model, but {named} "
            f"{'is' if len(models) == 1 else 'are'} dense"]


def _engine_problems(cfg: CooperConfig) -> list[str]:
    """What the rollout engine cannot serve. SGLang's Qwen3-MoE (``srt/models/qwen3_moe.py``, 0.5.x)
    builds every layer sparse whatever ``mlp_only_layers``/``decoder_sparse_step`` say, so a policy
    with dense layers would be served wrong (log-probabilities ~1e-2 off, measured) rather than refused.
    SGLang loads its first weights from ``model.policy_hf``, which a run with random weights does not have."""
    if cfg.rollout.uses_sglang and cfg.model.random_init:
        return ["model.init=random needs rollout.engine=hf: SGLang starts from the weights in model.policy_hf, "
                "the transformers engine is built empty and filled by the weight push"]
    if cfg.rollout.uses_sglang and not 1024 <= cfg.rollout.sglang_base_port <= 60000:
        return [f"rollout.sglang_base_port must be in 1024..60000 (each local rank takes 10 ports above it), "
                f"got {cfg.rollout.sglang_base_port}"]
    if not cfg.rollout.uses_sglang or not cfg.model.policy_ckpt:
        return []
    arch, _ = checkpoint_arch_fields(cfg.model.policy_ckpt)
    moe = arch.get("moe") if arch else None
    if isinstance(moe, dict) and (moe.get("mlp_only_layers") or moe.get("decoder_sparse_step", 1) != 1):
        return [f"model.policy_ckpt ({cfg.model.policy_ckpt}) is a Qwen3-MoE with dense layers (mlp_only_layers="
                f"{moe.get('mlp_only_layers')}, decoder_sparse_step={moe.get('decoder_sparse_step', 1)}), which "
                "SGLang serves as all-sparse; use rollout.engine=hf, or a model whose layers are all sparse"]
    return []


def _policy_hf_problems(cfg: CooperConfig) -> list[str]:
    """Broken JSON metadata, and a policy checkpoint that is not the model of ``model.policy_hf``
    (the rollout engine starts from the HF folder and receives the checkpoint's weights: a
    different vocabulary or shape would fail only at the first weight push)."""
    m = cfg.model
    out = []
    ckpts = [("model.policy_ckpt", m.policy_ckpt)] + ([("model.rm_ckpt", m.rm_ckpt)] if _uses_rm(cfg) else [])
    for name, ckpt in ckpts if not m.random_init else []:
        problem = _json_problem(os.path.join(ckpt, META_FILE)) if ckpt else None
        if problem:
            out.append(f"{name}: {problem}")
    hf_cfg = None
    if m.policy_hf:
        path = os.path.join(m.policy_hf, "config.json")
        problem = _json_problem(path)
        if problem:
            out.append(f"model.policy_hf: {problem}")
        elif os.path.isfile(path):
            hf_cfg = read_json_object(path)
    arch, _ = checkpoint_arch_fields(m.policy_ckpt) if m.policy_ckpt and not m.random_init else (None, None)
    if arch is None or hf_cfg is None:
        return out
    diffs = []
    for field_name, key in _SAME_MODEL_FIELDS:
        want, got = arch.get(field_name), hf_cfg.get(key)
        if key == "num_key_value_heads" and got is None:
            got = hf_cfg.get("num_attention_heads")
        if isinstance(want, int) and isinstance(got, int) and want != got:
            diffs.append(f"{field_name} {want} vs {key} {got}")
    if diffs:
        out.append(f"model.policy_ckpt ({m.policy_ckpt}) and model.policy_hf ({m.policy_hf}) are not the same model "
                   f"(checkpoint vs config.json: {', '.join(diffs)}); the rollout engine starts from model.policy_hf "
                   "and receives the checkpoint's weights: convert model.policy_hf with `cooper convert hf-to-mcore`, "
                   "or export the checkpoint with `cooper convert mcore-to-hf` and point model.policy_hf at it")
    return out


def _json_problem(path: str) -> Optional[str]:
    """Why an existing JSON metadata file cannot be read (None when it can, or does not exist: the
    path checks report that)."""
    if not os.path.isfile(path):
        return None
    try:
        read_json_object(path)
    except (OSError, ValueError) as e:
        return str(e)
    return None


def _path_problems(cfg: CooperConfig) -> list[str]:
    """Every file or folder the run reads must exist (and be of the right kind)."""
    m, d = cfg.model, cfg.data
    ckpts = [("model.policy_ckpt", m.policy_ckpt)]
    if _uses_rm(cfg):
        ckpts.append(("model.rm_ckpt", m.rm_ckpt))
    files = [("data.train_path", d.train_path)] + ([("data.eval_path", d.eval_path)] if cfg.eval.every else [])
    if m.random_init:  # no checkpoint is read; model.policy_hf holds the tokenizer (the shapes are checked apart)
        out = _read_path_problems([], [], files)
        if not m.policy_hf or not os.path.isdir(m.policy_hf):
            out.insert(0, f"model.policy_hf must be the folder of the tokenizer with model.init=random, got "
                          f"{m.policy_hf!r}")
    else:
        out = _read_path_problems(ckpts, [("model.policy_hf", m.policy_hf)], files)
    if cfg.checkpoint.resume not in ("none", "auto") and not os.path.isdir(cfg.checkpoint.resume):
        out.append(f"checkpoint.resume must be 'none', 'auto' or a checkpoint folder; got {cfg.checkpoint.resume!r}")
    return out


def _read_path_problems(ckpts: list[tuple[str, str]], hf_dirs: list[tuple[str, str]],
                        files: list[tuple[str, str]]) -> list[str]:
    """What a job reads, by setting name: model checkpoints (folders with :data:`META_FILE`), HF
    model folders (with a ``config.json``) and data files (JSONL or Parquet). Each must be set and exist."""
    out = []
    for name, path in ckpts + hf_dirs + files:
        if not path:
            out.append(f"{name} is not set")
        elif not os.path.exists(path):
            out.append(f"{name}: {path!r} does not exist")
    for name, path in ckpts:
        if path and os.path.isdir(path) and not is_model_checkpoint(path):
            out.append(f"{name}: {path!r} is not a cooper_mcore checkpoint (no {META_FILE}; "
                       "make one with `cooper convert hf-to-mcore`)")
    for name, path in hf_dirs:
        if path and os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            out.append(f"{name}: {path!r} has no config.json (an HF model folder is expected)")
    for name, path in files:
        if path and os.path.exists(path):
            if os.path.isdir(path):
                out.append(f"{name}: {path!r} is a directory, expected a .jsonl or .parquet file")
            elif not os.path.isfile(path):
                out.append(f"{name}: {path!r} is not a file")
            elif not path.lower().endswith((".jsonl", ".json", ".ndjson", ".parquet", ".pq")):
                out.append(f"{name}: {path!r} is neither JSONL (.jsonl/.json/.ndjson) nor Parquet (.parquet/.pq)")
    return out


def _batch_problems(global_batch_size: int, micro_batch_size: int, dp: Optional[int]) -> list[str]:
    """A job's global batch against its micro-batches and data-parallel ranks."""
    if global_batch_size < 1 or micro_batch_size < 1 or dp is None or global_batch_size % (micro_batch_size * dp) == 0:
        return []
    return [f"train.global_batch_size={global_batch_size} is not a multiple of train.micro_batch_size * the "
            f"data-parallel size = {micro_batch_size} * {dp}"]


def _checkpoint_problems(par: ParallelConfig, ckpt: str, world_size: int) -> list[str]:
    """The one checkpoint a job trains (setting ``ckpt``): its metadata, its shape against the layout."""
    problem = _json_problem(os.path.join(ckpt, META_FILE)) if ckpt else None
    out = [f"ckpt: {problem}"] if problem else []
    if par.tp >= 1 and par.pp >= 1:
        out += _model_layout_problems(par, [_checkpoint_model("ckpt", ckpt)], world_size)
    return out


def sft_problems(cfg: SFTConfig, world_size: int) -> list[str]:
    """Every problem of an SFT job's config that :func:`validate` reports (``cooper sft``); the
    examples themselves are checked by :func:`cooper_mcore.jobs.sft.check_sft`."""
    t, o, d = cfg.train, cfg.optim, cfg.data
    out = choice_problems(cfg)
    ranges = [("train.steps", t.steps, 1), ("train.global_batch_size", t.global_batch_size, 1),
              ("train.micro_batch_size", t.micro_batch_size, 1), ("train.log_every", t.log_every, 0),
              ("optim.warmup_steps", o.warmup_steps, 0), ("data.num_examples", d.num_examples, 1)]
    out += [f"{name} must be >= {low}, got {value}" for name, value, low in ranges if value < low]
    out += [f"optim.lr must be > 0, got {o.lr}"] if not o.lr > 0 else []
    if t.min_lr is not None and not 0 <= t.min_lr <= o.lr:
        out.append(f"train.min_lr must be in [0, optim.lr={o.lr}] (or null: constant), got {t.min_lr}")
    if not 0 <= d.mix_wrong <= 1:
        out.append(f"data.mix_wrong must be in [0, 1], got {d.mix_wrong}")
    if "{question}" not in d.template:
        out.append(f"data.template {d.template!r} has no {{question}} placeholder")
    layout, dp = _data_parallel(cfg.parallel, world_size)
    out += layout + _batch_problems(t.global_batch_size, t.micro_batch_size, dp)
    out += _read_path_problems([("ckpt", cfg.ckpt)], [], [])
    return out + _checkpoint_problems(cfg.parallel, cfg.ckpt, world_size)


def verify_rm_problems(cfg: VerifyRMConfig, world_size: int) -> list[str]:
    """Every problem of a VerifyRM job's config that :func:`validate` reports (``cooper train-rm``)."""
    t, o, d = cfg.train, cfg.optim, cfg.data
    out = choice_problems(cfg)
    ranges = [("train.epochs", t.epochs, 1), ("train.global_batch_size", t.global_batch_size, 1),
              ("train.micro_batch_size", t.micro_batch_size, 1), ("train.eval_every", t.eval_every, 0),
              ("train.save_every", t.save_every, 0)]
    out += [f"{name} must be >= {low}, got {value}" for name, value, low in ranges if value < low]
    out += [f"optim.lr must be > 0, got {o.lr}"] if not o.lr > 0 else []
    if o.warmup_steps:
        out.append(f"optim.warmup_steps must be 0 (train-rm trains at a constant learning rate), got {o.warmup_steps}")
    if not 0.0 < t.threshold < 1.0:
        out.append(f"train.threshold must be in (0, 1), got {t.threshold}")
    if not 0.0 <= t.gate <= 1.0:
        out.append(f"train.gate must be in [0, 1] (0: no gate), got {t.gate}")
    if (t.gate or t.keep_best) and not d.eval_path:
        out.append("train.gate and train.keep_best judge the epochs by their evaluation: set data.eval_path")
    if d.max_length is not None and d.max_length < 1:
        out.append(f"data.max_length must be >= 1 (or null: the model's limit), got {d.max_length}")
    layout, dp = _data_parallel(cfg.parallel, world_size)
    out += layout + _batch_problems(t.global_batch_size, t.micro_batch_size, dp)
    files = [("data.train_path", d.train_path)] + ([("data.eval_path", d.eval_path)] if d.eval_path else [])
    out += _read_path_problems([("ckpt", cfg.ckpt)], [], files)
    return out + _checkpoint_problems(cfg.parallel, cfg.ckpt, world_size)


#: each job's config class -> the function listing its problems (:func:`validate`)
JOB_PROBLEMS: dict[type, Callable[[Any, int], list[str]]] = {
    CooperConfig: config_problems, SFTConfig: sft_problems, VerifyRMConfig: verify_rm_problems}
