"""Build everything a Cooper run needs from its config: distributed state, the policy and its
frozen reference, the reward model, optimizers and schedules, the rollout engine, the rule
verifier, the negatives' client and the data. Validation happens before any heavy work.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from cooper_mcore.config import CooperConfig, validate
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.train.cooper import Run

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def eval_params(cfg: CooperConfig) -> SamplingParams:
    """Sampling for held-out evaluation (temperature 0.7, top-p 0.95 by default, as the paper)."""
    return SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature,
                          top_p=cfg.eval.top_p, stop=list(cfg.rollout.stop), seed=cfg.train.seed)


def _tokenizer(path: str, trust_remote_code: bool = False):
    from cooper_mcore.data.tokenizer import load_tokenizer

    return load_tokenizer(path, trust_remote_code=trust_remote_code)


def build_run(cfg: CooperConfig) -> Run:
    """Initialise the distributed world and build the run (collective)."""
    from megatron.core import parallel_state as ps

    from cooper_mcore.convert.checkpoint import EXTRA_DIR, read_meta
    from cooper_mcore.convert.compare import load_checkpoint_model
    from cooper_mcore.data.datasets import read_prompts
    from cooper_mcore.data.iterator import PromptIterator
    from cooper_mcore.data.templates import template_prompts
    from cooper_mcore.parallel import init_distributed
    from cooper_mcore.train import stages
    from cooper_mcore.train.megatron_setup import OptimConfig, build_scheduler, wrap_for_training
    from cooper_mcore.train.offload import ModelOffloader, ReferenceSwap
    from cooper_mcore.train.reward_model import load_rm_tokenizer, wrap_reward_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate(cfg, world)  # before anything is loaded or any process group is made
    init_distributed(cfg.parallel, seed=cfg.train.seed)
    if dist.get_world_size() != world:  # a launcher without WORLD_SIZE: check the real layout
        validate(cfg, dist.get_world_size())
    dtype = _DTYPES[cfg.model.dtype]
    steps = cfg.train.steps * cfg.train.mini_batches

    policy, policy_arch = load_checkpoint_model(cfg.model.policy_ckpt, cfg.parallel)
    if policy.config.params_dtype != dtype:
        raise ValueError(f"model.dtype={cfg.model.dtype} but {cfg.model.policy_ckpt} holds "
                         f"{policy.config.params_dtype}; convert the checkpoint in the dtype you train in")
    reference = ReferenceSwap(policy) if cfg.algo.kl_coef else None
    o = cfg.optim
    policy_ddp, policy_opt = wrap_for_training(
        policy, OptimConfig(lr=o.lr, weight_decay=o.weight_decay, clip_grad=o.clip_grad), per_token_loss=True)
    policy_sched = build_scheduler(policy_opt, o.lr, o.warmup_steps, steps, o.weight_decay)
    tokenizer = _tokenizer(cfg.model.policy_hf, cfg.model.trust_remote_code)
    archs = {"policy": read_meta(cfg.model.policy_ckpt)}

    rm = rm_opt = rm_sched = rm_arch = rm_tok = None
    if cfg.reward.mode != "rule":
        rm, rm_arch = load_checkpoint_model(cfg.model.rm_ckpt, cfg.parallel)
        extra = os.path.join(cfg.model.rm_ckpt, EXTRA_DIR)
        rm_tok = (load_rm_tokenizer(cfg.model.rm_ckpt, trust_remote_code=cfg.model.trust_remote_code)
                  if os.path.isdir(extra) else tokenizer)
        if cfg.reward.mode == "cooper":
            r = cfg.rm.optim
            rm, rm_opt = wrap_reward_model(rm, OptimConfig(lr=r.lr, weight_decay=r.weight_decay, clip_grad=r.clip_grad))
            rm_sched = build_scheduler(rm_opt, r.lr, r.warmup_steps, cfg.train.steps, r.weight_decay)
            archs["rm"] = read_meta(cfg.model.rm_ckpt)

    engine = verifier = client = None
    if stages.is_group_leader():
        from cooper_mcore.reward.verifier import RuleVerifier

        engine = _build_engine(cfg)
        verifier = RuleVerifier(timeout_s=cfg.reward.verifier_timeout_s, num_workers=cfg.reward.verifier_workers)
        if cfg.reward.mode == "cooper" and cfg.rm.negatives == "assistant":
            from cooper_mcore.reward.openai_client import OpenAIChatClient

            client = OpenAIChatClient(cfg.rm.assistant_url, cfg.rm.assistant_model, api_key_env=cfg.rm.api_key_env,
                                      timeout_s=cfg.rm.assistant_timeout_s, max_retries=cfg.rm.assistant_max_retries)

    d = cfg.data
    prompts, skipped = read_prompts(d.train_path, question_key=d.question_key, answer_key=d.answer_key,
                                    skip_malformed=d.skip_malformed)
    template_prompts(prompts, d.template, tokenizer, d.use_chat_template, tokenize=True)
    data = PromptIterator(prompts, cfg.train.prompts_per_step, dp_rank=ps.get_data_parallel_rank(),
                          dp_size=ps.get_data_parallel_world_size(), seed=cfg.train.seed)
    eval_prompts = []
    if cfg.eval.every:
        eval_prompts, _ = read_prompts(d.eval_path, question_key=d.question_key, answer_key=d.answer_key,
                                       skip_malformed=d.skip_malformed)
        if d.eval_limit:
            eval_prompts = eval_prompts[:d.eval_limit]
        template_prompts(eval_prompts, d.template, tokenizer, d.use_chat_template, tokenize=True)
    if dist.get_rank() == 0:
        logger.info("run: %d train prompts (%d skipped), %d eval prompts, reward mode %s, world %d",
                    len(prompts), skipped, len(eval_prompts), cfg.reward.mode, world)
    offloaders = {"policy": ModelOffloader(policy_ddp, policy_opt)}
    if rm_opt is not None:
        offloaders["rm"] = ModelOffloader(rm, rm_opt)
    elif rm is not None:
        offloaders["rm"] = ModelOffloader(rm)
    return Run(cfg=cfg, policy=policy_ddp, policy_opt=policy_opt, policy_sched=policy_sched,
               policy_arch=policy_arch, tokenizer=tokenizer, reference=reference, rm=rm, rm_opt=rm_opt,
               rm_sched=rm_sched, rm_arch=rm_arch, rm_tokenizer=rm_tok, engine=engine, verifier=verifier,
               negatives_client=client, data=data, eval_prompts=eval_prompts,
               extra={"archs": archs, "offloaders": offloaders})


def _build_engine(cfg: CooperConfig):
    if cfg.rollout.engine == "sglang":
        from cooper_mcore.rollout.sglang_engine import SGLangConfig, SGLangEngine

        # One engine per model-parallel group, on this group leader's GPU and the next tp-1 (its TP
        # group's GPUs on this node); without base_gpu_id every engine of a node would start on GPU 0.
        return SGLangEngine.offline(SGLangConfig(model_path=cfg.model.policy_hf, tp_size=cfg.parallel.tp,
                                                 dtype=cfg.model.dtype,
                                                 mem_fraction_static=cfg.rollout.sglang_mem_fraction,
                                                 base_gpu_id=torch.cuda.current_device(),
                                                 trust_remote_code=cfg.model.trust_remote_code))
    from cooper_mcore.rollout.hf_engine import HFEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFEngine.from_pretrained(cfg.model.policy_hf, dtype=_DTYPES[cfg.model.dtype], device=device,
                                    trust_remote_code=cfg.model.trust_remote_code)
