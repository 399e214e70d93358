"""Build everything a Cooper run needs from its config: the distributed world, the policy and its
frozen reference, the reward model, optimizers and schedules, the rollout engine and its
colocation with the models, the rule verifier (and the evaluation's oracle), the assistant client and
the data.

The models come from their checkpoints, or with ``model.init: random`` are built with random
weights directly on the device at their shapes (the reference is then a host copy of that policy,
and the transformers engine is built empty and filled by the first weight push): a run at a real
model shape that starts in seconds, to measure time and memory, with nothing written or converted.

Validation happens before any heavy work.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.checkpoint.model import EXTRA_DIR, load_checkpoint_model, read_meta
from cooper_mcore.checkpoint.tokenizer import load_checkpoint_tokenizer
from cooper_mcore.collectives import any_rank, is_group_leader
from cooper_mcore.config.checks import validate
from cooper_mcore.config.model_shapes import ModelShape, random_init_shapes
from cooper_mcore.config.schema import CooperConfig, OptimSection
from cooper_mcore.data.datasets import read_prompts
from cooper_mcore.data.iterator import PromptIterator
from cooper_mcore.data.mathgen import reference_value
from cooper_mcore.data.templates import template_prompts
from cooper_mcore.data.tokenizer import check_tokenizer_fits, load_tokenizer
from cooper_mcore.llm_client import OpenAIChatClient
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.routing_replay import enable_routing_replay
from cooper_mcore.parallel import init_distributed
from cooper_mcore.rl.async_rollouts import RolloutPipeline, publish_policy
from cooper_mcore.rl.colocate import Colocation
from cooper_mcore.rl.references import check_references
from cooper_mcore.rollout.base import RolloutEngine, SamplingParams
from cooper_mcore.rollout.engine_process import EngineProcess, EngineSpec
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.rollout.sglang_engine import SGLangConfig, SGLangEngine
from cooper_mcore.rollout.weight_group import WeightGroupSpec, free_port
from cooper_mcore.train.model_state import ModelState
from cooper_mcore.train.moe_aux import set_aux_loss_coef
from cooper_mcore.train.offload import ModelOffloader, ReferenceSwap
from cooper_mcore.train.step import OptimConfig, build_scheduler, wrap_for_training
from cooper_mcore.types import Prompt
from cooper_mcore.verify.oracle import ArithmeticOracle
from cooper_mcore.verify.rule import RuleVerifier

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Run:
    """Everything a Cooper step needs, built once by :func:`build_run`.

    Attributes:
        cfg: the run's config.
        policy: the policy, trained.
        rm: the reward model (trained in cooper mode, frozen in static_rm mode; None in rule mode).
        reference: the frozen KL reference, swapped into the policy's parameters on demand
            (None when ``algo.kl_coef`` is 0).
        colocation: the rollout engine and the order in which it shares the GPUs with the models.
        verifier: the rule verifier (on model-parallel group leaders; None elsewhere).
        oracle: the checker of held-out accuracy when ``eval.verifier`` is ``arithmetic_oracle``
            (on model-parallel group leaders; None elsewhere or with the rule verifier).
        assistant: the assistant LLM's client (leaders, cooper mode with assistant negatives).
        data: this data-parallel rank's prompt stream.
        eval_prompts: the held-out prompts (all of them; evaluation splits them across replicas).
        step: steps finished.
        skipped_too_long: training prompts left out because a rollout from them would not fit the
            policy's context (:func:`drop_too_long`; the ``data/skipped_too_long`` metric).
        engine_checked: whether this process has run a step, so the engine's first check against
            the trainer (``algo.logprob_diff_guard``) is done.
        pipeline: the rollouts generated ahead by an engine apart from the trainer
            (``rollout.placement: disaggregated``; :func:`open_pipeline`); None: the colocated order.
    """

    cfg: CooperConfig
    policy: ModelState
    rm: Optional[ModelState]
    reference: Optional[ReferenceSwap]
    colocation: Colocation
    verifier: Optional[RuleVerifier]
    assistant: Optional[OpenAIChatClient]
    data: PromptIterator
    eval_prompts: list[Prompt] = field(default_factory=list)
    step: int = 0
    skipped_too_long: int = 0
    oracle: Optional[ArithmeticOracle] = None
    engine_checked: bool = False
    pipeline: Optional[RolloutPipeline] = None

    def close(self) -> None:
        """Stop the rollout thread and its engine process, the verifier's workers and the oracle (whatever
        this rank holds)."""
        if self.pipeline is not None:
            self.pipeline.close()
        for checker in (self.verifier, self.oracle):
            if checker is not None:
                checker.close()

    @property
    def trained_models(self) -> list[ModelState]:
        """The models a training checkpoint holds (with their optimizers)."""
        return [m for m in (self.policy, self.rm) if m is not None and m.trains]

    @property
    def batching(self) -> MicroBatching:
        """How every pass cuts its mini-batch into micro-batches (``train.*``)."""
        t = self.cfg.train
        return MicroBatching(t.micro_batch_size, t.max_tokens_per_micro_batch, t.pack_sequences)

    def rollout_sampling(self, step: int) -> SamplingParams:
        """The sampling of step ``step``'s rollouts on this rank (a seed of the run's seed, the step and the rank)."""
        return self.sampling(self.cfg.train.seed * 100003 + step * 1009 + dist.get_rank())

    def sampling(self, seed: int) -> SamplingParams:
        """Rollout sampling with ``seed``, with each token's log-probability (the engine checked
        against the trainer, truncated importance sampling)."""
        ro = self.cfg.rollout
        return SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p,
                              stop=list(ro.stop), seed=seed, logprobs=True,
                              routed_experts=self.cfg.model.moe_routing_replay)

    def eval_sampling(self) -> SamplingParams:
        """Held-out sampling (temperature 0.7, top-p 0.95 by default, as the paper)."""
        e = self.cfg.eval
        return SamplingParams(max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p,
                              stop=list(self.cfg.rollout.stop), seed=self.cfg.train.seed)


def _optim(o: OptimSection) -> OptimConfig:
    return OptimConfig(lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad)


def load_model(name: str, ckpt: str, cfg: CooperConfig, tokenizer, optim: Optional[OptimSection],
               schedule_steps: int) -> ModelState:
    """Load a model checkpoint at the run's layout; wrap it for training when ``optim`` is given. A
    ``tokenizer`` (None: a model loaded without one) must fit the checkpoint's vocabulary.

    Raises:
        ValueError: the checkpoint's dtype is not ``model.dtype``, or ``tokenizer`` has ids past its vocabulary.
    """
    ckpt_arch, hf_config, dtype = read_meta(ckpt)
    if dtype != DTYPES[cfg.model.dtype]:
        raise ValueError(f"model.dtype={cfg.model.dtype} but {ckpt} holds {dtype}; convert the checkpoint "
                         "in the dtype you train in")
    if tokenizer is not None:  # before the load: no IndexError in a forward
        check_tokenizer_fits(tokenizer, ckpt_arch.vocab_size, ckpt)
    module, arch = load_checkpoint_model(ckpt, cfg.parallel)
    return _model_state(name, module, arch, hf_config, dtype, ckpt, cfg, tokenizer, optim, schedule_steps)


def random_model(name: str, shape: ModelShape, cfg: CooperConfig, tokenizer, optim: Optional[OptimSection],
                 schedule_steps: int, seed: int) -> ModelState:
    """A model of ``shape`` with random weights (megatron's initialisation) built directly on this
    rank's device at the run's layout (``model.init: random``); wrapped for training when ``optim``
    is given. The CPU generator is seeded with ``seed`` for the build (on a GPU megatron's seeded
    trackers draw), so every data-parallel replica builds the same weights.

    Raises:
        ValueError: ``tokenizer`` has ids past the shape's vocabulary.
    """
    if tokenizer is not None:
        check_tokenizer_fits(tokenizer, shape.arch.vocab_size, shape.source)
    dtype = DTYPES[cfg.model.dtype]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = build_model(shape.arch, cfg.parallel, dtype=dtype, init_weights=True)
    return _model_state(name, module, shape.arch, shape.hf_config, dtype, "", cfg, tokenizer, optim, schedule_steps)


def _model_state(name: str, module: torch.nn.Module, arch: ArchSpec, hf_config: dict, dtype: torch.dtype,
                 source_ckpt: str, cfg: CooperConfig, tokenizer, optim: Optional[OptimSection],
                 schedule_steps: int) -> ModelState:
    """A built model with its training state: DDP, optimizer and schedule when ``optim`` is given."""
    if cfg.model.moe_aux_loss_coef is not None and arch.moe is not None:
        set_aux_loss_coef(module, cfg.model.moe_aux_loss_coef)
    ddp = optimizer = scheduler = None
    if optim is not None:
        ddp, optimizer = wrap_for_training(module, _optim(optim), per_token_loss=True)
        scheduler = build_scheduler(optimizer, optim.lr, optim.warmup_steps, schedule_steps, optim.weight_decay)
    # gradients are not copied out and back: every update zeroes them first
    offloader = ModelOffloader(ddp if ddp is not None else module, optimizer, discard_grads=True)
    return ModelState(name=name, module=module, arch=arch, hf_config=hf_config, dtype=dtype, source_ckpt=source_ckpt,
                      tokenizer=tokenizer, offloader=offloader, ddp=ddp, optimizer=optimizer, scheduler=scheduler)


def sglang_config(cfg: CooperConfig) -> SGLangConfig:
    """This model-parallel group's SGLang engine: on its leader's GPU and the next ``tp - 1`` (its TP
    group's GPUs on this node; without ``base_gpu_id`` every engine of a node would start on GPU 0),
    its ports from the local rank. On CPU, SGLang's CPU backend (one process: TP needs kernels its
    CPU build lacks) with a KV cache for one step's rollouts; it cannot honour per-request seeds."""
    if torch.cuda.is_available():
        return SGLangConfig(model_path=cfg.model.policy_hf, tp_size=cfg.parallel.tp, dtype=cfg.model.dtype,
                            mem_fraction_static=cfg.rollout.sglang_mem_fraction,
                            base_gpu_id=torch.cuda.current_device(), trust_remote_code=cfg.model.trust_remote_code,
                            enable_return_routed_experts=cfg.model.moe_routing_replay,
                            base_port=cfg.rollout.sglang_base_port)
    per_rank = cfg.train.prompts_per_step // max(parallel_state.get_data_parallel_world_size(), 1)
    tokens = per_rank * cfg.rollout.group_size * (cfg.rollout.max_new_tokens + 256)
    return SGLangConfig.cpu(cfg.model.policy_hf, dtype=cfg.model.dtype, random_seed=cfg.train.seed,
                            max_total_tokens=max(4096, tokens), trust_remote_code=cfg.model.trust_remote_code,
                            enable_return_routed_experts=cfg.model.moe_routing_replay,
                            base_port=cfg.rollout.sglang_base_port)


def build_engine(cfg: CooperConfig, policy: ModelState) -> RolloutEngine:
    """This model-parallel group's rollout engine, started from the policy's HF folder; with
    ``model.init: random`` a transformers model of the policy's shape built on the device with its
    weights undefined: the first generation's weight push fills it (:mod:`cooper_mcore.rl.colocate`).
    ``rollout.placement: disaggregated``: an engine in a process of its own, fed over a weight group: a
    launched SGLang server (its ``init_weights_update_group`` made here), or the transformers engine
    (:class:`~cooper_mcore.rollout.engine_process.EngineProcess`).

    Raises:
        ValueError: a disaggregated engine on a machine with GPUs (not built yet: docs/async.md).
    """
    if cfg.rollout.disaggregated:
        if torch.cuda.is_available():
            raise ValueError("rollout.placement=disaggregated runs the engine on CPU for now; engine GPUs apart from "
                             "the trainer's are not built yet (docs/async.md)")
        if cfg.rollout.uses_sglang:
            engine = SGLangEngine.launch(sglang_config(cfg))
            engine.init_weights_update_group(WeightGroupSpec("127.0.0.1", free_port(), world_size=1 + engine.tp_size))
            return engine
        return EngineProcess(EngineSpec(cfg.model.policy_hf, policy.hf_config if cfg.model.random_init else None,
                                        dtype=cfg.model.dtype, threads=cfg.rollout.engine_threads,
                                        trust_remote_code=cfg.model.trust_remote_code))
    if cfg.rollout.uses_sglang:
        return SGLangEngine.offline(sglang_config(cfg))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.model.random_init:
        return HFEngine.from_config(policy.hf_config, policy.tokenizer, dtype=DTYPES[cfg.model.dtype], device=device)
    return HFEngine.from_pretrained(cfg.model.policy_hf, dtype=DTYPES[cfg.model.dtype], device=device,
                                    trust_remote_code=cfg.model.trust_remote_code)


def connect_assistant(cfg: CooperConfig) -> Optional[OpenAIChatClient]:
    """The assistant LLM's client on the model-parallel group leaders (cooper mode, assistant
    negatives), after checking once that its endpoint answers and serves the model: a run whose
    assistant is not there would otherwise train with every pair masked (collective).

    Raises:
        ValueError: the endpoint did not answer on some leader (the message names the URL).
    """
    if not cfg.uses_assistant:
        return None
    client, problem = None, None
    if is_group_leader():
        client = OpenAIChatClient(cfg.rm.assistant_url, cfg.rm.assistant_model, api_key_env=cfg.rm.api_key_env,
                                  timeout_s=cfg.rm.assistant_timeout_s, max_retries=cfg.rm.assistant_max_retries)
        try:
            client.check_ready(hint="start the assistant server first (examples/launch_multinode.sh starts a "
                                    "colocated one) or point rm.assistant_url at one; rm.negatives=policy/rewrite/"
                                    "perturb need no server")
        except ValueError as e:
            problem = str(e)
    if any_rank(problem is not None):
        raise ValueError(problem or "the assistant endpoint check failed on another rank (see its log)")
    return client


def drop_too_long(prompts: list[Prompt], context: int, max_new_tokens: int, what: str) -> list[Prompt]:
    """``prompts`` without those whose templated tokens plus ``max_new_tokens`` exceed ``context``
    (the policy's ``max_position_embeddings``): their rollouts would run past what the policy was
    trained to attend to (an engine may refuse them). The count and the first ids are logged.

    Raises:
        ValueError: no room for any prompt, or none is short enough (naming the numbers).
    """
    limit = context - max_new_tokens
    if limit < 1:
        raise ValueError(f"{what}: max_new_tokens={max_new_tokens} leaves no room for a prompt in the policy's "
                         f"context of {context} tokens (max_position_embeddings): lower max_new_tokens")
    kept = [p for p in prompts if len(p.token_ids) <= limit]
    if len(kept) < len(prompts):
        long_ids = [p.id for p in prompts if len(p.token_ids) > limit]
        if not kept:
            raise ValueError(f"{what}: every one of the {len(prompts)} prompts is longer than {limit} tokens (the "
                             f"policy's context of {context} minus max_new_tokens={max_new_tokens}); first ids: "
                             f"{', '.join(long_ids[:5])}: shorten the prompts or lower max_new_tokens")
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("%s: skipping %d of %d prompts longer than %d tokens (the policy's context of %d minus "
                           "max_new_tokens=%d; counted in data/skipped_too_long); first ids: %s", what, len(long_ids),
                           len(prompts), limit, context, max_new_tokens, ", ".join(long_ids[:5]))
    return kept


def read_data(cfg: CooperConfig, tokenizer, context: int) -> tuple[PromptIterator, list[Prompt], int]:
    """This data-parallel rank's training prompt stream, the held-out prompts (templated; those
    too long for the policy's ``context`` left out, :func:`drop_too_long`) and how many training
    prompts were left out."""
    d = cfg.data
    prompts, skipped = read_prompts(d.train_path, question_key=d.question_key, answer_key=d.answer_key,
                                    skip_malformed=d.skip_malformed)
    template_prompts(prompts, d.template, tokenizer, d.use_chat_template, tokenize=True)
    n_read = len(prompts)
    prompts = drop_too_long(prompts, context, cfg.rollout.max_new_tokens, f"data.train_path {d.train_path}")
    data = PromptIterator(prompts, cfg.train.prompts_per_step, dp_rank=parallel_state.get_data_parallel_rank(),
                          dp_size=parallel_state.get_data_parallel_world_size(), seed=cfg.train.seed)
    eval_prompts: list[Prompt] = []
    if cfg.eval.every:
        eval_prompts, _ = read_prompts(d.eval_path, question_key=d.question_key, answer_key=d.answer_key,
                                       skip_malformed=d.skip_malformed)
        if d.eval_limit:
            eval_prompts = eval_prompts[:d.eval_limit]
        template_prompts(eval_prompts, d.template, tokenizer, d.use_chat_template, tokenize=True)
        eval_prompts = drop_too_long(eval_prompts, context, cfg.eval.max_new_tokens, f"data.eval_path {d.eval_path}")
    if dist.get_rank() == 0:
        logger.info("run: %d train prompts (%d skipped: %d malformed, %d too long), %d eval prompts, reward mode %s, "
                    "world %d", len(prompts), skipped + n_read - len(prompts), skipped, n_read - len(prompts),
                    len(eval_prompts), cfg.reward.mode.value, dist.get_world_size())
    return data, eval_prompts, n_read - len(prompts)


def build_eval_oracle(cfg: CooperConfig, eval_prompts: list[Prompt]) -> Optional[ArithmeticOracle]:
    """The checker of held-out accuracy other than the rule verifier (``eval.verifier``) on a
    model-parallel group leader; None for the rule verifier, without evaluation, or on other ranks.

    Raises:
        ValueError: ``arithmetic_oracle`` with a held-out gold answer that is no integer, bare or boxed (the
            oracle knows only the arithmetic task; checked on every rank, before any step).
    """
    if not cfg.eval.uses_oracle or not cfg.eval.every:
        return None
    for p in eval_prompts:
        if reference_value(p.answer) is None:
            raise ValueError(f"eval.verifier=arithmetic_oracle needs integer gold answers (bare or boxed), but "
                             f"held-out prompt {p.id!r} of {cfg.data.eval_path} has {p.answer!r}: use "
                             "eval.verifier=rule for other data")
    return ArithmeticOracle() if is_group_leader() else None


def build_models(cfg: CooperConfig, tokenizer) -> tuple[ModelState, Optional[ModelState]]:
    """The policy and (unless in rule mode) the reward model: loaded from their checkpoints, or with
    ``model.init: random`` built with random weights at their shapes
    (:func:`~cooper_mcore.config.model_shapes.random_init_shapes`). The RM reads with the tokenizer
    of its checkpoint when it has one, else the policy's."""
    mode, m = cfg.reward.mode, cfg.model
    policy_steps, rm_optim = cfg.train.steps * cfg.train.mini_batches, cfg.rm.optim if mode.trains_rm else None
    if m.random_init:
        policy_shape, rm_shape = random_init_shapes(m, mode.uses_rm)
        policy = random_model("policy", policy_shape, cfg, tokenizer, cfg.optim, policy_steps, cfg.train.seed)
        rm = (random_model("rm", rm_shape, cfg, tokenizer, rm_optim, cfg.train.steps, cfg.train.seed + 1)
              if rm_shape is not None else None)
        return policy, rm
    policy = load_model("policy", m.policy_ckpt, cfg, tokenizer, cfg.optim, policy_steps)
    if not mode.uses_rm:
        return policy, None
    has_tokenizer = os.path.isdir(os.path.join(m.rm_ckpt, EXTRA_DIR))
    rm_tokenizer = (load_checkpoint_tokenizer(m.rm_ckpt, trust_remote_code=m.trust_remote_code)
                    if has_tokenizer else tokenizer)
    return policy, load_model("rm", m.rm_ckpt, cfg, rm_tokenizer, rm_optim, cfg.train.steps)


def open_pipeline(run: Run, kept: int = 0, pending: Optional[list] = None) -> Optional[RolloutPipeline]:
    """With ``rollout.placement: disaggregated``, the rollout pipeline from the run's step on: the rollouts
    a checkpoint kept for its next ``kept`` steps (``pending``, the leader's) taken back, the current policy
    published, the first steps' prompts drawn (collective). None for a colocated run."""
    cfg = run.cfg
    if not cfg.rollout.disaggregated:
        return None
    engine = run.colocation.engine
    pipeline = RolloutPipeline(engine, run.verifier, run.data, cfg.rollout.max_staleness, cfg.rollout.group_size,
                               run.rollout_sampling, start=run.step, steps=cfg.train.steps,
                               bucket_bytes=cfg.rollout.bucket_mb * 2**20,
                               restart=(lambda: build_engine(cfg, run.policy)) if engine is not None else None,
                               max_restarts=cfg.rollout.engine_restarts)
    run.colocation.engine = None  # the pipeline owns it now: nothing else may drive it
    if kept:
        pipeline.restore(pending, kept)
    publish_policy(pipeline, run.policy, run.step)
    return pipeline


def start_world(cfg: CooperConfig) -> None:
    """Check the config, then initialise the distributed world (collective)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world)  # before anything is loaded or any process group is made
    init_distributed(cfg.parallel, seed=cfg.train.seed)
    if dist.get_world_size() != world:  # a launcher without WORLD_SIZE: check the real layout
        validate(cfg, dist.get_world_size())


def build_run(cfg: CooperConfig) -> Run:
    """Initialise the distributed world and build the run (collective)."""
    start_world(cfg)
    return assemble_run(cfg)


def assemble_run(cfg: CooperConfig) -> Run:
    """Build the run in the world :func:`start_world` made: models, engine, verifier, data (collective)."""
    tokenizer = load_tokenizer(cfg.model.policy_hf, trust_remote_code=cfg.model.trust_remote_code)
    policy, rm = build_models(cfg, tokenizer)
    if cfg.model.moe_routing_replay:  # the policy's routers only, never the reward model's
        enable_routing_replay(policy.module)
    reference = ReferenceSwap(policy.module) if cfg.algo.kl_coef else None

    assistant = connect_assistant(cfg)
    engine = verifier = None
    if is_group_leader():
        engine = build_engine(cfg, policy)
        verifier = RuleVerifier(timeout_s=cfg.reward.verifier_timeout_s, num_workers=cfg.reward.verifier_workers)
    # A GPU SGLang engine has the policy's TP size on the same GPUs: each TP rank feeds its own SGLang rank.
    per_tp_rank = cfg.rollout.uses_sglang and torch.cuda.is_available()
    colocation = Colocation(engine, policy, rm, cfg.offload, bucket_bytes=cfg.rollout.bucket_mb * 2**20,
                            per_tp_rank=per_tp_rank)
    data, eval_prompts, too_long = read_data(cfg, tokenizer, policy.arch.max_position_embeddings)
    if verifier is not None and dist.get_rank() == 0:  # before step 1: references the rule cannot read
        check_references(verifier, data.prompts, cfg.data.train_path)
    return Run(cfg=cfg, policy=policy, rm=rm, reference=reference, colocation=colocation, verifier=verifier,
               assistant=assistant, data=data, eval_prompts=eval_prompts, skipped_too_long=too_long,
               oracle=build_eval_oracle(cfg, eval_prompts))
