"""Predict the per-GPU memory of a Cooper run, phase by phase, and the offload settings it needs.

Pure arithmetic on :class:`~cooper_mcore.models.arch.ArchSpec` and
:class:`~cooper_mcore.config.schema.CooperConfig` (nothing is allocated, megatron-core is not imported).
Every figure is the memory of one GPU of the worst pipeline stage, and follows what the trainer
does (``rl/setup.py``, ``rl/step.py``, ``rl/colocate.py``, ``train/step.py``):

* Trained models (the policy; the RM in ``cooper`` mode): parameters in the model dtype in
  megatron DDP's param buffer; gradients in DDP's grad buffer in fp32 (``grad_reduce_in_fp32``);
  Adam with the distributed optimizer (always on in the trainer): each data-parallel rank holds
  1/DP of the fp32 main params (bf16 models only: for fp32 models they are views into the param
  buffer) and of both moments. DDP's alignment padding (each parameter starts at a multiple of
  64 elements, the buffer ends at a multiple of lcm(DP, 128)) is not counted: < 0.01% at 1B.
  TP shards the linear layers and the vocabulary, PP splits the layers; the first stage holds
  the embedding, the last the final norm and the output layer (with tied embeddings and PP > 1
  the last stage holds its own copy of the embedding, as megatron-core does).
* The reference model is a host copy swapped into the policy's parameters
  (``offload.ReferenceSwap``): no GPU memory, twice the policy's parameter bytes of host memory.
* ``static_rm``: the RM's parameters only; ``rule``: no RM.
* SGLang (one engine per model-parallel group, ``tp_size = parallel.tp``, on the GPUs of
  pipeline stage 0) takes ``rollout.sglang_mem_fraction`` of the memory that is free when it
  starts, and sizes its KV pool as that minus its weights (sglang's KV-cache configurator). The
  trainer starts it after building the models, so the pool is sized with the whole training
  state resident; offloading later frees memory but does not grow the pool. Beyond the fraction
  it uses a workspace for activations and CUDA graphs, counted as SGLang itself estimates it at
  its defaults for the GPU (:func:`sglang_workspace_bytes`). While released
  (``offload.release_engine``) it holds nothing; it is resumed, KV pool and CUDA graphs included,
  for rollouts and for every weight sync.
* The HF engine: the whole model in the model dtype on the group leader's GPU, plus the KV cache
  of up to :data:`HF_ENGINE_BATCH` sequences generated together and its prefill's activations (its
  workspace); moved to host memory while released.
* Activations (torch-native spec, SDPA attention, no dropout), as the memory simulation measures
  the trainer's own step (:mod:`cooper_mcore.planner.simulate`, ``cooper plan --simulate``), per
  token in the model dtype (:func:`~cooper_mcore.planner.sizes.layer_activation_bytes`): a layer
  keeps 8h (two RMSNorms: their fp32 input 2h, the normalised and the weighted output h each;
  divided by TP with sequence parallelism) plus (5 q + 5 ffn) / TP: q, k and v expanded to all heads
  and the attention output twice, the gate/up output (2 ffn), silu, megatron's ``up + offset`` copy
  and the product (ffn each); Qwen3's q/k norms add 3 (q + kv). 1F1B keeps ``min(PP - stage,
  micro-batches)`` micro-batches in flight on a stage. A pass is counted at its worst moment
  (:func:`pass_memory`): a training pass at the loss (what the stage keeps, the final norm's 4h and
  the logits) or in backward (what it keeps and backward's workspace, the MLP's gradient 2 ffn);
  a forward-only pass (log-probs, RM scores, the HF engine's prefill) inside its largest layer
  (5 ffn / TP beside the residual stream's 4h and, with sequence parallelism, the gathered h) or at
  the loss (the logits alone). With full recomputation only each layer's input (h) is kept, plus
  one layer's full set while it is recomputed.
* Logits on the last stage, per token and vocabulary entry on this TP rank (``d`` B each, the
  model dtype): the output layer's ``[s, b, V/tp]`` and megatron's contiguous ``[b, s, V/tp]`` copy
  (2 d for a moment; none for a packed micro-batch, one row whose transpose is contiguous); the
  log-probabilities and the entropy are read ``train.logprob_chunk_tokens`` positions at a time with
  fp32 temporaries of one chunk (4 B per chunk entry for the log-probabilities, 8 B with the
  entropy); the update keeps the logits for backward, which writes their gradient (d) beside them
  with one chunk's fp32 temporaries (4 B, 8 B with an entropy bonus). Forward only: ``max(2 d T, d T
  + 4 c)`` x V/tp (``d T + 4 c`` packed); the update: ``max(d T + 8 c, 2 d T + 4 c)`` x V/tp (``8 c``
  with ``algo.entropy_coef > 0``), ``T`` the micro-batch's tokens, ``c`` the chunk
  (:func:`~cooper_mcore.planner.sizes.logits_bytes`). Measured on CPU against the allocator's peak in
  ``tests/unit/test_logits_memory.py``.
* Sequences are counted at their maximum length ``prompt_tokens + rollout.max_new_tokens``
  (rounded up to 8, as the trainer pads); RM inputs at that length too, capped at the RM's
  ``max_position_embeddings``. A micro-batch by a token budget holds as many whole sequences as
  fit the budget (at least one); the reward model's update has ``rm.pairs_per_prompt`` pairs per
  prompt, a pair's two rows in one micro-batch, ``train.micro_batch_size`` pairs in each when there
  is no budget (the last filled up with masked copies).
* The weight push (:func:`~cooper_mcore.planner.sizes.sync_buffer_bytes`): on the first stage SGLang's
  flat copy of a bucket and, at TP, PP or EP above 1, the bucket of gathered whole tensors; on later
  stages the gather of the largest weight. Before it the trainer has offloaded all it is told to but
  the policy's parameters.
* A colocated assistant (``rm.negatives: assistant`` with ``rm.assistant_url`` on this host, as the
  presets are written): ``examples/launch_multinode.sh`` starts one SGLang server per node before
  training, with ``ASSISTANT_TP`` GPUs per replica and one replica per GPU group, so every GPU holds
  one assistant TP rank for the whole run: ``--mem-fraction-static`` x the memory free when it
  starts (all but its own CUDA context) for its weights and KV pool (SGLang 0.5.23 sizes the pool
  as that minus the weights, and refuses to start when nothing is left), plus the workspace SGLang
  itself estimates for activations and CUDA graphs at the launcher's ``--chunked-prefill-size`` and
  ``--max-running-requests`` (:func:`sglang_workspace_bytes`). Its shape is taken to be the
  policy's (the presets serve the same-size instruct model) and its TP the preset's
  ``parallel.tp`` (the launcher's default); :func:`assistant_mem_fraction` gives the fraction the
  launcher uses.
* Mixture-of-experts models (Qwen3-MoE; :mod:`cooper_mcore.planner.sizes`): each rank holds the
  dense parameters split by TP as above, the routers replicated, and ``E / ep`` experts of each
  sparse layer split ``etp`` ways; with EP > 1 DDP keeps expert gradients in their own fp32 buffer,
  and the distributed optimizer shards the experts' main params and moments over the expert
  data-parallel group (``expert_dp = world / (ep etp pp)``), the rest over DP (at EP=1 megatron
  treats experts as ordinary parameters, sharded over DP). Activations of a sparse layer:
  attention as above, the router's fp32 logits and scores, and per routed token copy (each token's
  ``experts_per_token`` copies, at the mean routing) the experts' permuted input (h) and 6 I_e / etp
  (gate/up, silu, ``up + offset``, product and its weighted copy); forward only, 3 h (the
  dispatched, exchanged and sorted inputs) beside the 6 I_e. Uneven routing is the separate
  ``routing_margin`` component: the same per copy for ``MOE_ROUTING_MARGIN - 1`` times the mean
  copies (:func:`~cooper_mcore.planner.sizes.routing_margin_bytes`; not measured, the simulation
  routes evenly). SGLang serves the whole model per engine, each expert split
  over its ``tp_size`` (its default MoE tensor parallelism, no SGLang EP); its KV cache is the
  attention's, as for a dense model.
* CUDA contexts are counted per process and GPU (``context_gib``, measured): the trainer process
  on every GPU, the policy's SGLang engine on the GPUs of pipeline stage 0, the colocated assistant
  on every GPU. A flat ``overhead_gib`` per GPU stands for NCCL buffers, the rollout engine's CUDA
  graphs and allocator fragmentation.

Offload settings act on the rollout phase (the trainer offloads around rollouts and onloads right
after) and the weight push before it (all but the policy's parameters), ``release_engine`` on every
other phase (the first step's push finds the engine as it started: all of it resident). The
trainer's own terms (state, activations, logits, the push's buffers) are held against a simulated
step (``cooper plan --simulate``: every phase of the shipped presets within 15%, docs/planner.md);
the engine's, the assistant's, the CUDA contexts and the overhead are estimates no simulation sees,
and nothing here has been compared with a GPU's allocator.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from cooper_mcore.config.schema import CooperConfig, EngineKind, OffloadConfig
from cooper_mcore.metric_names import Phase
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.planner.sizes import (
    CUDA_CONTEXT_GIB,
    DTYPE_BYTES,
    GIB,
    backward_workspace_bytes,
    check_layout,
    final_norm_bytes,
    forward_activation_bytes,
    kv_bytes_per_token,
    layer_activation_bytes,
    logits_bytes,
    model_numel,
    routing_margin_bytes,
    serving_numel,
    stage_expert_numel,
    stage_layers,
    stage_numel,
    sync_buffer_bytes,
    training_state,
)

#: the phases planned, named as the trainer times them (``time/<phase>``)
PHASES = (Phase.ROLLOUT, Phase.RM_SCORE, Phase.LOGPROBS, Phase.POLICY_UPDATE, Phase.RM_UPDATE, Phase.WEIGHT_SYNC)
OFFLOAD_FLAGS = ("policy_params", "policy_grads", "policy_optimizer", "rm_params", "rm_grads", "rm_optimizer",
                 "release_engine")
COMPONENTS = ("policy_params", "policy_grads", "policy_optimizer", "rm_params", "rm_grads", "rm_optimizer",
              "engine_weights", "engine_kv", "engine_workspace", "assistant_weights", "assistant_kv",
              "assistant_workspace", "activations", "routing_margin", "logits", "buffers", "contexts", "overhead")
HF_ENGINE_BATCH = 64  # HFEngine's default max_batch_size (sequences generated together)
STATE = ("params", "grads", "optimizer")

ASSISTANT_KV_TOKENS = 65_536
"""KV tokens a colocated assistant's pool is sized for: 32 rewrites of 2048 tokens at once (more queue)."""
ASSISTANT_REQUEST_TOKENS = 2_048
"""One rewrite request: the question and a correct solution (<= 512 + template) plus its length + 500 new
tokens (negatives/assistant.py), rounded up. A pool below one request cannot serve it."""
ASSISTANT_CHUNKED_PREFILL = 2_048  # the launcher's --chunked-prefill-size for the assistant
ASSISTANT_MAX_RUNNING = 64  # the launcher's --max-running-requests (caps the decode CUDA graphs' batch size)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class AssistantSpec:
    """A colocated assistant server: SGLang on every GPU of each node, ``tp`` GPUs per replica.

    Attributes:
        arch: the served model's shape.
        tp: GPUs per replica (``ASSISTANT_TP``); ``gpus_per_node / tp`` replicas per node.
        mem_fraction: ``--mem-fraction-static`` (``ASSISTANT_MEM_FRACTION``); None: the fraction
            :func:`assistant_mem_fraction` derives, as the launcher does.
        dtype_bytes: bytes per weight and KV element as served (bf16: 2).
    """

    arch: ArchSpec
    tp: int = 1
    mem_fraction: Optional[float] = None
    dtype_bytes: int = 2


@dataclass(frozen=True)
class PlanOptions:
    """What the planner needs beyond the run config.

    Attributes:
        gpus_per_node / nodes: the cluster; the world size is their product.
        gpu_memory_gib: memory of one GPU.
        prompt_tokens: the longest prompt, in tokens.
        overhead_gib: flat per-GPU allowance (NCCL buffers, the engine's CUDA graphs, fragmentation).
        recompute: plan as if full activation recomputation were on (the trainer does not
            turn it on yet).
        distributed_optimizer: shard Adam over data-parallel ranks (the trainer always does).
        context_gib: one process's CUDA context on one GPU (:data:`CUDA_CONTEXT_GIB`).
        assistant: the colocated assistant; "auto": the one :func:`colocated_assistant` infers
            from the config; "none": none counted.
    """

    gpus_per_node: int
    gpu_memory_gib: float
    nodes: int = 1
    prompt_tokens: int = 512
    overhead_gib: float = 2.0
    recompute: bool = False
    distributed_optimizer: bool = True
    context_gib: float = CUDA_CONTEXT_GIB
    assistant: Union[AssistantSpec, Literal["auto", "none"]] = "auto"

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Layout:
    """The parallel layout: ``dp = world / (tp pp)`` for the dense parameters, and for the experts
    of MoE models ``ep`` x ``etp`` with ``expert_dp = world / (ep etp pp)`` (megatron's ``expt_dp``)."""

    tp: int
    pp: int
    dp: int
    sequence_parallel: bool
    ep: int = 1
    etp: int = 1
    expert_dp: int = 1


@dataclass
class PhaseMemory:
    """Bytes on one GPU of pipeline stage ``stage`` during ``phase``, by component."""

    phase: str
    stage: int
    components: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.components.values())


@dataclass
class EngineInfo:
    """The rollout engine on its GPUs.

    Attributes:
        kind: ``rollout.engine``: sglang or hf (transformers).
        weights: engine weight bytes per GPU.
        kv_pool: KV-cache bytes per GPU (SGLang: its static pool; HF: the cache of one batch).
        kv_bytes_per_token: KV bytes per token on one GPU.
        sequences: sequences of one rollout of a model-parallel group (one data-parallel rank).
        tokens_needed: their tokens at full length.
        tokens_at_once: tokens the KV pool holds.
    """

    kind: EngineKind
    weights: int
    kv_pool: int
    kv_bytes_per_token: int
    sequences: int
    tokens_needed: int
    tokens_at_once: int

    @property
    def is_sglang(self) -> bool:
        """SGLang (a static KV pool) rather than the transformers engine (a cache only while it generates)."""
        return self.kind == "sglang"


@dataclass
class AssistantInfo:
    """The colocated assistant on each GPU.

    Attributes:
        tp / replicas: GPUs per replica and replicas per node.
        mem_fraction: its ``--mem-fraction-static``.
        min_fraction: the smallest fraction whose KV pool holds one request.
        weights / kv_pool / workspace: bytes per GPU (workspace: activations and CUDA graphs).
        kv_bytes_per_token / tokens_at_once: KV bytes per token per GPU, tokens the pool holds.
    """

    tp: int
    replicas: int
    mem_fraction: float
    min_fraction: float
    weights: int
    kv_pool: int
    workspace: int
    kv_bytes_per_token: int
    tokens_at_once: int


@dataclass
class Evaluation:
    """Memory of every phase for one set of offload settings."""

    offload: OffloadConfig
    capacity: int
    phases: list[PhaseMemory]  # per phase: the worst stage
    engine: EngineInfo
    host_per_gpu: int
    problems: list[str] = field(default_factory=list)
    stages: list[list[PhaseMemory]] = field(default_factory=list)  # every phase of every pipeline stage

    @property
    def peak(self) -> PhaseMemory:
        return max(self.phases, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return not self.problems and self.peak.total <= self.capacity


@dataclass
class Plan:
    """The config as given, the effect of each offload setting, and the cheapest one that fits."""

    layout: Layout
    policy: ArchSpec
    rm: Optional[ArchSpec]
    options: PlanOptions
    given: Evaluation
    effects: dict[str, tuple[Evaluation, Evaluation]]  # flag -> (off, on), other flags as given
    recommended: Optional[Evaluation]  # None: nothing fits
    assistant: Optional[AssistantInfo] = None  # the colocated assistant counted, if any
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.given.fits

    def needed_overrides(self) -> Optional[dict[str, bool]]:
        """The ``offload.*`` overrides that make the run fit ({} if it fits as given)."""
        if self.recommended is None:
            return None
        given = dataclasses.asdict(self.given.offload)
        return {f"offload.{k}": v for k, v in dataclasses.asdict(self.recommended.offload).items()
                if given[k] != v}


def layout_of(cfg: CooperConfig, world_size: int) -> Layout:
    """The TP/PP/DP layout of ``cfg`` on ``world_size`` GPUs.

    Raises:
        ValueError: the layout cannot be built.
    """
    cfg.parallel.validate(world_size)
    par = cfg.parallel
    return Layout(par.tp, par.pp, world_size // (par.tp * par.pp), par.sequence_parallel, par.ep, par.expert_tp,
                  world_size // (par.ep * par.expert_tp * par.pp))


def sglang_workspace_bytes(tp: int, chunked_prefill: int = ASSISTANT_CHUNKED_PREFILL,
                           max_running: int = ASSISTANT_MAX_RUNNING) -> int:
    """Memory an SGLang server uses beyond its static fraction (activations, CUDA graphs, metadata),
    as SGLang 0.5.23 estimates it to choose its default ``--mem-fraction-static``
    (``arg_groups/memory_hook.py``): 512 MiB + 1.5 MiB per chunked-prefill token (at least 2048)
    + TP/8 GiB + 2 MiB per decode CUDA-graph batch size (capped by ``--max-running-requests``)."""
    mib = 512 + 1.5 * max(chunked_prefill, 2048) + tp / 8 * 1024 + 2 * max_running
    return int(mib * 2**20)


def sglang_default_limits(gpu_memory_gib: float, tp: int) -> tuple[int, int]:
    """SGLang 0.5.23's default chunked-prefill size and largest decode CUDA-graph batch for a GPU
    of this size (``arg_groups/memory_hook.py``)."""
    if gpu_memory_gib < 20:
        return 2048, 8
    if gpu_memory_gib < 60:
        return 4096, (48 if gpu_memory_gib < 35 else 32) if tp < 4 else 160
    if gpu_memory_gib < 160:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def assistant_weights_bytes(arch: ArchSpec, tp: int, dtype_bytes: int = 2) -> int:
    """Weight bytes of one assistant TP rank (vocabulary, linear layers and each expert split ``tp`` ways)."""
    return serving_numel(arch, tp) * dtype_bytes


def _check_assistant(arch: ArchSpec, tp: int, gpus_per_node: int) -> None:
    if tp < 1 or gpus_per_node % tp:
        raise ValueError(f"ASSISTANT_TP={tp} must divide the {gpus_per_node} GPUs of a node")
    if arch.num_attention_heads % tp:
        raise ValueError(f"ASSISTANT_TP={tp} does not divide the assistant's {arch.num_attention_heads} "
                         f"attention heads")


def assistant_mem_fraction(arch: ArchSpec, tp: int, gpu_memory_gib: float, dtype_bytes: int = 2,
                           kv_tokens: int = ASSISTANT_KV_TOKENS, context_gib: float = CUDA_CONTEXT_GIB) -> float:
    """The ``--mem-fraction-static`` for a colocated assistant: its weights on one GPU plus a KV pool
    of ``kv_tokens`` tokens, over the memory free when it starts (all but its CUDA context),
    rounded up to a hundredth.

    Raises:
        ValueError: the weights and pool do not fit on one GPU (naming the sizes).
    """
    need = assistant_weights_bytes(arch, tp, dtype_bytes) + kv_tokens * kv_bytes_per_token(arch, dtype_bytes, tp)
    free = (gpu_memory_gib - context_gib) * GIB
    if need >= free:
        raise ValueError(f"the assistant's weights and a {kv_tokens}-token KV pool need {need / GIB:.2f} GiB per GPU "
                         f"at ASSISTANT_TP={tp}, more than the {free / GIB:.2f} GiB free: raise ASSISTANT_TP")
    return math.ceil(round(need / free * 100, 6)) / 100


def assistant_info(spec: AssistantSpec, gpus_per_node: int, gpu_memory_gib: float,
                   context_gib: float = CUDA_CONTEXT_GIB) -> AssistantInfo:
    """Weights, KV pool and workspace of a colocated assistant on one GPU.

    Raises:
        ValueError: ``tp`` does not divide the node's GPUs or the heads, or the fraction is not in (0, 1).
    """
    _check_assistant(spec.arch, spec.tp, gpus_per_node)
    fraction = spec.mem_fraction
    if fraction is None:
        fraction = assistant_mem_fraction(spec.arch, spec.tp, gpu_memory_gib, spec.dtype_bytes, context_gib=context_gib)
    if not 0 < fraction < 1:
        raise ValueError(f"ASSISTANT_MEM_FRACTION must be in (0, 1), got {fraction}")
    free = int((gpu_memory_gib - context_gib) * GIB)
    weights = assistant_weights_bytes(spec.arch, spec.tp, spec.dtype_bytes)
    per_token = kv_bytes_per_token(spec.arch, spec.dtype_bytes, spec.tp)
    pool = int(fraction * free) - weights
    minimum = math.ceil((weights + ASSISTANT_REQUEST_TOKENS * per_token) / free * 1000) / 1000
    return AssistantInfo(spec.tp, gpus_per_node // spec.tp, fraction, minimum, weights, pool,
                         sglang_workspace_bytes(spec.tp), per_token, max(pool, 0) // per_token)


def assistant_problem(a: AssistantInfo) -> Optional[str]:
    """Why SGLang would refuse to start this assistant (its KV pool below one request), or None."""
    if a.tokens_at_once >= ASSISTANT_REQUEST_TOKENS:
        return None
    return (f"the colocated assistant's KV pool ({a.kv_pool / GIB:.2f} GiB at --mem-fraction-static "
            f"{a.mem_fraction:g}, weights {a.weights / GIB:.2f} GiB per GPU) holds {a.tokens_at_once} tokens, less "
            f"than one request ({ASSISTANT_REQUEST_TOKENS}): SGLang refuses to start; set ASSISTANT_MEM_FRACTION >= "
            f"{a.min_fraction:g}")


def colocated_assistant(cfg: CooperConfig, policy: ArchSpec) -> tuple[Optional[AssistantSpec], list[str]]:
    """The assistant the launchers start next to training for ``cfg``, and notes on what was assumed.

    One is colocated when the RM's negatives come from an assistant (``reward.mode: cooper``,
    ``rm.negatives: assistant``) at an address on this host; it is taken to have the policy's
    shape and the preset's ``parallel.tp`` (``examples/launch_multinode.sh``'s defaults).
    """
    if not cfg.uses_assistant:
        return None, []
    url = cfg.rm.assistant_url
    if urllib.parse.urlparse(url).hostname not in LOOPBACK_HOSTS:
        return None, [f"assistant at {url}: a separate server, not counted on these GPUs"]
    model, served = cfg.rm.assistant_model, os.path.basename(cfg.model.policy_hf.rstrip("/"))
    same = "" if model == served else f" (rm.assistant_model={model!r}: assumed)"
    return AssistantSpec(policy, tp=cfg.parallel.tp), [
        f"colocated assistant at {url}: one SGLang server per node, the policy's shape{same}, "
        f"ASSISTANT_TP={cfg.parallel.tp} (parallel.tp, the launcher's default); counted on every GPU"]


def _seq_len(cfg: CooperConfig, opts: PlanOptions) -> int:
    return -(-(opts.prompt_tokens + cfg.rollout.max_new_tokens) // 8) * 8


def training_activation_bytes(arch: ArchSpec, lay: Layout, stage: int, tokens: int, micro_batches: int,
                              dtype_bytes: int, recompute: bool) -> int:
    """Activation bytes a training pass keeps for backward on ``stage`` (micro-batches of ``tokens``
    tokens, 1F1B: ``min(pp - stage, micro_batches)`` in flight), at the mean routing of a
    mixture-of-experts model. With full recomputation each layer keeps only its input (h), plus one
    layer's set while it is recomputed."""
    sparse = stage_layers(arch, lay.pp, stage)
    per = {s: layer_activation_bytes(arch, tokens, dtype_bytes, lay.tp, lay.sequence_parallel, s, lay.etp)
           for s in set(sparse)}
    in_flight = min(lay.pp - stage, micro_batches)
    if recompute:
        kept = tokens * arch.hidden_size * dtype_bytes // (lay.tp if lay.sequence_parallel else 1)
        return in_flight * len(sparse) * kept + max(per.values())
    return in_flight * sum(per[s] for s in sparse)


def pass_memory(arch: ArchSpec, lay: Layout, stage: int, tokens: int, micro_batches: int, dtype_bytes: int,
                train: bool, recompute: bool = False, logits: int = 0) -> dict[str, int]:
    """A forward(-backward) pass's ``activations``, ``logits`` and ``routing_margin`` on ``stage`` at
    its worst moment (the moments the memory simulation shows: :mod:`cooper_mcore.planner.simulate`).

    Forward only: inside the largest layer (:func:`~cooper_mcore.planner.sizes.forward_activation_bytes`,
    no logits yet), or at the loss (``logits``, on the last stage: the layers' memory is gone). Training:
    what the stage keeps (:func:`training_activation_bytes`) plus, at the loss, the final norm's set and
    ``logits``, or, in backward, its workspace (:func:`~cooper_mcore.planner.sizes.backward_workspace_bytes`).
    A mixture-of-experts model adds its ``routing_margin`` (uneven routing: the margin over the mean
    routed copies of what its sparse layers hold).
    """
    sparse = stage_layers(arch, lay.pp, stage)
    margin = routing_margin_bytes(arch, tokens, dtype_bytes, lay.tp, lay.sequence_parallel, lay.etp, train)
    if not train:
        inside = forward_activation_bytes(arch, tokens, dtype_bytes, lay.tp, lay.sequence_parallel, lay.etp)
        moments = [{"activations": inside, "logits": 0}, {"activations": 0, "logits": logits}]
        return dict(max(moments, key=lambda m: sum(m.values())), routing_margin=margin if any(sparse) else 0)
    kept = training_activation_bytes(arch, lay, stage, tokens, micro_batches, dtype_bytes, recompute)
    final = final_norm_bytes(arch, tokens, dtype_bytes, lay.tp, lay.sequence_parallel) if stage == lay.pp - 1 else 0
    workspace = backward_workspace_bytes(arch, tokens, dtype_bytes, lay.tp, lay.sequence_parallel, lay.ep, lay.etp,
                                         sparse)
    moments = [{"activations": kept + final, "logits": logits},
               {"activations": kept + max(final, workspace), "logits": 0}]
    return dict(max(moments, key=lambda m: sum(m.values())),
                routing_margin=min(lay.pp - stage, micro_batches) * sum(sparse) * margin)


class _Planner:
    """Evaluates the phases of one config for any offload settings."""

    def __init__(self, cfg: CooperConfig, policy: ArchSpec, rm: Optional[ArchSpec], opts: PlanOptions) -> None:
        if cfg.model.dtype not in DTYPE_BYTES:
            raise ValueError(f"model.dtype must be one of {sorted(DTYPE_BYTES)}, got {cfg.model.dtype!r}")
        if opts.gpus_per_node < 1 or opts.nodes < 1 or opts.gpu_memory_gib <= 0:
            raise ValueError("gpus_per_node and nodes must be >= 1 and gpu_memory_gib > 0")
        if opts.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {opts.prompt_tokens}")
        if cfg.reward.mode.uses_rm and rm is None:
            raise ValueError(f"reward.mode={cfg.reward.mode} needs the reward model's shape")
        self.cfg, self.policy, self.opts = cfg, policy, opts
        self.rm = rm if cfg.reward.mode.uses_rm else None
        self.lay = layout_of(cfg, opts.world_size)
        check_layout(policy, self.lay.tp, self.lay.pp, "policy", self.lay.ep, self.lay.etp)
        if self.rm is not None:
            check_layout(self.rm, self.lay.tp, self.lay.pp, "reward model", self.lay.ep, self.lay.etp)
        t = cfg.train
        if t.prompts_per_step % self.lay.dp:
            raise ValueError(f"train.prompts_per_step={t.prompts_per_step} is not divisible by the data-parallel "
                             f"size {self.lay.dp}")
        self.b = DTYPE_BYTES[cfg.model.dtype]
        self.capacity = int(opts.gpu_memory_gib * GIB)
        self.seq = _seq_len(cfg, opts)
        self.prompts = t.prompts_per_step // self.lay.dp  # per data-parallel rank
        self.seqs = self.prompts * cfg.rollout.group_size
        self.mbs = min(t.micro_batch_size, self.seqs)
        self.states = [self._states(s) for s in range(self.lay.pp)]
        self.notes: list[str] = []
        spec = opts.assistant
        if spec == "auto":
            spec, self.notes = colocated_assistant(cfg, policy)
        elif spec == "none":
            spec = None
        self.assistant = (assistant_info(spec, opts.gpus_per_node, opts.gpu_memory_gib, opts.context_gib)
                          if spec is not None else None)

    def _assistant_bytes(self) -> dict[str, int]:
        a = self.assistant
        if a is None:
            return {}
        return {"assistant_weights": a.weights, "assistant_kv": max(a.kv_pool, 0), "assistant_workspace": a.workspace}

    def _contexts(self, stage: int) -> int:
        """CUDA contexts on one GPU of ``stage``: trainer, policy engine (SGLang, stage 0), assistant."""
        n = 1 + (self.assistant is not None) + (stage == 0 and self.cfg.rollout.uses_sglang)
        return int(n * self.opts.context_gib * GIB)

    def _state(self, arch: ArchSpec, stage: int, trainable: bool) -> dict[str, int]:
        lay = self.lay
        # megatron marks experts allreduce=False (own DDP buffer, optimizer over expt_dp) only when
        # EP > 1; at EP=1 they are ordinary parameters, sharded over DP
        experts = stage_expert_numel(arch, lay.pp, stage, lay.ep, lay.etp) if lay.ep > 1 else 0
        return training_state(stage_numel(arch, lay.tp, lay.pp, stage, lay.ep, lay.etp), self.b, lay.dp,
                              self.opts.distributed_optimizer, trainable, experts, lay.expert_dp)

    def _states(self, stage: int) -> dict[str, int]:
        out = {f"policy_{k}": v for k, v in self._state(self.policy, stage, True).items()}
        rm = dict.fromkeys(STATE, 0)
        if self.rm is not None:
            rm = self._state(self.rm, stage, self.cfg.reward.mode.trains_rm)
        out.update({f"rm_{k}": v for k, v in rm.items()})
        return out

    def engine(self) -> EngineInfo:
        """The engine's weights and KV cache on its GPUs (they belong to pipeline stage 0)."""
        cfg, arch, lay = self.cfg, self.policy, self.lay
        needed = self.seqs * self.seq
        if cfg.rollout.uses_sglang:
            weights = serving_numel(arch, lay.tp) * self.b
            per_token = kv_bytes_per_token(arch, self.b, lay.tp)
            free = (self.capacity - int(self.opts.overhead_gib * GIB) - self._contexts(0)
                    - sum(self._assistant_bytes().values()) - sum(self.states[0].values()))
            pool = int(cfg.rollout.sglang_mem_fraction * free) - weights
            return EngineInfo("sglang", weights, pool, per_token, self.seqs, needed, max(pool, 0) // per_token)
        weights = model_numel(arch) * self.b
        per_token = kv_bytes_per_token(arch, self.b)
        at_once = min(HF_ENGINE_BATCH, self.seqs) * self.seq
        return EngineInfo("hf", weights, at_once * per_token, per_token, self.seqs, needed, at_once)

    def evaluate(self, offload: OffloadConfig) -> Evaluation:
        """Memory of every phase (worst stage each) with the given offload settings."""
        engine = self.engine()
        per_stage = [self._phases(s, offload, engine) for s in range(self.lay.pp)]
        worst = [max((stage[i] for stage in per_stage), key=lambda p: p.total) for i in range(len(PHASES))]
        problems = []
        if engine.is_sglang and engine.tokens_at_once < self.seq:
            problems.append(f"SGLang's KV pool ({engine.kv_pool / GIB:.2f} GiB) holds {engine.tokens_at_once} "
                            f"tokens, less than one sequence ({self.seq}): raise rollout.sglang_mem_fraction "
                            f"or use more tensor/pipeline parallelism")
        if self.assistant is not None and (problem := assistant_problem(self.assistant)):
            problems.append(problem)
        return Evaluation(offload, self.capacity, worst, engine, self._host_bytes(offload, engine), problems, per_stage)

    def _phases(self, stage: int, off: OffloadConfig, engine: EngineInfo) -> list[PhaseMemory]:
        cfg, arch, lay, b = self.cfg, self.policy, self.lay, self.b
        state = self.states[stage]
        on_engine_gpu = stage == 0
        # SGLang's KV pool is static; the HF engine's cache lives only while it generates
        eng = {"engine_weights": engine.weights} if on_engine_gpu else {}
        if on_engine_gpu and engine.is_sglang:
            limits = sglang_default_limits(self.opts.gpu_memory_gib, lay.tp)
            eng.update(engine_kv=engine.kv_pool, engine_workspace=sglang_workspace_bytes(lay.tp, *limits))
        base = dict.fromkeys(COMPONENTS, 0)
        base.update(state, **self._assistant_bytes(), contexts=self._contexts(stage),
                    overhead=int(self.opts.overhead_gib * GIB))
        last = stage == lay.pp - 1
        budget = cfg.train.max_tokens_per_micro_batch  # micro-batches by tokens: whole sequences up to the budget
        tokens = max(self.seq, budget // self.seq * self.seq) if budget else self.mbs * self.seq
        packed = bool(budget) and cfg.train.pack_sequences
        resident = dict(base, **(eng if not off.release_engine else {}))

        rollout = dict(base, **eng)
        if on_engine_gpu:
            rollout["engine_kv"] = engine.kv_pool
        for k in state:
            if getattr(off, k):
                rollout[k] = 0
        if on_engine_gpu and not engine.is_sglang:
            prefill = min(HF_ENGINE_BATCH, self.seqs) * self.opts.prompt_tokens
            rollout["engine_workspace"] = forward_activation_bytes(arch, prefill, b)  # the engine's prefill

        chunk = cfg.train.logprob_chunk_tokens
        logprobs = dict(resident, **pass_memory(arch, lay, stage, tokens, 1, b, False, logits=logits_bytes(
            arch, tokens, b, lay.tp, False, chunk, packed=packed) if last else 0))
        micro = (-(-self.seqs // cfg.train.mini_batches * self.seq // tokens) if budget
                 else self.seqs // cfg.train.mini_batches // self.mbs)
        update = dict(resident, **pass_memory(arch, lay, stage, tokens, max(micro, 1), b, True, self.opts.recompute,
                                              logits_bytes(arch, tokens, b, lay.tp, True, chunk,
                                                           cfg.algo.entropy_coef > 0) if last else 0))
        rm_score, rm_update = dict(resident), dict(resident)
        if self.rm is not None:
            rm_seq = min(self.seq, self.rm.max_position_embeddings)
            score_tokens = max(rm_seq, budget // rm_seq * rm_seq) if budget else self.mbs * rm_seq
            rm_score.update(pass_memory(self.rm, lay, stage, score_tokens, 1, b, False))
            if cfg.reward.mode.trains_rm:
                pairs = self.prompts * cfg.rm.pairs_per_prompt  # this rank's pairs, two rows each
                if budget:  # whole pairs up to the budget
                    pair_tokens = min(max(2 * rm_seq, budget // (2 * rm_seq) * 2 * rm_seq), 2 * pairs * rm_seq)
                    micro_pairs = max(1, -(-2 * pairs * rm_seq // pair_tokens))
                else:  # micro_batch_size pairs, the last filled up with masked copies (train/reward_model.py)
                    pair_tokens = 2 * cfg.train.micro_batch_size * rm_seq
                    micro_pairs = -(-pairs // cfg.train.micro_batch_size)
                rm_update.update(pass_memory(self.rm, lay, stage, pair_tokens, micro_pairs, b, True,
                                             self.opts.recompute))
        # before the weight push the trainer offloads all it is told to but the policy's parameters
        # (rl/colocate.py); the engine holds everything in the first step (it starts resident)
        sync = dict(base, **eng, buffers=sync_buffer_bytes(arch, cfg.rollout.bucket_mb * 2**20, b, lay.tp, lay.pp,
                                                           lay.ep, cfg.rollout.uses_sglang, receiver=stage == 0))
        for k in state:
            if k != "policy_params" and getattr(off, k):
                sync[k] = 0
        comps = (rollout, rm_score, logprobs, update, rm_update, sync)
        return [PhaseMemory(name, stage, c) for name, c in zip(PHASES, comps)]

    def _host_bytes(self, off: OffloadConfig, engine: EngineInfo) -> int:
        """Host memory per GPU (stage 0): reference copy and swap stash, offloaded state (not the
        gradients: the trainer drops them, every update zeroes them first), released HF engine."""
        state = self.states[0]
        host = 2 * state["policy_params"] if self.cfg.algo.kl_coef else 0
        host += sum(v for k, v in state.items() if getattr(off, k) and not k.endswith("_grads"))
        if not engine.is_sglang and off.release_engine:
            host += engine.weights
        return host


def _transfer_cost(ev: Evaluation, states: dict[str, int]) -> int:
    """Bytes moved between host and device per step by the offload settings (lower is better)."""
    moved = sum(2 * v for k, v in states.items() if getattr(ev.offload, k))
    if ev.offload.release_engine and not ev.engine.is_sglang:
        moved += 2 * ev.engine.weights
    return moved


def plan(cfg: CooperConfig, policy: ArchSpec, rm: Optional[ArchSpec], opts: PlanOptions) -> Plan:
    """Evaluate the run as configured and with each offload setting flipped; if it does not fit,
    try every set of further offloads and recommend the fitting one that moves the fewest bytes
    per step.

    Raises:
        ValueError: an impossible layout or setting, naming it.
    """
    p = _Planner(cfg, policy, rm, opts)
    given_off = cfg.offload
    given = p.evaluate(given_off)
    effects = {flag: (p.evaluate(dataclasses.replace(given_off, **{flag: False})),
                      p.evaluate(dataclasses.replace(given_off, **{flag: True}))) for flag in OFFLOAD_FLAGS}
    recommended = given if given.fits else None
    if recommended is None:  # add offloads to those configured (never remove one)
        choices = [(True,) if getattr(given_off, f) else (False, True) for f in OFFLOAD_FLAGS]
        fitting = [ev for values in itertools.product(*choices)
                   if (ev := p.evaluate(OffloadConfig(**dict(zip(OFFLOAD_FLAGS, values))))).fits]
        if fitting:
            recommended = min(fitting, key=lambda ev: (_transfer_cost(ev, p.states[0]), ev.peak.total,
                                                       sum(dataclasses.astuple(ev.offload))))
    return Plan(p.lay, policy, p.rm, opts, given, effects, recommended, p.assistant, list(p.notes))


@dataclass(frozen=True)
class MicroBatchFit:
    """The largest micro-batches a run fits in, by :func:`largest_micro_batch`.

    Attributes:
        setting: the dotted setting sized: ``train.micro_batch_size``, or ``train.max_tokens_per_micro_batch``
            when the run forms micro-batches by a token budget.
        value: the largest value the run accepts whose plan fits: a micro-batch size dividing a
            data-parallel rank's sequences per mini-batch (what the config checks require), or a
            token budget in multiples of the granularity.
        largest_fitting: the largest value whose plan fits, accepted by the run or not (``value`` <= it).
        limit: the largest value tried: a whole mini-batch of a rank in one micro-batch.
        peak: the predicted peak phase at ``value``.
    """

    setting: str
    value: int
    largest_fitting: int
    limit: int
    peak: PhaseMemory


def largest_micro_batch(cfg: CooperConfig, policy: ArchSpec, rm: Optional[ArchSpec], opts: PlanOptions,
                        granularity: int = 256) -> Optional[MicroBatchFit]:
    """The largest ``train.micro_batch_size`` (or, when ``train.max_tokens_per_micro_batch`` is set, the
    largest token budget, in multiples of ``granularity``) whose predicted peak fits
    ``opts.gpu_memory_gib`` with the run's offload settings as configured; None when one sequence per
    micro-batch does not fit. Every value up to the limit is planned: the answer does not rely on memory
    growing with the micro-batch.

    Raises:
        ValueError: an impossible layout or setting (as :func:`plan`).
    """
    t = cfg.train
    lay = layout_of(cfg, opts.world_size)
    per_mini = max(t.prompts_per_step // lay.dp * cfg.rollout.group_size // t.mini_batches, 1)
    if t.max_tokens_per_micro_batch:
        setting, field_name = "train.max_tokens_per_micro_batch", "max_tokens_per_micro_batch"
        top = -(-per_mini * _seq_len(cfg, opts) // granularity)
        values = [granularity * k for k in range(1, top + 1)]
        accepted = set(values)
    else:
        setting, field_name = "train.micro_batch_size", "micro_batch_size"
        values = list(range(1, per_mini + 1))
        accepted = {v for v in values if per_mini % v == 0}

    def evaluate(value: int) -> Evaluation:
        sized = dataclasses.replace(cfg, train=dataclasses.replace(t, **{field_name: value}))
        return _Planner(sized, policy, rm, opts).evaluate(cfg.offload)

    fitting = [v for v in values if evaluate(v).fits]
    usable = [v for v in fitting if v in accepted]
    if not usable:
        return None
    return MicroBatchFit(setting, max(usable), max(fitting), values[-1], evaluate(max(usable)).peak)
