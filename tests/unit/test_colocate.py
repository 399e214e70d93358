"""The colocation of the training state and the rollout engine around each generation.

SGLang releases its weights without a copy: after a resume they hold whatever the memory held until
a weight push refills them. The transformers engine models that (released weights are lost, NaN
after a resume, and generating from them is an error), so a CPU test fails on the old order (push,
then release at the end of the step, then resume and generate) and passes on the new one.
"""

from __future__ import annotations

import pytest
import torch

from cooper_mcore.config.schema import CooperConfig, OffloadConfig
from cooper_mcore.metrics import PhaseTimer
from cooper_mcore.parallel import single_process_world
from cooper_mcore.rl.colocate import Colocation
from cooper_mcore.rl.setup import load_model
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.rollout.weight_sync import sync_weights

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, seed=0)
PROMPTS = [[1, 2, 3], [4, 5]]


class Recording:
    """An engine wrapper that records the calls the trainer makes, in order."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        attr = getattr(self.engine, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            tags = args[0] if args and name.endswith("_memory") else None
            self.calls.append(name if tags is None else f"{name}{sorted(tags)}")
            if name == "update_weights":
                args = (list(args[0]), *args[1:])
            return attr(*args, **kwargs)

        return call


@pytest.fixture
def policy(tiny_models):
    hf_dir, ckpt = tiny_models[("qwen2", "causal_lm")]
    cfg = CooperConfig()
    with single_process_world():
        yield hf_dir, load_model("policy", ckpt, cfg, tokenizer=None, optim=cfg.optim, schedule_steps=4)


def test_each_generation_resumes_pushes_and_releases_in_order(policy):
    hf_dir, model = policy
    engine = Recording(HFEngine.from_pretrained(hf_dir))
    expected = HFEngine.from_pretrained(hf_dir).generate(PROMPTS, PARAMS)  # the same weights, never released
    offload = OffloadConfig(policy_params=True, policy_grads=True, policy_optimizer=True, release_engine=True)
    colo = Colocation(engine, model, None, offload, bucket_bytes=2**20)
    timer = PhaseTimer()
    for _ in range(2):  # the second generation of the same version pushes again: the release lost them
        with colo.generating(version=0, timer=timer) as e:
            assert [o.token_ids for o in e.generate(PROMPTS, PARAMS)] == [o.token_ids for o in expected]
            assert model.offloader.offloaded == frozenset({"params", "grads", "optimizer"})
        assert model.offloader.offloaded == frozenset()
    one = ["resume_memory['weights']", "update_weights", "resume_memory['cuda_graph', 'kv_cache']", "generate",
           "release_memory"]
    assert [c for c in engine.calls if c != "flush_cache"] == one + one
    assert model.offloader.discard_grads  # gradients are freed and zeroed, never copied to the host
    assert set(timer.pop()) >= {"time/offload", "time/weight_sync"}


def test_engine_that_keeps_its_memory_is_pushed_only_new_versions(policy):
    hf_dir, model = policy
    engine = Recording(HFEngine.from_pretrained(hf_dir))
    colo = Colocation(engine, model, None, OffloadConfig(release_engine=False), bucket_bytes=2**20)
    for version in (0, 0, 1):
        with colo.generating(version=version, timer=PhaseTimer()) as e:
            e.generate(PROMPTS, PARAMS)
    assert engine.calls == ["update_weights", "generate", "generate", "update_weights", "generate"]


def test_the_old_order_samples_from_released_weights(policy):
    """Push, release at the end of the step, resume at the next rollout, generate: refused."""
    hf_dir, model = policy
    engine = HFEngine.from_pretrained(hf_dir)
    engine.resume_memory()
    sync_weights(model.model, model.arch, engine, version=1)
    engine.release_memory()
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="released without a CPU backup and not pushed again"):
        engine.generate(PROMPTS, PARAMS)
    assert torch.isnan(engine.model.model.embed_tokens.weight).all()  # what SGLang would sample from


@pytest.mark.parametrize("release", [True, False])
def test_every_rank_of_a_group_pushes_at_the_same_generations(policy, monkeypatch, release):
    """The push is collective over the model-parallel group, so the leader (which holds the
    engine) and a rank without one must enter it at the same generations: after an evaluation the
    next rollout reuses the version, and a leader that alone pushed again would wait in the push
    while the others wait in the rollout's broadcast (the hang of every TP/PP > 1 run that evaluated)."""
    hf_dir, model = policy
    pushes: dict[str, list[int]] = {"leader": [], "other": []}

    def recorder(rank):
        return lambda *args, **kwargs: pushes[rank].append(args[3])  # sync_weights(model, arch, engine, version)

    offload = OffloadConfig(release_engine=release)
    leader = Colocation(HFEngine.from_pretrained(hf_dir), model, None, offload, bucket_bytes=2**20)
    other = Colocation(None, model, None, offload, bucket_bytes=2**20)
    for colo, rank in ((leader, "leader"), (other, "other")):
        monkeypatch.setattr("cooper_mcore.rl.colocate.sync_weights", recorder(rank))
        for version in (0, 1, 1, 2, 2):  # step 1's rollout, then evaluation and step 2's rollout, ...
            with colo.generating(version=version, timer=PhaseTimer()):
                pass
    assert pushes["leader"] == pushes["other"]
    assert pushes["other"] == ([0, 1, 1, 2, 2] if release else [0, 1, 2])
