"""Runs with random weights built on the device (``model.init: random``): the models have exactly
their architecture's shapes, the transformers engine is built empty and refuses to generate until
the weight push fills it, and a whole run at a tiny shape completes steps with the engine holding
the policy's weights; nothing but prompts and a tokenizer is written."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from cooper_mcore.config.checks import config_problems
from cooper_mcore.config.model_shapes import random_init_shapes, reward_hf_config
from cooper_mcore.config.schema import CooperConfig, ModelConfig, load_config
from cooper_mcore.demo.assets import build_real_shape_assets
from cooper_mcore.metrics import PhaseTimer
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.parallel import ParallelConfig, owned_world, single_process_world
from cooper_mcore.planner.sizes import model_numel
from cooper_mcore.rl.setup import build_run, random_model
from cooper_mcore.rl.step import cooper_step
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.rollout.weight_sync import hf_named_tensors
from tests.conftest import ROOT

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256)


def _config_file(tmp_path, family: str = "qwen2_tied", **overrides) -> str:
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(tiny_hf_config(family, **{**SHAPE, **overrides}).to_dict()))
    return str(path)


@pytest.mark.parametrize("family", ["qwen2_tied", "qwen3"])
def test_random_models_have_exactly_their_architectures_shapes(tmp_path, family):
    cfg = CooperConfig(model=ModelConfig(init="random", policy_config=_config_file(tmp_path, family)))
    policy_shape, rm_shape = random_init_shapes(cfg.model, uses_rm=True)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**policy_shape.hf_config))
    with single_process_world():
        policy = random_model("policy", policy_shape, cfg, None, cfg.optim, 4, seed=0)
        again = random_model("policy", policy_shape, cfg, None, None, 4, seed=0)
        other = random_model("policy", policy_shape, cfg, None, None, 4, seed=1)
        rm = random_model("rm", rm_shape, cfg, None, None, 4, seed=1)
        reference = {n: p.shape for n, p in build_model(policy_shape.arch, ParallelConfig(),
                                                        init_weights=False).named_parameters()}
        rm_reference = {n: p.shape for n, p in build_model(rm_shape.arch, ParallelConfig(),
                                                           init_weights=False).named_parameters()}
    assert {n: p.shape for n, p in policy.module.named_parameters()} == reference
    assert {n: p.shape for n, p in rm.module.named_parameters()} == rm_reference
    numel = sum(p.numel() for p in policy.module.parameters())
    assert numel == model_numel(policy_shape.arch) == sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in rm.module.parameters()) == model_numel(rm_shape.arch)
    assert rm_shape.arch == ArchSpec.from_hf_config(reward_hf_config(policy_shape.hf_config), "reward")
    assert rm_shape.arch.hidden_size == policy_shape.arch.hidden_size and rm_shape.arch.model_type == "reward"
    assert policy.trains and policy.source_ckpt == "" and policy.hf_config == policy_shape.hf_config
    weights = dict(policy.module.named_parameters())
    qkv = next(p for n, p in weights.items() if n.endswith("linear_qkv.weight"))
    assert 0.01 < qkv.float().std().item() < 0.04  # megatron's init (std 0.02), not zeros or garbage
    same = dict(again.module.named_parameters())
    assert all(torch.equal(p, same[n]) for n, p in weights.items())  # seeded: every replica builds the same
    assert not torch.equal(qkv, dict(other.module.named_parameters())[next(n for n in weights
                                                                           if n.endswith("linear_qkv.weight"))])


def test_an_engine_built_from_a_config_refuses_to_generate_until_pushed(tiny_models):
    hf_dir, _ = tiny_models[("qwen2", "causal_lm")]
    loaded = HFEngine.from_pretrained(hf_dir)
    engine = HFEngine.from_config(json.loads(open(os.path.join(hf_dir, "config.json")).read()))
    assert sum(p.numel() for p in engine.model.parameters()) == sum(p.numel() for p in loaded.model.parameters())
    params = SamplingParams(max_new_tokens=5, temperature=0.0, seed=0)
    with pytest.raises(RuntimeError, match="not pushed again"):
        engine.generate([[1, 2, 3]], params)
    engine.update_weights([list(loaded.model.state_dict().items())], version=1)
    assert [o.token_ids for o in engine.generate([[1, 2, 3], [4]], params)] == \
        [o.token_ids for o in loaded.generate([[1, 2, 3], [4]], params)]


def _random_run_config(tmp_path) -> CooperConfig:
    paths = build_real_shape_assets(str(tmp_path / "assets"), SHAPE["vocab_size"], n_train=16, n_eval=4)
    return load_config(str(ROOT / "examples" / "tiny_cpu.yaml"), [
        f"out={tmp_path / 'run'}", "model.init=random", f"model.policy_config={_config_file(tmp_path)}",
        f"model.policy_hf={paths['tokenizer']}", f"data.train_path={paths['train']}",
        f"data.eval_path={paths['eval']}", "eval.every=0", "checkpoint.every=0", "logging.wandb=false",
        "rm.negatives=perturb", "train.prompts_per_step=2", "train.micro_batch_size=4", "rollout.max_new_tokens=8",
        "model.policy_ckpt=/nonexistent/policy", "model.rm_ckpt=/nonexistent/rm"])  # not read


def test_a_random_run_steps_and_its_engine_holds_the_policys_weights(tmp_path):
    cfg = _random_run_config(tmp_path)
    with owned_world():
        run = build_run(cfg)
        try:
            timer = PhaseTimer()
            for _ in range(2):
                result = cooper_step(run, run.data.next_batch(), timer)
                run.step += 1
                assert result.policy is not None and torch.isfinite(torch.tensor(result.policy.loss))
            assert result.rollouts.response_length > 6  # of 8: a random policy rarely samples the EOS token
            engine = run.colocation.engine
            with run.colocation.generating(version=run.step, timer=timer):  # the push of the updated policy
                pushed = {n: t.clone() for n, t in hf_named_tensors(run.policy.model, run.policy.arch,
                                                                     _tp_group(), _pp_group())}
                held = dict(engine.model.named_parameters())
                assert pushed.keys() == held.keys()
                assert all(torch.equal(held[n], t) for n, t in pushed.items())
        finally:
            run.close()
    written = sorted(os.listdir(tmp_path / "assets"))
    assert written == ["eval.jsonl", "tokenizer", f"tokenizer_v{SHAPE['vocab_size']}", "train.jsonl"]


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _pp_group():
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def test_config_checks_of_a_random_run(tmp_path):
    cfg = _random_run_config(tmp_path)
    assert config_problems(cfg, 1) == []  # the checkpoints named are not read
    cfg.rollout.engine = "sglang"
    assert any("model.init=random needs rollout.engine=hf" in p for p in config_problems(cfg, 1))
    cfg.rollout.engine = "hf"
    cfg.parallel.tp = 2  # 4 heads, 2 key/value heads and 512 entries split in two
    assert not any("not divisible" in p for p in config_problems(cfg, 2))
    cfg.parallel.tp = 3
    assert any("model.policy_config" in p and "not divisible by parallel.tp=3" in p for p in config_problems(cfg, 3))
    cfg.parallel.tp = 1
    cfg.model.policy_config = "no-such-model"
    assert any(p.startswith("model.policy_config='no-such-model': model config 'no-such-model' not found")
               for p in config_problems(cfg, 1))
    cfg.model.policy_config = ""  # the tokenizer folder has no config.json
    assert any("model.init=random needs the policy's shape: set model.policy_config" in p
               for p in config_problems(cfg, 1))
