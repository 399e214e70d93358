"""A preset made rehearsable: its layout and features kept, its sizes shrunk to a tiny CPU run.

:func:`plan_rehearsal` turns a preset's config into the config of a rehearsal (a few steps of the
same job on CPU with gloo, with a tiny model of the preset's architecture family) and lists every
setting it had to change, with the reason. Pure config work: nothing is built or run here.

What is kept: TP, PP, expert parallelism (EP, halved until the rehearsal's processes hold it),
sequence parallelism, the distributed optimizer (every run has one), the reward mode and
``rm_transform``, the negatives (an ``assistant`` is a local stand-in server), the micro-batching
(fixed, token budget, packing) and ``mini_batches``, the offload and release flags, the GRPO and
optimizer settings, the dtype. What changes: the model (tiny, of the same family, with the preset's
GQA ratio, tied or untied embeddings and q/k norm; a mixture-of-experts family keeps the tiny
family's 8 experts, top 2), the data (the tiny arithmetic task), the sizes (group 4, a few prompts
per rank, short completions, a token budget scaled to them), the cadence (evaluation every step, a
checkpoint every 2 steps, 4 steps with a stop signal in step 3), the data-parallel size (2 where
``tp * pp <= 2``, else 1: at most 4 processes on 2 cores), expert TP (halved after EP where the
processes do not hold it), and a rollout engine that is not installed (SGLang -> transformers).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from cooper_mcore.config.model_shapes import ModelShape
from cooper_mcore.config.presets import shipped_model_config
from cooper_mcore.config.schema import CooperConfig
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.planner.report import find_shapes

#: the rehearsal's run: STEPS steps, a stop signal in step STOP_STEP, a checkpoint every CKPT_EVERY
STEPS = 4
#: a real-shape rehearsal (one GPU, the preset's model shape): REAL_STEPS steps of REAL_PROMPTS prompts
REAL_STEPS = 3
REAL_PROMPTS = 4
STOP_STEP = 3
CKPT_EVERY = 2
MAX_WORLD = 4
GROUP_SIZE = 4
PROMPTS_PER_RANK = 2
MAX_NEW_TOKENS = 24
EVAL_PROMPTS = 4
#: the longest tiny prompt plus a completion, in tokens: the unit of the scaled token budget
TINY_SEQUENCE = 16 + MAX_NEW_TOKENS
MIN_HEAD_DIM = 8
TINY_HIDDEN = 64  # about this wide: the tiny task's SFT then gets some answers right
BUCKET_MB = 1  # several buckets per push, as a real model's push has
TIMEOUT_MINUTES = 5  # collectives: a rank-divergent call fails in minutes, not after the preset's hour


@dataclass
class Substitution:
    """One setting the rehearsal runs differently from the preset."""

    setting: str
    preset: str
    rehearsal: str
    why: str

    def __str__(self) -> str:
        return f"{self.setting}: {self.preset} -> {self.rehearsal} ({self.why})"


@dataclass
class TinyShape:
    """The tiny models' architecture: the preset's family traits at a size every split allows."""

    family: str
    """The policy's family (:data:`cooper_mcore.models.tiny.FAMILIES`)."""
    rm_family: str
    """The reward model's family (its backbone; the scalar head is added)."""
    fields: dict[str, Any]
    """Config fields of both models: heads, key/value heads, head_dim, tied embeddings."""
    hidden_size: int
    """Hidden size of both models."""
    num_layers: int
    """Decoder layers of both models (a multiple of PP)."""
    real: bool = False
    """The preset's own shape (``fields`` then hold its sizes and vocabulary too)."""

    def describe(self) -> str:
        f = self.fields
        return (f"{self.family} (rm {self.rm_family}){' at the real shape' if self.real else ''}: {self.num_layers} "
                f"layers, hidden {self.hidden_size}, {f['num_attention_heads']} heads / {f['num_key_value_heads']} "
                f"kv heads, {'tied' if f['tie_word_embeddings'] else 'untied'} embeddings")


@dataclass
class RehearsalPlan:
    """What a rehearsal runs (see the module doc)."""

    preset: str
    """The preset's path."""
    cfg: CooperConfig
    """The rehearsal's config (model and data paths are filled in once the tiny assets exist)."""
    nproc: int
    """Processes (tp * pp * dp)."""
    shape: TinyShape
    """The tiny models."""
    substitutions: list[Substitution] = field(default_factory=list)
    """Every setting changed from the preset, with the reason."""
    assistant: bool = False
    """Whether a stand-in assistant server is started (``rm.negatives: assistant``)."""
    real_shape: bool = False
    """One process at the preset's model shape: one run that measures, no stop and resume."""
    model_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """At the real shape: the HF configs of the preset's models by setting (``model.policy_config``,
    ``model.rm_config``), which the run builds with random weights."""

    def layout(self) -> str:
        p = self.cfg.parallel
        experts = f"ep={p.ep} etp={p.expert_tp} " if p.ep > 1 or (p.etp or 1) > 1 else ""
        return (f"tp={p.tp} pp={p.pp} dp={self.nproc // (p.tp * p.pp)} {experts}sequence_parallel="
                f"{str(p.sequence_parallel).lower()} (world {self.nproc}), distributed optimizer")

    def features(self) -> str:
        c = self.cfg
        t = c.train
        batching = ("packed" if t.pack_sequences else "token budget") if t.max_tokens_per_micro_batch else "fixed"
        o = c.offload
        offloaded = [f.name for f in dataclasses.fields(o) if f.name != "release_engine" and getattr(o, f.name)]
        return (f"reward {c.reward.mode.value} ({c.reward.rm_transform}), negatives {c.rm.negatives}, "
                f"micro-batches {batching}, mini_batches {t.mini_batches}, offload [{', '.join(offloaded) or '-'}], "
                f"release_engine {str(o.release_engine).lower()}, dtype {c.model.dtype}, engine {c.rollout.engine}")


def tiny_shape(policy: ArchSpec, rm: Optional[ArchSpec], tp: int, pp: int) -> TinyShape:
    """Tiny models with ``policy``'s family traits that split at ``tp`` and ``pp``.

    Key/value heads are the smallest multiple of ``tp`` that is at least 2 (so GQA stays GQA at TP=1),
    the query heads keep the preset's ratio, the width is about :data:`TINY_HIDDEN`, layers are ``2 * pp``.
    """
    kv = max(2, tp) if max(2, tp) % tp == 0 else tp
    heads = kv * policy.heads_per_group
    head_dim = max(MIN_HEAD_DIM, (TINY_HIDDEN // heads) // 2 * 2)  # even: rotary embeddings pair dimensions
    fields = {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
              "tie_word_embeddings": policy.tie_word_embeddings, **_tiny_moe_pattern(policy, rm)}
    rm_family = (rm or policy).family
    return TinyShape(family=policy.family, rm_family=rm_family, fields=fields, hidden_size=heads * head_dim,
                     num_layers=2 * pp)


def _tiny_moe_pattern(policy: ArchSpec, rm: Optional[ArchSpec]) -> dict:
    """All tiny MoE layers sparse when the preset's MoE model has no dense layer (Qwen3-30B-A3B): what
    SGLang can serve (it builds every Qwen3-MoE layer sparse); else the tiny family's dense last layer."""
    moe = next((a for a in (policy, rm) if a is not None and a.moe is not None), None)
    return {"mlp_only_layers": []} if moe is not None and all(moe.moe_layers()) else {}


def real_shape(policy: ArchSpec, rm: Optional[ArchSpec]) -> TinyShape:
    """The preset's own model shape (random weights), for a rehearsal on one GPU."""
    fields = {"num_attention_heads": policy.num_attention_heads, "num_key_value_heads": policy.num_query_groups,
              "head_dim": policy.head_dim, "tie_word_embeddings": policy.tie_word_embeddings,
              "intermediate_size": policy.ffn_hidden_size, "vocab_size": policy.vocab_size,
              "max_position_embeddings": policy.max_position_embeddings, "rms_norm_eps": policy.rms_norm_eps,
              "rope_theta": policy.rope.theta, **_moe_fields(policy, rm)}
    return TinyShape(family=policy.family, rm_family=(rm or policy).family, fields=fields,
                     hidden_size=policy.hidden_size, num_layers=policy.num_layers, real=True)


def _moe_fields(policy: ArchSpec, rm: Optional[ArchSpec]) -> dict:
    """The experts of the preset's mixture-of-experts model (the policy's, else the RM's) as HF config
    fields (they shape only the qwen3_moe family's models: :data:`cooper_mcore.models.tiny.MOE_FIELDS`)."""
    moe = next((a.moe for a in (policy, rm) if a is not None and a.moe is not None), None)
    if moe is None:
        return {}
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
            "moe_intermediate_size": moe.expert_ffn_hidden_size, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": moe.decoder_sparse_step, "mlp_only_layers": list(moe.mlp_only_layers),
            "router_aux_loss_coef": moe.router_aux_loss_coef}


def _cap_layout(tp: int, pp: int, subs: list[Substitution]) -> tuple[int, int, int]:
    """(tp, pp, dp) within :data:`MAX_WORLD` processes."""
    new_tp, new_pp = tp, pp
    while new_tp * new_pp > MAX_WORLD:
        if new_tp > 1:
            new_tp //= 2
        else:
            new_pp //= 2
    if (new_tp, new_pp) != (tp, pp):
        subs.append(Substitution("parallel.tp/pp", f"{tp}/{pp}", f"{new_tp}/{new_pp}",
                                 f"at most {MAX_WORLD} processes on a CPU"))
    dp = 2 if new_tp * new_pp <= 2 else 1
    return new_tp, new_pp, dp


def _cap_experts(cfg: CooperConfig, world: int, subs: list[Substitution]) -> None:
    """EP, then expert TP, halved until ``world`` processes hold them (world divisible by etp * ep * pp); at
    EP=1 the expert TP is the TP size, the one layout of EP=1 whose experts train correctly
    (:meth:`~cooper_mcore.parallel.ParallelConfig.expert_drift_problem`)."""
    par = cfg.parallel
    ep, etp = par.ep, par.expert_tp
    while world % (etp * ep * par.pp):
        if ep > 1:
            ep //= 2
        else:
            etp //= 2
    if ep == 1 and par.ep > 1 and etp != par.tp:
        etp = par.tp
    why = f"{world} processes hold the expert layout etp*ep*pp at most"
    change_setting(cfg, subs, "parallel.ep", ep, why)
    if etp != par.expert_tp:
        change_setting(cfg, subs, "parallel.etp", etp, why)


def change_setting(cfg: CooperConfig, subs: list[Substitution], setting: str, value: Any, why: str) -> None:
    """Set a dotted setting of ``cfg`` and record it when it changes."""
    *path, name = setting.split(".")
    section = cfg
    for part in path:
        section = getattr(section, part)
    old = getattr(section, name)
    if old != value:
        subs.append(Substitution(setting, _text(old), _text(value), why))
        setattr(section, name, value)


def _text(value: Any) -> str:
    return str(getattr(value, "value", value))


def plan_rehearsal(preset: str, cfg: CooperConfig, policy: ArchSpec, rm: Optional[ArchSpec],
                   sglang_available: bool, at_real_shape: bool = False) -> RehearsalPlan:
    """The rehearsal of ``cfg`` (a preset with its overrides); ``cfg`` is not modified.

    Args:
        preset: the preset's path (for the report).
        cfg: the preset's config.
        policy / rm: the preset's architectures (the RM's None in rule mode).
        sglang_available: whether SGLang can run here (else the transformers engine stands in).
        at_real_shape: one process (one GPU) with the preset's model shape and per-GPU sizes,
            :data:`REAL_STEPS` steps that measure time and memory per phase; no stop and resume.
    """
    cfg = copy.deepcopy(cfg)
    subs: list[Substitution] = []
    par = cfg.parallel
    if at_real_shape:
        if (par.tp, par.pp) != (1, 1):
            subs.append(Substitution("parallel.tp/pp", f"{par.tp}/{par.pp}", "1/1", "one GPU at the real shape"))
        tp, pp, dp = 1, 1, 1
    else:
        tp, pp, dp = _cap_layout(par.tp, par.pp, subs)
    par.tp, par.pp = tp, pp
    _cap_experts(cfg, tp * pp * dp, subs)
    if par.sequence_parallel and tp == 1:
        change_setting(cfg, subs, "parallel.sequence_parallel", False, "needs tp > 1 after the cap")
    change_setting(cfg, subs, "parallel.timeout_minutes", TIMEOUT_MINUTES, "a rank-divergent collective fails fast")
    shape = real_shape(policy, rm) if at_real_shape else tiny_shape(policy, rm, tp, pp)
    tiny = "the tiny task of the rehearsal"
    change_setting(cfg, subs, "data.template", "{question}", tiny)
    change_setting(cfg, subs, "data.use_chat_template", False, "the tiny tokenizer has no chat template")
    change_setting(cfg, subs, "data.eval_limit", EVAL_PROMPTS, "a short evaluation")
    if at_real_shape:
        change_setting(cfg, subs, "model.init", "random",
                       "random weights built on the device at the real shape: nothing written or converted")
        change_setting(cfg, subs, "rollout.engine", "hf", "with random weights the transformers engine is built "
                                                          "empty and filled by the weight push (SGLang loads "
                                                          "model.policy_hf)")
    elif cfg.rollout.uses_sglang and not sglang_available:
        change_setting(cfg, subs, "rollout.engine", "hf", "SGLang is not installed here; the transformers engine "
                                                          "models its release and weight-push semantics")
    if at_real_shape:
        _sizes_real(cfg, subs)
    else:
        _sizes_tiny(cfg, subs, dp)
    change_setting(cfg, subs, "logging.wandb", False, "no metrics service in a rehearsal")
    assistant = cfg.uses_assistant
    if assistant:
        subs.append(Substitution("rm.assistant_url", cfg.rm.assistant_url or "(none)", "a local stand-in",
                                 "answers as an assistant would: wrong, still correct, unparseable or slow"))
    return RehearsalPlan(preset=preset, cfg=cfg, nproc=tp * pp * dp, shape=shape, substitutions=subs,
                         assistant=assistant, real_shape=at_real_shape)


def _sizes_tiny(cfg: CooperConfig, subs: list[Substitution], dp: int) -> None:
    """Tiny batches and the compressed cadence: 4 steps, evaluation every step, checkpoints."""
    change_setting(cfg, subs, "rollout.group_size", GROUP_SIZE, "tiny sizes")
    change_setting(cfg, subs, "rollout.max_new_tokens", MAX_NEW_TOKENS, "tiny sizes")
    change_setting(cfg, subs, "rollout.bucket_mb", BUCKET_MB, "several weight-push buckets for a tiny model")
    change_setting(cfg, subs, "reward.verifier_workers", 1, "2 cores")
    t = cfg.train
    per_rank = PROMPTS_PER_RANK * t.mini_batches
    change_setting(cfg, subs, "train.steps", STEPS, f"a stop signal in step {STOP_STEP}, then a resume")
    change_setting(cfg, subs, "train.prompts_per_step", per_rank * dp, "tiny sizes")
    change_setting(cfg, subs, "train.micro_batch_size", min(t.micro_batch_size, 4), "tiny sizes")
    if t.max_tokens_per_micro_batch:
        change_setting(cfg, subs, "train.max_tokens_per_micro_batch", 2 * TINY_SEQUENCE,
             "scaled to the tiny sequences: about 2 per micro-batch")
    change_setting(cfg, subs, "eval.every", 1, "evaluate every step")
    change_setting(cfg, subs, "eval.k", 1, "a short evaluation")
    change_setting(cfg, subs, "eval.max_new_tokens", MAX_NEW_TOKENS, "tiny sizes")
    change_setting(cfg, subs, "checkpoint.every", CKPT_EVERY, "a checkpoint every 2 steps")
    change_setting(cfg, subs, "checkpoint.keep", max(cfg.checkpoint.keep, 2), "keep the stop's and the last checkpoint")
    change_setting(cfg, subs, "checkpoint.resume", "none", "the first run starts fresh; the resume asks for auto")


def _sizes_real(cfg: CooperConfig, subs: list[Substitution]) -> None:
    """The preset's group, lengths and micro-batching, a few prompts, 3 steps, one evaluation."""
    t = cfg.train
    change_setting(cfg, subs, "train.steps", REAL_STEPS, "a few steps that measure")
    change_setting(cfg, subs, "train.prompts_per_step", REAL_PROMPTS * t.mini_batches, "a few prompts on one GPU")
    change_setting(cfg, subs, "eval.every", REAL_STEPS, "one evaluation, at the end")
    change_setting(cfg, subs, "eval.k", 1, "a short evaluation")
    change_setting(cfg, subs, "checkpoint.every", 0, "the CPU rehearsal checks checkpoints and the resume")
    change_setting(cfg, subs, "checkpoint.resume", "none", "a fresh run")


def preset_model_shapes(cfg: CooperConfig, preset: str, policy_config: Optional[str] = None,
                        rm_config: Optional[str] = None) -> tuple[ModelShape, Optional[ModelShape], list[str]]:
    """The preset's models' shapes (architectures and HF configs), as ``cooper plan`` finds them,
    else from the config shipped for ``model.policy_hf``
    (:func:`~cooper_mcore.config.presets.shipped_model_config`).

    Raises:
        ValueError: no shape anywhere (naming the places looked at).
    """
    if policy_config is None and not os.path.isfile(os.path.join(cfg.model.policy_hf, "config.json")):
        policy_config = shipped_model_config(cfg.model.policy_hf, preset)
    return find_shapes(cfg, policy_config, rm_config)


def preset_shapes(cfg: CooperConfig, preset: str, policy_config: Optional[str] = None,
                  rm_config: Optional[str] = None) -> tuple[ArchSpec, Optional[ArchSpec], list[str]]:
    """The architectures of :func:`preset_model_shapes`.

    Raises:
        ValueError: no shape anywhere (naming the places looked at).
    """
    policy, rm, notes = preset_model_shapes(cfg, preset, policy_config, rm_config)
    return policy.arch, rm.arch if rm is not None else None, notes
