"""Checks of a whole Cooper config before any work starts: one error listing every problem.

:func:`validate` (what ``cooper train`` calls) and :func:`config_problems` (the list it reports)
check the choices of every setting, the parallel layout against the world size and the models'
shapes (read from the checkpoints' ``cooper_model.json``), that the policy checkpoint and
``model.policy_hf`` are the same model (vocabulary and shapes), the batch sizes, and that every
path the run reads exists and its JSON metadata parses. The config's types are in
:mod:`cooper_mcore.config.schema`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import typing
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any, Literal, NamedTuple, Optional

import torch

from cooper_mcore.checkpoint.model import META_FILE, checkpoint_arch_fields, is_model_checkpoint
from cooper_mcore.config.model_shapes import random_init_shapes
from cooper_mcore.config.schema import CooperConfig, OptimSection, RewardMode, SFTConfig, VerifyRMConfig
from cooper_mcore.files import read_json_object
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.parallel_layout import ParallelConfig

#: how to install the SGLang engine (``rollout.engine=sglang``): the version the project is tested with,
#: which the ``gpu`` extra pins too (docs/sglang.md)
SGLANG_INSTALL = "pip install 'sglang==0.5.23' (also in cooper_mcore's gpu extra)"
#: fields the policy checkpoint's ``cooper_model.json`` "arch" and ``model.policy_hf``'s
#: ``config.json`` must agree on: (arch field, config.json key)
_SAME_MODEL_FIELDS = (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                      ("num_layers", "num_hidden_layers"), ("num_attention_heads", "num_attention_heads"),
                      ("num_query_groups", "num_key_value_heads"), ("ffn_hidden_size", "intermediate_size"))


def validate(cfg: CooperConfig | SFTConfig | VerifyRMConfig, world_size: Optional[int],
             elsewhere: Optional[Elsewhere] = None) -> None:
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

    Numbers are checked as the run uses them: floats in the dtype of the tensors they meet
    (:func:`float_problem`), integers within 64 bits, seeds within what every generator takes.
    ``cooper plan`` and ``cooper rehearse`` run the same checks of a Cooper run away from its
    machines (``elsewhere``): with the models' shapes they found, without looking for its files or
    its rollout engine's package.

    Args:
        cfg: the job's config.
        world_size: the number of processes (``WORLD_SIZE``); None (``elsewhere`` only): the layout
            is not checked against a world.
        elsewhere: see :class:`Elsewhere` (a Cooper run only).

    Raises:
        ValueError: the one problem found in one line (``invalid config: ...``), or every problem
            found, one per line under ``invalid config (N problems):``.
    """
    if elsewhere is not None:
        assert isinstance(cfg, CooperConfig), "only a Cooper run is checked away from its machines"
        problems = config_problems(cfg, world_size, elsewhere)
    else:
        assert world_size is not None, "a run checked where it runs has a world size"
        problems = JOB_PROBLEMS[type(cfg)](cfg, world_size)
    if problems:
        hints = []
        if any("does not exist" in p and "tiny_assets" in p for p in problems):
            hints.append("The tiny assets are made by `cooper tiny-assets --out runs/tiny_assets` "
                         "(examples/tiny_cpu.yaml reads them from there).")
        if any("does not exist" in p and "tests/fixtures/" in p for p in problems):
            hints.append("tests/fixtures/ is a folder of the cooper_mcore repository, not of the installed package: "
                         "run from a checkout, or point the setting at your own file.")
        if len(problems) == 1:  # one line, as every other user error
            raise ValueError(" ".join([f"invalid config: {problems[0]}", *hints]))
        raise ValueError(f"invalid config ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems)
                         + "".join(f"\n{h}" for h in hints))


def config_problems(cfg: CooperConfig, world_size: Optional[int], elsewhere: Optional[Elsewhere] = None) -> list[str]:
    """Every problem :func:`validate` reports, in a fixed order (empty when the config is fine).

    Args:
        cfg: the run's config.
        world_size: the number of processes; None: the layout is not checked against a world (a
            preset rehearsed at another size).
        elsewhere: the run checked away from the machines it will run on (``cooper plan``,
            ``cooper rehearse``): the models' shapes are given, the files it reads and the rollout
            engine's package are not looked for. None: checked where it runs (``cooper train``).
    """
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
    out += int_problems(cfg) + seed_problems([("train.seed", t.seed)])
    out += float_problems(_run_floats(cfg))
    if "{question}" not in cfg.data.template:
        out.append(f"data.template {cfg.data.template!r} has no {{question}} placeholder")
    models, model_problems = _run_models(cfg, elsewhere)
    out += _layout_problems(cfg, world_size, models, model_problems)
    out += _engine_problems(cfg, models[0].arch if models else None, installed=elsewhere is None)
    if elsewhere is None:
        out += _path_problems(cfg)
        out += _policy_hf_problems(cfg)
    return out


def _run_floats(cfg: CooperConfig) -> list[tuple[str, Optional[float], Range]]:
    """A Cooper run's float settings and their ranges (:func:`float_problems`)."""
    a, ro, m = cfg.algo, cfg.rollout, cfg.model
    greedy = Range(low=0, note=" (0: greedy)")
    return [("model.moe_aux_loss_coef", m.moe_aux_loss_coef, NON_NEGATIVE),
            ("rollout.temperature", ro.temperature, greedy), ("rollout.top_p", ro.top_p, TOP_P),
            ("rollout.sglang_mem_fraction", ro.sglang_mem_fraction, Range(0, 1, low_open=True, high_open=True)),
            ("reward.verifier_timeout_s", cfg.reward.verifier_timeout_s, Range(0, low_open=True, dtype=None)),
            ("reward.unverifiable_reward", cfg.reward.unverifiable_reward, Range()),
            ("algo.clip_low", a.clip_low, NON_NEGATIVE), ("algo.clip_high", a.clip_high, NON_NEGATIVE),
            ("algo.clip_ratio_c", a.clip_ratio_c, Range(1, low_open=True, note=" (or null: no dual clip)")),
            ("algo.kl_coef", a.kl_coef, NON_NEGATIVE), ("algo.adv_eps", a.adv_eps, NON_NEGATIVE),
            ("algo.adv_std_floor", a.adv_std_floor, NON_NEGATIVE), ("algo.entropy_coef", a.entropy_coef, Range()),
            ("algo.tis_cap", a.tis_cap, Range(0, low_open=True, note=" (or null: off)")),
            ("algo.logprob_diff_guard", a.logprob_diff_guard, Range(0, low_open=True, note=" (or null: off)")),
            *_optim_floats("optim", cfg.optim, NON_NEGATIVE), *_optim_floats("rm.optim", cfg.rm.optim, NON_NEGATIVE),
            ("rm.anchor_weight", cfg.rm.anchor_weight, NON_NEGATIVE),
            ("rm.assistant_timeout_s", cfg.rm.assistant_timeout_s, Range(0, low_open=True, dtype=None)),
            ("eval.temperature", cfg.eval.temperature, greedy), ("eval.top_p", cfg.eval.top_p, TOP_P)]


def _optim_floats(prefix: str, o: OptimSection, lr: Range) -> list[tuple[str, Optional[float], Range]]:
    """An optimizer section's floats: the learning rate (``lr``'s range), weight decay and the clip."""
    return [(f"{prefix}.lr", o.lr, lr), (f"{prefix}.weight_decay", o.weight_decay, NON_NEGATIVE),
            (f"{prefix}.clip_grad", o.clip_grad, Range(0, note=" (0: off)"))]


# ----------------------------------------------------------------------------- numbers as the run uses them


class Range(NamedTuple):
    """The values a float setting may take (:func:`float_problem`)."""

    low: Optional[float] = None
    """Lowest value (None: no bound)."""
    high: Optional[float] = None
    """Highest value (None: no bound)."""
    low_open: bool = False
    """``> low`` rather than ``>= low``."""
    high_open: bool = False
    """``< high`` rather than ``<= high``."""
    dtype: Optional[str] = "float32"
    """The torch dtype the run computes with the value in (losses, clamps, the optimizer's fp32 master
    weights: float32 even for bf16 models); None: used as a Python float only (a timeout)."""
    note: str = ""
    """Appended to the range in the message, e.g. `` (or null: off)``."""

    def describe(self) -> str:
        """The range in words: ``>= 0``, ``in (0, 1]``, ``a finite number``."""
        low, high = (f"{v:g}" if v is not None else None for v in (self.low, self.high))
        if low is not None and high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        if high is not None:
            return f"{'<' if self.high_open else '<='} {high}"
        return "a finite number"


NON_NEGATIVE = Range(low=0)
TOP_P = Range(0, 1, low_open=True)


def float_problem(name: str, value: Optional[float], allowed: Range) -> Optional[str]:
    """Why the float setting ``name`` cannot be used as the run uses it, or None (also for None,
    which the schema allows only where null means "off").

    The value must be finite and in ``allowed``'s range, and in ``allowed.dtype`` (the tensors it
    meets) neither overflow nor, when nonzero, fall below the dtype's smallest normal number: there
    ``1e-300`` is 0 (a TIS cap or a learning rate that silently stops training) and a subnormal's
    reciprocal or log is infinite (a temperature the logits are divided by).
    """
    if value is None:
        return None
    value = float(value)
    low, high = allowed.low, allowed.high
    inside = math.isfinite(value) and not (
        low is not None and (value < low or (allowed.low_open and value == low))) and not (
        high is not None and (value > high or (allowed.high_open and value == high)))
    if not inside:
        bound = allowed.describe()
        if not math.isfinite(value) and bound != "a finite number":
            bound += " and finite"
        return f"{name} must be {bound}{allowed.note}, got {value}"
    if allowed.dtype is None or value == 0:
        return None
    info = torch.finfo(getattr(torch, allowed.dtype))
    used = torch.tensor(value, dtype=getattr(torch, allowed.dtype)).item()
    if not math.isfinite(used):
        return (f"{name}={value:g} overflows {allowed.dtype}, the type the run computes it in (at most "
                f"{info.max:.3g}){allowed.note}")
    if abs(used) < info.tiny:
        became = "0" if used == 0 else f"the subnormal {used:.3g}"
        return (f"{name}={value:g} is {became} in {allowed.dtype}, the type the run computes it in (its reciprocal "
                f"and log are not finite there): use a magnitude of at least {info.tiny:.3g}"
                f"{'' if allowed.low_open and low == 0 else ' or 0'}{allowed.note}")
    return None


def float_problems(settings: list[tuple[str, Optional[float], Range]]) -> list[str]:
    """:func:`float_problem` of each ``(name, value, range)``."""
    return [p for name, value, allowed in settings if (p := float_problem(name, value, allowed)) is not None]


#: the largest seed: every generator the run seeds takes it, after the small offsets added per rank
#: and per model (NumPy's and SGLang's seeds are 32-bit)
MAX_SEED = 2**31 - 1
#: the range of an integer setting: a 64-bit integer, as the tensors and the C libraries that get it
INT64 = (-(2**63), 2**63 - 1)


def seed_problems(seeds: list[tuple[str, int]]) -> list[str]:
    """Seeds outside ``0..MAX_SEED``, by setting."""
    return [f"{name} must be in 0..{MAX_SEED} (a seed every random generator takes), got {value}"
            for name, value in seeds if isinstance(value, int) and not 0 <= value <= MAX_SEED]


def int_problems(cfg: Any, prefix: str = "") -> list[str]:
    """Integer settings (anywhere in ``cfg``) that do not fit in 64 bits."""
    out = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value):
            out += int_problems(value, f"{prefix}{f.name}.")
        elif isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
            out.append(f"{prefix}{f.name}={value} does not fit in a 64-bit integer")
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


def _data_parallel(par: ParallelConfig, world_size: Optional[int]) -> tuple[list[str], Optional[int]]:
    """The layout's problems of its own, and the data-parallel size (None when it has none, or
    without a world size)."""
    if par.tp < 1 or par.pp < 1:
        return [f"parallel.tp and parallel.pp must be >= 1, got tp={par.tp} pp={par.pp}"], None
    out = []
    if par.sequence_parallel and par.tp == 1:
        out.append("parallel.sequence_parallel needs parallel.tp > 1")
    if world_size is None:
        return out, None
    if world_size % (par.tp * par.pp):
        out.append(f"the world size {world_size} is not divisible by tp*pp = {par.tp}*{par.pp}")
        return out, None
    return out, world_size // (par.tp * par.pp)


def _layout_problems(cfg: CooperConfig, world_size: Optional[int], models: list[_Model],
                     model_problems: list[str]) -> list[str]:
    """The parallel layout against the world size (None: not checked), the batch sizes and the
    models' shapes (``models``; ``model_problems``: why their configs cannot be read)."""
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
    policy = models[0] if models else None
    if cfg.model.moe_routing_replay and policy is not None and policy.arch is not None \
            and not isinstance(policy.arch.get("moe"), dict):
        out.append(f"model.moe_routing_replay needs a mixture-of-experts policy; {policy.name} ({policy.path}) "
                   "is dense")
    return out + model_problems + _model_layout_problems(par, models, world_size,
                                                         {"model.policy_ckpt": cfg.model.dtype})


class Elsewhere(NamedTuple):
    """A Cooper run checked away from the machines it will run on (``cooper plan``, ``cooper
    rehearse``): its models' shapes as found there (:func:`cooper_mcore.planner.report.find_shapes`),
    since the checkpoints need not be here; the files it reads and the rollout engine's package are
    not looked for."""

    policy: Optional[ArchSpec]
    """The policy's architecture (None: unknown, the models' checks are left out)."""
    rm: Optional[ArchSpec]
    """The reward model's (None without one, or unknown)."""


class _Model(NamedTuple):
    """A model a job builds: the setting that names it, its checkpoint or config, and its shape's
    fields (``ArchSpec.to_dict``; None when unreadable: the path checks report why) and dtype."""

    name: str
    path: str
    arch: Optional[dict[str, Any]]
    dtype: Optional[str]


def _checkpoint_model(name: str, ckpt: str) -> _Model:
    return _Model(name, ckpt, *checkpoint_arch_fields(ckpt))


def _run_models(cfg: CooperConfig, elsewhere: Optional[Elsewhere] = None) -> tuple[list[_Model], list[str]]:
    """A Cooper run's models (the RM when it has one): their checkpoints (or, ``elsewhere``, the shapes
    given for them), or with ``model.init: random`` their configs
    (:func:`~cooper_mcore.config.model_shapes.random_init_shapes`); and why a config cannot be read."""
    if not cfg.model.random_init:
        names = [("model.policy_ckpt", cfg.model.policy_ckpt)] + ([("model.rm_ckpt", cfg.model.rm_ckpt)]
                                                                  if _uses_rm(cfg) else [])
        if elsewhere is None:
            return [_checkpoint_model(name, ckpt) for name, ckpt in names], []
        if elsewhere.policy is None:
            return [], []
        archs = [elsewhere.policy, elsewhere.rm or elsewhere.policy]
        return [_Model(name, ckpt, arch.to_dict(), None) for (name, ckpt), arch in zip(names, archs)], []
    try:
        shapes = random_init_shapes(cfg.model, _uses_rm(cfg))
    except ValueError as e:
        return [], [str(e)]
    return [_Model(name, s.source, s.arch.to_dict(), None)
            for name, s in zip(("model.policy_config", "model.rm_config"), shapes) if s is not None], []


def _model_layout_problems(par: ParallelConfig, models: list[_Model], world_size: Optional[int],
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


def _expert_layout_problems(ep: int, etp: int, pp: int, world_size: Optional[int]) -> list[str]:
    """The expert-parallel layout against the world size (megatron's expert groups: ``etp*ep*pp``
    must divide it, as ``tp*pp`` does for the dense layers; None: no world to check against)."""
    if ep < 1 or etp < 1:
        return [f"parallel.ep and parallel.etp must be >= 1, got ep={ep} etp={etp}"]
    if world_size is not None and world_size % (etp * ep * pp):
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


def _engine_problems(cfg: CooperConfig, policy_arch: Optional[dict[str, Any]], installed: bool) -> list[str]:
    """What the rollout engine cannot serve, and (``installed``) an engine whose package is not
    installed here. SGLang's Qwen3-MoE (``srt/models/qwen3_moe.py``, 0.5.x) builds every layer sparse
    whatever ``mlp_only_layers``/``decoder_sparse_step`` say, so a policy (``policy_arch``: its shape's
    fields) with dense layers would be served wrong (log-probabilities ~1e-2 off, measured) rather
    than refused. SGLang loads its first weights from ``model.policy_hf``, which a run with random
    weights does not have."""
    ro = cfg.rollout
    if ro.max_staleness and not ro.disaggregated:
        return [f"rollout.max_staleness={ro.max_staleness} needs rollout.placement=disaggregated: a colocated "
                "engine shares the trainer's devices and generates only between its updates"]
    out = _disaggregated_problems(cfg) if ro.disaggregated else []
    if not ro.uses_sglang:
        return out
    if cfg.model.random_init:
        return out + ["model.init=random needs rollout.engine=hf: SGLang starts from the weights in model.policy_hf, "
                      "the transformers engine is built empty and filled by the weight push"]
    if not 1024 <= ro.sglang_base_port <= 60000:
        out.append(f"rollout.sglang_base_port must be in 1024..60000 (each local rank takes 10 ports above it), "
                   f"got {ro.sglang_base_port}")
    if installed and not sglang_installed():
        out.append(f"rollout.engine=sglang needs SGLang, which is not installed here: {SGLANG_INSTALL}; or set "
                   "rollout.engine=hf (the transformers engine)")
    moe = policy_arch.get("moe") if policy_arch else None
    if isinstance(moe, dict) and (moe.get("mlp_only_layers") or moe.get("decoder_sparse_step", 1) != 1):
        out.append(f"model.policy_ckpt ({cfg.model.policy_ckpt}) is a Qwen3-MoE with dense layers (mlp_only_layers="
                   f"{moe.get('mlp_only_layers')}, decoder_sparse_step={moe.get('decoder_sparse_step', 1)}), which "
                   "SGLang serves as all-sparse; use rollout.engine=hf, or a model whose layers are all sparse")
    return out


def _disaggregated_problems(cfg: CooperConfig) -> list[str]:
    """What the disaggregated placement does not serve: routing replay (routes from an engine apart are not
    carried), and negative counts. (Engine GPUs apart from the trainer's are refused where the engine is built.)"""
    ro, out = cfg.rollout, []
    if cfg.model.moe_routing_replay:
        out.append("model.moe_routing_replay needs rollout.placement=colocated (routes from an engine process are "
                   "not carried yet)")
    out += [f"rollout.{name} must be >= 0, got {value}" for name, value in
            (("max_staleness", ro.max_staleness), ("engine_threads", ro.engine_threads),
             ("engine_restarts", ro.engine_restarts)) if value < 0]
    return out


def sglang_installed() -> bool:
    """Whether the ``sglang`` package is installed here (found, not imported: that takes seconds)."""
    return importlib.util.find_spec("sglang") is not None


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
    out += int_problems(cfg) + seed_problems([("train.seed", t.seed), ("data.seed", d.seed)])
    out += float_problems([*_optim_floats("optim", o, Range(0, low_open=True)),
                           ("data.mix_wrong", d.mix_wrong, Range(0, 1, dtype=None))])
    if t.min_lr is not None and not 0 <= t.min_lr <= o.lr:
        out.append(f"train.min_lr must be in [0, optim.lr={o.lr}] (or null: constant), got {t.min_lr}")
    else:
        out += float_problems([("train.min_lr", t.min_lr, NON_NEGATIVE)])
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
    out += int_problems(cfg) + seed_problems([("train.seed", t.seed)])
    out += float_problems([*_optim_floats("optim", o, Range(0, low_open=True)),
                           ("train.threshold", t.threshold, Range(0, 1, low_open=True, high_open=True)),
                           ("train.gate", t.gate, Range(0, 1, note=" (0: no gate)"))])
    if o.warmup_steps:
        out.append(f"optim.warmup_steps must be 0 (train-rm trains at a constant learning rate), got {o.warmup_steps}")
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
