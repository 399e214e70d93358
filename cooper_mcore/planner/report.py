"""The ``cooper plan`` command's input and output: model shapes from config files, the human
table and the JSON document of a :class:`~cooper_mcore.planner.plan.Plan`; and :func:`launch_check`,
the planner as ``examples/launch_multinode.sh`` asks it before it starts anything.

Model shapes come from (first found): ``--policy-config`` / ``--rm-config`` (a ``config.json``
or a folder holding one), ``model.policy_hf/config.json``, the converted checkpoint's metadata
(``model.policy_ckpt`` / ``model.rm_ckpt``). Without any RM shape the RM is assumed to have the
policy's backbone (VerifyRM is a fine-tuned policy-size model), and the report says so.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from cooper_mcore.checkpoint.model import is_model_checkpoint, read_meta
from cooper_mcore.config.model_shapes import ModelShape, random_init_shapes, reward_hf_config
from cooper_mcore.config.presets import read_model_config, shipped_model_config
from cooper_mcore.config.schema import CooperConfig, load_config
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.planner.plan import (
    COMPONENTS,
    OFFLOAD_FLAGS,
    AssistantInfo,
    AssistantSpec,
    Evaluation,
    Plan,
    PlanOptions,
    assistant_info,
    assistant_problem,
    plan,
)
from cooper_mcore.planner.sizes import GIB, active_numel, model_numel, stage_expert_numel, stage_numel

_SHORT = {"policy_params": "pol.p", "policy_grads": "pol.g", "policy_optimizer": "pol.opt", "rm_params": "rm.p",
          "rm_grads": "rm.g", "rm_optimizer": "rm.opt", "engine_weights": "eng.w", "engine_kv": "eng.kv",
          "engine_workspace": "eng.ws", "assistant_weights": "asst.w", "assistant_kv": "asst.kv",
          "assistant_workspace": "asst.ws",
          "activations": "act", "routing_margin": "route+", "logits": "logits", "buffers": "buf", "contexts": "ctx",
          "overhead": "ovh"}


def find_shapes(cfg: CooperConfig, policy_config: Optional[str] = None,
                rm_config: Optional[str] = None) -> tuple[ModelShape, Optional[ModelShape], list[str]]:
    """The policy's and the RM's shapes for ``cfg`` (architecture and HF config), and notes on where
    they came from: ``--policy-config``, ``model.policy_hf/config.json``, the policy checkpoint, the
    config shipped for ``model.policy_hf``; the RM's ``--rm-config``, its checkpoint, else the
    policy's backbone with a scalar head. With ``model.init: random`` and neither config given, the
    run's own shapes (:func:`~cooper_mcore.config.model_shapes.random_init_shapes`).

    Raises:
        ValueError: no policy shape can be found (naming the places looked at).
    """
    notes = []
    if cfg.model.random_init and not policy_config and not rm_config:
        policy_shape, rm_shape = random_init_shapes(cfg.model, cfg.reward.mode.uses_rm)
        notes.append(f"random weights (model.init=random): policy from {policy_shape.source}"
                     + (f", reward model from {rm_shape.source}" if rm_shape else ""))
        return policy_shape, rm_shape, notes
    if policy_config:
        policy = _config_shape(policy_config, "causal_lm", f"--policy-config {policy_config}")
    elif cfg.model.policy_hf and os.path.isfile(os.path.join(cfg.model.policy_hf, "config.json")):
        policy = _config_shape(cfg.model.policy_hf, "causal_lm", f"model.policy_hf={cfg.model.policy_hf}")
    elif cfg.model.policy_ckpt and is_model_checkpoint(cfg.model.policy_ckpt):
        policy = _checkpoint_shape(cfg.model.policy_ckpt, "model.policy_ckpt")
    elif (shipped := shipped_model_config(cfg.model.policy_hf)) is not None:
        policy = _config_shape(shipped, "causal_lm", f"the shipped {os.path.basename(shipped)}")
        notes.append(f"policy shape from the shipped {os.path.basename(shipped)} (model.policy_hf has no "
                     f"config.json here); pass --policy-config to set it")
    else:
        raise ValueError(f"no policy shape: model.policy_hf={cfg.model.policy_hf!r} has no config.json and "
                         f"model.policy_ckpt={cfg.model.policy_ckpt!r} is not a converted checkpoint; pass "
                         f"--policy-config (e.g. examples/model_configs/qwen2.5-1.5b-instruct.json)")
    if not cfg.reward.mode.uses_rm:
        return policy, None, notes
    if rm_config:
        rm = _config_shape(rm_config, "reward", f"--rm-config {rm_config}")
    elif cfg.model.rm_ckpt and is_model_checkpoint(cfg.model.rm_ckpt):
        rm = _checkpoint_shape(cfg.model.rm_ckpt, "model.rm_ckpt")
    else:
        rm = ModelShape(dataclasses.replace(policy.arch, model_type="reward", tie_word_embeddings=False),
                        reward_hf_config(policy.hf_config), f"the policy's backbone ({policy.source})")
        notes.append("reward model shape not found (model.rm_ckpt): assumed to be the policy's backbone with a "
                     "scalar head; pass --rm-config to set it")
    return policy, rm, notes


def _config_shape(given: str, model_type: str, source: str) -> ModelShape:
    hf = read_model_config(given)
    return ModelShape(ArchSpec.from_hf_config(hf, model_type), hf, source)


def _checkpoint_shape(ckpt: str, setting: str) -> ModelShape:
    arch, hf, _ = read_meta(ckpt)
    return ModelShape(arch, hf, f"{setting}={ckpt}")


def load_shapes(cfg: CooperConfig, policy_config: Optional[str] = None,
                rm_config: Optional[str] = None) -> tuple[ArchSpec, Optional[ArchSpec], list[str]]:
    """The policy's and the RM's architectures of :func:`find_shapes`, and its notes.

    Raises:
        ValueError: no policy shape can be found (naming the places looked at).
    """
    policy, rm, notes = find_shapes(cfg, policy_config, rm_config)
    return policy.arch, rm.arch if rm is not None else None, notes


def _text(value: Any) -> str:
    """A setting as written in the config (an enum's value)."""
    return str(getattr(value, "value", value))


def _gib(n: int) -> float:
    return round(n / GIB, 2)


def _evaluation_dict(ev: Evaluation) -> dict[str, Any]:
    peak = ev.peak
    return {
        "fits": ev.fits, "offload": dataclasses.asdict(ev.offload),
        "peak": {"phase": peak.phase, "stage": peak.stage, "gib": _gib(peak.total)},
        "phases": [{"phase": p.phase, "stage": p.stage, "total_gib": _gib(p.total),
                    "components_gib": {k: _gib(v) for k, v in p.components.items()}} for p in ev.phases],
        "host_per_gpu_gib": _gib(ev.host_per_gpu), "problems": list(ev.problems),
    }


def _per_stage(arch: ArchSpec, plan: Plan) -> tuple[list[int], list[int]]:
    """Parameters and, of them, expert parameters on one GPU of each pipeline stage."""
    lay = plan.layout
    return ([stage_numel(arch, lay.tp, lay.pp, s, lay.ep, lay.etp) for s in range(lay.pp)],
            [stage_expert_numel(arch, lay.pp, s, lay.ep, lay.etp) for s in range(lay.pp)])


def _moe_dict(arch: ArchSpec, plan: Plan) -> Optional[dict[str, Any]]:
    if arch.moe is None:
        return None
    m, lay = arch.moe, plan.layout
    return {"num_experts": m.num_experts, "experts_per_token": m.experts_per_token,
            "expert_ffn_hidden_size": m.expert_ffn_hidden_size, "sparse_layers": sum(arch.moe_layers()),
            "ep": lay.ep, "etp": lay.etp, "expert_dp": lay.expert_dp,
            "expert_params_per_gpu_by_stage": _per_stage(arch, plan)[1]}


def _arch_dict(arch: ArchSpec, plan: Plan) -> dict[str, Any]:
    return {"family": arch.family, "model_type": arch.model_type, "params": model_numel(arch),
            "active_params_per_token": active_numel(arch), "params_per_gpu_by_stage": _per_stage(arch, plan)[0],
            "layers": arch.num_layers, "hidden_size": arch.hidden_size, "kv_heads": arch.num_query_groups,
            "head_dim": arch.head_dim, "vocab_size": arch.vocab_size, "moe": _moe_dict(arch, plan)}


def _arch_line(name: str, arch: ArchSpec, plan: Plan) -> str:
    """One model's parameter counts: total, per GPU by stage; for MoE also active and experts per GPU."""
    per, experts = _per_stage(arch, plan)
    line = (f"{name}: {arch.family}, {model_numel(arch):,} parameters; per GPU by pipeline stage: "
            + ", ".join(f"{n:,}" for n in per))
    if arch.moe is None:
        return line
    m = arch.moe
    return (line + f"; MoE: {m.num_experts} experts (top {m.experts_per_token}) in {sum(arch.moe_layers())} "
            f"layers, {active_numel(arch):,} active per token; experts per GPU by stage "
            + ", ".join(f"{n:,}" for n in experts))


def _assistant_dict(a: Optional[AssistantInfo]) -> Optional[dict[str, Any]]:
    if a is None:
        return None
    return {"tp": a.tp, "replicas_per_node": a.replicas, "mem_fraction_static": a.mem_fraction,
            "min_mem_fraction_static": a.min_fraction, "weights_gib": _gib(a.weights), "kv_pool_gib": _gib(a.kv_pool),
            "workspace_gib": _gib(a.workspace), "kv_bytes_per_token": a.kv_bytes_per_token,
            "tokens_at_once": a.tokens_at_once}


def plan_to_dict(plan: Plan, cfg: CooperConfig, notes: Optional[list[str]] = None) -> dict[str, Any]:
    """The JSON document of ``cooper plan --json`` (top-level ``fits``: the run as configured fits)."""
    o, lay, eng = plan.options, plan.layout, plan.given.engine
    return {
        "fits": plan.fits,
        "fits_with_offload": plan.recommended is not None,
        "needed_overrides": plan.needed_overrides(),
        "gpu_memory_gib": o.gpu_memory_gib,
        "cluster": {"nodes": o.nodes, "gpus_per_node": o.gpus_per_node, "world_size": o.world_size},
        "layout": dataclasses.asdict(lay),
        "dtype": _text(cfg.model.dtype), "reward_mode": _text(cfg.reward.mode),
        "sequence": {"prompt_tokens": o.prompt_tokens, "max_new_tokens": cfg.rollout.max_new_tokens,
                     "micro_batch_size": cfg.train.micro_batch_size, "recompute": o.recompute},
        "models": {"policy": _arch_dict(plan.policy, plan),
                   "rm": _arch_dict(plan.rm, plan) if plan.rm is not None else None},
        "engine": {"kind": eng.kind, "weights_gib": _gib(eng.weights), "kv_pool_gib": _gib(eng.kv_pool),
                   "kv_bytes_per_token": eng.kv_bytes_per_token, "sequences": eng.sequences,
                   "tokens_at_once": eng.tokens_at_once, "tokens_needed": eng.tokens_needed},
        "assistant": _assistant_dict(plan.assistant),
        "context_gib": o.context_gib, "overhead_gib": o.overhead_gib,
        "as_configured": _evaluation_dict(plan.given),
        "offload_effects": {f: {"configured": getattr(plan.given.offload, f), "peak_off_gib": _gib(off.peak.total),
                                "peak_on_gib": _gib(on.peak.total), "rollout_off_gib": _gib(off.phases[0].total),
                                "rollout_on_gib": _gib(on.phases[0].total), "fits_off": off.fits, "fits_on": on.fits,
                                "phases_off_gib": {ph.phase: _gib(ph.total) for ph in off.phases},
                                "phases_on_gib": {ph.phase: _gib(ph.total) for ph in on.phases}}
                            for f, (off, on) in plan.effects.items()},
        "recommended": _evaluation_dict(plan.recommended) if plan.recommended is not None else None,
        "host_per_node_gib": _gib(plan.given.host_per_gpu * o.gpus_per_node),
        "notes": plan.notes + list(notes or []),
        "measured": False,  # these figures have not been compared with measured GPU memory
    }


def _phase_table(ev: Evaluation) -> list[str]:
    cols = [c for c in COMPONENTS if any(p.components[c] for p in ev.phases)]
    head = f"{'phase':<14}{'stage':>5}" + "".join(f"{_SHORT[c]:>8}" for c in cols) + f"{'total':>8}"
    rows = [head, "-" * len(head)]
    for p in ev.phases:
        rows.append(f"{p.phase:<14}{p.stage:>5}" + "".join(f"{p.components[c] / GIB:>8.2f}" for c in cols)
                    + f"{p.total / GIB:>8.2f}")
    return rows


def _expert_layout(plan: Plan) -> str:
    """`` ep=.. etp=.. expert_dp=..`` when a model has experts, else nothing."""
    lay = plan.layout
    if all(a is None or a.moe is None for a in (plan.policy, plan.rm)):
        return ""
    return f" ep={lay.ep} etp={lay.etp} expert_dp={lay.expert_dp}"


def _offload_text(ev: Evaluation) -> str:
    on = [f for f in OFFLOAD_FLAGS if getattr(ev.offload, f)]
    return ", ".join(on) if on else "none"


def format_plan(plan: Plan, cfg: CooperConfig, notes: Optional[list[str]] = None) -> str:
    """The human report: the setting, a per-phase table (GiB per GPU), each offload's effect, the verdict."""
    o, lay, ev, eng = plan.options, plan.layout, plan.given, plan.given.engine
    cap = o.gpu_memory_gib
    lines = [f"cooper plan: {o.nodes} node(s) x {o.gpus_per_node} GPUs, {cap:g} GiB each; tp={lay.tp} pp={lay.pp} "
             f"dp={lay.dp}{' sp' if lay.sequence_parallel else ''}{_expert_layout(plan)}; "
             f"{_text(cfg.model.dtype)}; reward mode {_text(cfg.reward.mode)}"]
    for name, arch in (("policy", plan.policy), ("reward model", plan.rm)):
        if arch is not None:
            lines.append(_arch_line(name, arch, plan))
    lines.append(f"sequences: {o.prompt_tokens} prompt + {cfg.rollout.max_new_tokens} new tokens, "
                 f"{eng.sequences} per "
                 f"data-parallel rank, micro-batch {cfg.train.micro_batch_size}; activations "
                 f"{'with' if o.recompute else 'without'} full recomputation")
    lines.append(f"engine: {eng.kind}, weights {eng.weights / GIB:.2f} GiB/GPU, KV cache {eng.kv_pool / GIB:.2f} GiB "
                 f"= {eng.tokens_at_once:,} tokens ({eng.kv_bytes_per_token:,} B/token/GPU); one rollout needs "
                 f"{eng.tokens_needed:,}")
    a = plan.assistant
    if a is not None:
        lines.append(f"assistant (colocated): TP={a.tp} x {a.replicas} replicas per node, --mem-fraction-static "
                     f"{a.mem_fraction:g} (at least {a.min_fraction:g}): weights {a.weights / GIB:.2f} GiB/GPU, "
                     f"KV cache {a.kv_pool / GIB:.2f} GiB = {a.tokens_at_once:,} tokens, workspace "
                     f"{a.workspace / GIB:.2f} GiB")
    lines += ["", f"per-GPU memory (GiB, worst pipeline stage), offload as configured: {_offload_text(ev)}"]
    lines += _phase_table(ev)
    lines += ["", f"{'offload setting':<18}{'configured':>11}{'peak off':>10}{'peak on':>9}{'rollout off':>13}"
              f"{'rollout on':>12}  (GiB; the others as configured)"]
    for flag, (off, on) in plan.effects.items():
        lines.append(f"{flag:<18}{str(getattr(ev.offload, flag)).lower():>11}{off.peak.total / GIB:>10.2f}"
                     f"{on.peak.total / GIB:>9.2f}{off.phases[0].total / GIB:>13.2f}{on.phases[0].total / GIB:>12.2f}")
    lines.append("")
    lines += [f"problem: {p}" for p in ev.problems]
    peak = ev.peak
    share = f"peak {peak.total / GIB:.2f} GiB in {peak.phase} (stage {peak.stage}) of {cap:g} GiB"
    if plan.fits:
        lines.append(f"verdict: FITS as configured ({share})")
    elif plan.recommended is not None:
        rec = plan.recommended
        overrides = " ".join(f"{k}={str(v).lower()}" for k, v in (plan.needed_overrides() or {}).items())
        lines.append(f"verdict: does NOT fit as configured ({share}); fits with: {overrides} "
                     f"(peak {rec.peak.total / GIB:.2f} GiB in {rec.peak.phase})")
    else:
        lines.append(f"verdict: does NOT fit, with any offload setting ({share}); reduce "
                     f"train.micro_batch_size or rollout.max_new_tokens, raise parallel.tp/pp, or lower "
                     f"rollout.sglang_mem_fraction")
    lines.append(f"host memory per node (reference copy, offloaded state): "
                 f"{ev.host_per_gpu * o.gpus_per_node / GIB:.1f} GiB")
    lines += [f"note: {n}" for n in plan.notes + list(notes or [])]
    if cfg.rollout.disaggregated:
        lines.append("note: rollout.placement=disaggregated is planned as if colocated (the engine counted on the "
                     "trainer's GPUs, an upper bound): engines on GPUs of their own are not built or planned yet "
                     "(docs/async.md)")
    lines.append("note: the trainer's terms are held against a simulated step (cooper plan --simulate); the engine's, "
                 "the assistant's, contexts and overhead are estimates; none compared with a GPU's allocator")
    return "\n".join(lines)


@dataclass
class LaunchCheck:
    """What the launcher needs before it starts anything.

    Attributes:
        needs_assistant: the run asks an assistant for the RM's negatives (cooper mode,
            ``rm.negatives: assistant``).
        url / model / api_key_env: the endpoint the run will call (``rm.*``, overrides applied).
        tp / mem_fraction: the colocated assistant's ``--tp-size`` and ``--mem-fraction-static``
            (0 when the launcher starts none).
        messages: what the planner said (its verdict, or why it could not run).
    """

    needs_assistant: bool
    url: str
    model: str
    api_key_env: str
    tp: int = 0
    mem_fraction: float = 0.0
    messages: list[str] = field(default_factory=list)


def launch_check(config: Optional[str], overrides: list[str], nodes: int, gpus_per_node: int,
                 gpu_memory_gib: Optional[float], assistant_model_path: str = "", assistant_tp: Optional[int] = None,
                 assistant_mem_fraction: Optional[float] = None) -> LaunchCheck:
    """Settings and checks for ``examples/launch_multinode.sh``.

    With ``assistant_model_path`` (a colocated assistant the launcher will serve): its TP
    defaults to ``parallel.tp`` and its ``--mem-fraction-static`` is derived from the model's
    ``config.json`` and the GPU memory (:func:`~cooper_mcore.planner.plan.assistant_mem_fraction`), or,
    when given, checked to leave SGLang a KV cache. When the GPU memory and the models' shapes are
    known, the whole run is planned too and the verdict reported (estimates: a run predicted not
    to fit is reported, not refused).

    Raises:
        ValueError: the config is invalid, or the colocated assistant cannot start (no shape to
            derive its fraction from, unknown GPU memory, a fraction that leaves no KV cache,
            a TP that does not divide the node), naming what to set.
    """
    cfg = load_config(config, overrides)
    rm = cfg.rm
    check = LaunchCheck(cfg.uses_assistant, rm.assistant_url,
                        rm.assistant_model, rm.api_key_env or "")
    spec: Any = "auto"
    if assistant_model_path:
        tp = assistant_tp or cfg.parallel.tp
        hf_config = os.path.join(assistant_model_path, "config.json")
        if not os.path.isfile(hf_config):
            raise ValueError(f"ASSISTANT_MODEL_PATH={assistant_model_path} has no config.json: it must be the "
                             f"assistant model's Hugging Face folder (on every node)")
        arch = ArchSpec.from_hf_config(load_hf_config(assistant_model_path), "causal_lm")
        if gpu_memory_gib is None:
            if assistant_mem_fraction is None:
                raise ValueError("the GPU memory is unknown (no CUDA device here): set GPU_MEMORY_GIB, or "
                                 "ASSISTANT_MEM_FRACTION")
            gpu_memory_gib = 80.0  # only to check a given fraction's KV cache against an 80 GB card
            check.messages.append("GPU memory unknown: ASSISTANT_MEM_FRACTION checked against an 80 GiB GPU")
        spec = AssistantSpec(arch, tp, assistant_mem_fraction)
        info = assistant_info(spec, gpus_per_node, gpu_memory_gib)
        if problem := assistant_problem(info):
            raise ValueError(problem)
        check.tp, check.mem_fraction = tp, info.mem_fraction
        check.messages.append(f"assistant: TP={tp} x {info.replicas} replicas, --mem-fraction-static "
                              f"{info.mem_fraction:g} (weights {info.weights / GIB:.2f} GiB + KV cache "
                              f"{info.kv_pool / GIB:.2f} GiB of {gpu_memory_gib:g} GiB per GPU)")
    elif not check.needs_assistant:
        spec = "none"
    if gpu_memory_gib is None:
        check.messages.append("plan: skipped (GPU memory unknown)")
        return check
    try:
        policy, rm_arch, _ = load_shapes(cfg)
        opts = PlanOptions(gpus_per_node=gpus_per_node, gpu_memory_gib=gpu_memory_gib, nodes=nodes, assistant=spec)
        result = plan(cfg, policy, rm_arch, opts)
    except ValueError as e:
        check.messages.append(f"plan: skipped ({e})")
        return check
    verdict = format_plan(result, cfg).splitlines()
    check.messages += [line for line in verdict if line.startswith(("verdict:", "problem:"))]
    return check
