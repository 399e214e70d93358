"""Predict the per-GPU memory of a Cooper run, phase by phase, and the offload settings it needs.

Pure arithmetic on :class:`~cooper_mcore.models.arch.ArchSpec` and
:class:`~cooper_mcore.config.CooperConfig` (nothing is allocated, megatron-core is not imported).
Every figure is the memory of one GPU of the worst pipeline stage, and follows what the trainer
does (``train/run_setup.py``, ``train/cooper.py``, ``train/megatron_setup.py``):

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
  state resident; offloading later frees memory but does not grow the pool. While released
  (``offload.release_engine``) it holds nothing; it is resumed, KV pool included, for rollouts
  and for every weight sync.
* The HF engine: the whole model in the model dtype on the group leader's GPU, plus the KV cache
  of up to :data:`HF_ENGINE_BATCH` sequences generated together; moved to host memory while
  released.
* Activations of a training micro-batch (torch-native spec, SDPA attention, no dropout; the
  tensors autograd keeps per token and layer, in the model dtype): 6h (two RMSNorms: input,
  normalised output, and the normalised product before the weight) replicated across TP
  (divided by TP with sequence parallelism), plus (5 q + 4 ffn) / TP: q, k and v expanded to
  all heads and the attention output twice, the gate/up output (2 ffn), silu and product
  (ffn each). With full recomputation only each layer's input (h) is kept, plus one layer's full
  set while it is recomputed. 1F1B keeps ``min(PP - stage, micro-batches)`` micro-batches in
  flight on a stage; one more layer's worth is counted as backward workspace. Forward-only
  passes (log-probs, RM scores, the HF engine's prefill) count one layer's set as workspace.
* Logits on the last stage, per token and vocabulary entry on this TP rank: the bf16 output
  (2 B) and its fp32 copy that megatron's vocab-parallel cross entropy turns into the softmax in
  place and keeps for backward (4 B): 6 B (4 B for fp32 models, whose output is not copied) in
  forward-only passes. The update adds the entropy metric's temporaries: at TP=1
  ``algo.entropy_from_logits`` holds an fp32 copy, log-probabilities, probabilities, a -inf mask
  (1 B), the masked log-probabilities and their product (21 B); at TP>1 the policy's
  vocab-parallel entropy holds a copy, exp and product (12 B); 4 B less each for fp32 models.
* Sequences are counted at their maximum length ``prompt_tokens + rollout.max_new_tokens``
  (rounded up to 8, as the trainer pads); RM inputs at that length too, capped at the RM's
  ``max_position_embeddings``.
* A flat ``overhead_gib`` per GPU stands for CUDA contexts (trainer and engine processes), NCCL
  buffers, SGLang's CUDA graphs and allocator fragmentation.

Offload settings act on the rollout phase only (the trainer offloads around rollouts and
onloads right after), ``release_engine`` on every other phase. These are estimates: they have
not been compared with measured GPU peak memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

from cooper_mcore.config import CooperConfig, OffloadConfig
from cooper_mcore.models.arch import ArchSpec

GIB = 2**30
PHASES = ("rollout", "rm_score", "logprobs", "policy_update", "rm_update", "weight_sync")
OFFLOAD_FLAGS = ("policy_params", "policy_grads", "policy_optimizer", "rm_params", "rm_grads", "rm_optimizer",
                 "release_engine")
COMPONENTS = ("policy_params", "policy_grads", "policy_optimizer", "rm_params", "rm_grads", "rm_optimizer",
              "engine_weights", "engine_kv", "activations", "logits", "buffers", "overhead")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
HF_ENGINE_BATCH = 64  # HFEngine's default max_batch_size (sequences generated together)
STATE = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class PlanOptions:
    """What the planner needs beyond the run config.

    Attributes:
        gpus_per_node / nodes: the cluster; the world size is their product.
        gpu_memory_gib: memory of one GPU.
        prompt_tokens: the longest prompt, in tokens.
        overhead_gib: flat per-GPU allowance (CUDA contexts, NCCL, CUDA graphs, fragmentation).
        recompute: plan as if full activation recomputation were on (the trainer does not
            turn it on yet).
        distributed_optimizer: shard Adam over data-parallel ranks (the trainer always does).
    """

    gpus_per_node: int
    gpu_memory_gib: float
    nodes: int = 1
    prompt_tokens: int = 512
    overhead_gib: float = 2.0
    recompute: bool = False
    distributed_optimizer: bool = True

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int
    sequence_parallel: bool


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
        weights: engine weight bytes per GPU.
        kv_pool: KV-cache bytes per GPU (SGLang: its static pool; HF: the cache of one batch).
        kv_bytes_per_token: KV bytes per token on one GPU.
        sequences: sequences of one rollout of a model-parallel group (one data-parallel rank).
        tokens_needed: their tokens at full length.
        tokens_at_once: tokens the KV pool holds.
    """

    kind: str
    weights: int
    kv_pool: int
    kv_bytes_per_token: int
    sequences: int
    tokens_needed: int
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
    return Layout(par.tp, par.pp, world_size // (par.tp * par.pp), par.sequence_parallel)


def check_layout(arch: ArchSpec, tp: int, pp: int, name: str = "model") -> None:
    """Raise ValueError if ``arch`` cannot be split ``tp`` x ``pp`` (as the model builder requires)."""
    checks = (("num_layers", arch.num_layers, "pp", pp), ("num_key_value_heads", arch.num_query_groups, "tp", tp),
              ("num_attention_heads", arch.num_attention_heads, "tp", tp), ("vocab_size", arch.vocab_size, "tp", tp))
    for what, value, by, div in checks:
        if value % div:
            raise ValueError(f"{name}: {what}={value} is not divisible by {by}={div}")


def layer_numel(arch: ArchSpec, tp: int = 1) -> int:
    """Parameters of one transformer layer on one TP rank."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, 2 * arch.num_query_groups * d
    n = 2 * h  # input and pre-MLP RMSNorm weights (replicated)
    n += (q + kv) * h // tp + ((q + kv) // tp if arch.qkv_bias else 0)
    n += 2 * d if arch.qk_norm else 0
    n += h * q // tp  # attention output projection
    n += 3 * h * arch.ffn_hidden_size // tp  # gate+up, down
    return n


def stage_numel(arch: ArchSpec, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
    """Parameters on one rank of pipeline stage ``stage`` (megatron-core's layout)."""
    assert 0 <= stage < pp
    h = arch.hidden_size
    embedding = arch.vocab_size * h // tp
    n = arch.num_layers // pp * layer_numel(arch, tp)
    if stage == 0:
        n += embedding
    if stage == pp - 1:
        n += h  # final norm
        if arch.model_type == "reward":
            n += h  # scalar head, replicated
        elif not arch.tie_word_embeddings or pp > 1:
            n += embedding
    return n


def model_numel(arch: ArchSpec) -> int:
    """Parameters of the whole model (equal to the Hugging Face count)."""
    return stage_numel(arch)


def training_state(numel: int, dtype_bytes: int, dp: int, distributed_optimizer: bool = True,
                   trainable: bool = True) -> dict[str, int]:
    """Bytes of parameters, gradients and Adam state for ``numel`` parameters on one rank."""
    if not trainable:
        return {"params": numel * dtype_bytes, "grads": 0, "optimizer": 0}
    per_param = 8 + (4 if dtype_bytes < 4 else 0)  # two fp32 moments (+ fp32 main params for bf16)
    shard = math.ceil(numel / dp) if distributed_optimizer else numel
    return {"params": numel * dtype_bytes, "grads": numel * 4, "optimizer": shard * per_param}


def kv_bytes_per_token(arch: ArchSpec, dtype_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes per token on one GPU: 2 (K, V) x layers x KV heads x head_dim x dtype bytes.

    With ``tp`` above the number of KV heads, each GPU keeps one (replicated) head.
    """
    heads = max(1, arch.num_query_groups // tp)
    return 2 * arch.num_layers * heads * arch.head_dim * dtype_bytes


def layer_activation_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int = 1,
                           sequence_parallel: bool = False) -> int:
    """Bytes autograd keeps for one layer over ``tokens`` tokens (see the module docstring)."""
    q = arch.num_attention_heads * arch.head_dim
    replicated = 6 * arch.hidden_size // (tp if sequence_parallel else 1)
    return tokens * dtype_bytes * (replicated + (5 * q + 4 * arch.ffn_hidden_size) // tp)


def logits_bytes(arch: ArchSpec, tokens: int, dtype_bytes: int, tp: int, train: bool) -> int:
    """Peak bytes of the output logits and their loss/metric temporaries on the last stage."""
    copy = 4 if dtype_bytes < 4 else 0  # .float() copies only half-precision logits
    per = dtype_bytes + copy
    if train:  # the entropy metric (no grad) while the micro-batch's activations are held
        per += copy + (17 if tp == 1 else 8)
    return tokens * arch.vocab_size // tp * per


def _seq_len(cfg: CooperConfig, opts: PlanOptions) -> int:
    return -(-(opts.prompt_tokens + cfg.rollout.max_new_tokens) // 8) * 8


def training_activation_bytes(arch: ArchSpec, lay: Layout, stage: int, tokens: int, micro_batches: int,
                              dtype_bytes: int, recompute: bool) -> int:
    """Activation bytes a training pass keeps on ``stage`` (micro-batches of ``tokens`` tokens, 1F1B)."""
    layer = layer_activation_bytes(arch, tokens, dtype_bytes, lay.tp, lay.sequence_parallel)
    in_flight = min(lay.pp - stage, micro_batches)
    layers = arch.num_layers // lay.pp
    if recompute:
        kept = tokens * arch.hidden_size * dtype_bytes // (lay.tp if lay.sequence_parallel else 1)
        return in_flight * layers * kept + 2 * layer
    return (in_flight * layers + 1) * layer


class _Planner:
    """Evaluates the phases of one config for any offload settings."""

    def __init__(self, cfg: CooperConfig, policy: ArchSpec, rm: Optional[ArchSpec], opts: PlanOptions) -> None:
        if cfg.model.dtype not in DTYPE_BYTES:
            raise ValueError(f"model.dtype must be one of {sorted(DTYPE_BYTES)}, got {cfg.model.dtype!r}")
        if opts.gpus_per_node < 1 or opts.nodes < 1 or opts.gpu_memory_gib <= 0:
            raise ValueError("gpus_per_node and nodes must be >= 1 and gpu_memory_gib > 0")
        if opts.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {opts.prompt_tokens}")
        if cfg.reward.mode != "rule" and rm is None:
            raise ValueError(f"reward.mode={cfg.reward.mode} needs the reward model's shape")
        self.cfg, self.policy, self.opts = cfg, policy, opts
        self.rm = rm if cfg.reward.mode != "rule" else None
        self.lay = layout_of(cfg, opts.world_size)
        check_layout(policy, self.lay.tp, self.lay.pp, "policy")
        if self.rm is not None:
            check_layout(self.rm, self.lay.tp, self.lay.pp, "reward model")
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

    def _states(self, stage: int) -> dict[str, int]:
        lay, o = self.lay, self.opts
        out = {f"policy_{k}": v for k, v in training_state(
            stage_numel(self.policy, lay.tp, lay.pp, stage), self.b, lay.dp, o.distributed_optimizer).items()}
        rm = dict.fromkeys(STATE, 0)
        if self.rm is not None:
            rm = training_state(stage_numel(self.rm, lay.tp, lay.pp, stage), self.b, lay.dp,
                                o.distributed_optimizer, trainable=self.cfg.reward.mode == "cooper")
        out.update({f"rm_{k}": v for k, v in rm.items()})
        return out

    def engine(self) -> EngineInfo:
        """The engine's weights and KV cache on its GPUs (they belong to pipeline stage 0)."""
        cfg, arch, lay = self.cfg, self.policy, self.lay
        needed = self.seqs * self.seq
        if cfg.rollout.engine == "sglang":
            weights = stage_numel(arch, lay.tp, 1, 0) * self.b
            per_token = kv_bytes_per_token(arch, self.b, lay.tp)
            free = self.capacity - int(self.opts.overhead_gib * GIB) - sum(self.states[0].values())
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
        if engine.kind == "sglang" and engine.tokens_at_once < self.seq:
            problems.append(f"SGLang's KV pool ({engine.kv_pool / GIB:.2f} GiB) holds {engine.tokens_at_once} "
                            f"tokens, less than one sequence ({self.seq}): raise rollout.sglang_mem_fraction "
                            f"or use more tensor/pipeline parallelism")
        return Evaluation(offload, self.capacity, worst, engine, self._host_bytes(offload, engine), problems)

    def _phases(self, stage: int, off: OffloadConfig, engine: EngineInfo) -> list[PhaseMemory]:
        cfg, arch, lay, b = self.cfg, self.policy, self.lay, self.b
        state = self.states[stage]
        on_engine_gpu = stage == 0
        # SGLang's KV pool is static; the HF engine's cache lives only while it generates
        eng = {"engine_weights": engine.weights} if on_engine_gpu else {}
        if on_engine_gpu and engine.kind == "sglang":
            eng["engine_kv"] = engine.kv_pool
        base = dict.fromkeys(COMPONENTS, 0)
        base.update(state, overhead=int(self.opts.overhead_gib * GIB))
        last = stage == lay.pp - 1
        tokens = self.mbs * self.seq
        fwd_layer = layer_activation_bytes(arch, tokens, b, lay.tp, lay.sequence_parallel)
        resident = dict(base, **(eng if not off.release_engine else {}))

        rollout = dict(base, **eng)
        if on_engine_gpu:
            rollout["engine_kv"] = engine.kv_pool
        for k in state:
            if getattr(off, k):
                rollout[k] = 0
        if on_engine_gpu and engine.kind == "hf":
            prefill = min(HF_ENGINE_BATCH, self.seqs) * self.opts.prompt_tokens
            rollout["activations"] = layer_activation_bytes(arch, prefill, b)

        logprobs = dict(resident, activations=fwd_layer, buffers=2 * self.seqs * self.seq * 4,
                        logits=logits_bytes(arch, tokens, b, lay.tp, train=False) if last else 0)
        micro = self.seqs // cfg.train.mini_batches // self.mbs
        update = dict(resident, activations=training_activation_bytes(arch, lay, stage, tokens, max(micro, 1), b,
                                                                  self.opts.recompute),
                      logits=logits_bytes(arch, tokens, b, lay.tp, train=True) if last else 0)
        rm_score, rm_update = dict(resident), dict(resident)
        if self.rm is not None:
            rm_seq = min(self.seq, self.rm.max_position_embeddings)
            rm_score["activations"] = layer_activation_bytes(self.rm, self.mbs * rm_seq, b, lay.tp,
                                                             lay.sequence_parallel)
            if cfg.reward.mode == "cooper":
                pairs = min(self.mbs, self.prompts)
                rm_update["activations"] = training_activation_bytes(
                    self.rm, lay, stage, 2 * pairs * rm_seq, -(-self.prompts // pairs), b, self.opts.recompute)
        sync = dict(base, **eng, buffers=2 * cfg.rollout.bucket_mb * 2**20)
        comps = (rollout, rm_score, logprobs, update, rm_update, sync)
        return [PhaseMemory(name, stage, c) for name, c in zip(PHASES, comps)]

    def _host_bytes(self, off: OffloadConfig, engine: EngineInfo) -> int:
        """Host memory per GPU (stage 0): reference copy and swap stash, offloaded state, released HF engine."""
        state = self.states[0]
        host = 2 * state["policy_params"] if self.cfg.algo.kl_coef else 0
        host += sum(v for k, v in state.items() if getattr(off, k))
        if engine.kind == "hf" and off.release_engine:
            host += engine.weights
        return host


def _transfer_cost(ev: Evaluation, states: dict[str, int]) -> int:
    """Bytes moved between host and device per step by the offload settings (lower is better)."""
    moved = sum(2 * v for k, v in states.items() if getattr(ev.offload, k))
    if ev.offload.release_engine and ev.engine.kind == "hf":
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
    return Plan(p.lay, policy, p.rm, opts, given, effects, recommended)
