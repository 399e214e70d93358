"""The transformers engine in a process of its own: the same completions as in-process, weights
pushed over a gloo weight group, and a child that dies reported in one error, never a hang."""

import time

import pytest
import torch
import transformers

from cooper_mcore.models.tiny import save_tiny_hf_model
from cooper_mcore.rollout.base import SamplingParams, bucketize
from cooper_mcore.rollout.engine_process import EngineLost, EngineProcess, EngineSpec
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.rollout.weight_group import TensorSpec, specs_of


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_process")
    return (save_tiny_hf_model(str(root / "a"), "qwen2", seed=0, eos_token_id=1, pad_token_id=0),
            save_tiny_hf_model(str(root / "b"), "qwen2", seed=1, eos_token_id=1, pad_token_id=0))


@pytest.fixture(scope="module")
def engine(hf_dirs):
    e = EngineProcess(EngineSpec(hf_dirs[0], threads=1))
    yield e
    e.shutdown()


PROMPTS = [[5, 6, 7, 8], [20, 21], [30, 31, 32, 33, 34]]


def test_same_completions_and_logprobs_as_in_process(engine, hf_dirs):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=7)
    local = HFEngine.from_pretrained(hf_dirs[0]).generate(PROMPTS, params)
    remote = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in remote] == [o.token_ids for o in local]
    for r, lo in zip(remote, local):  # the same kernels on the same machine: equal up to thread count
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(lo.logprobs), atol=1e-5)


def test_weights_pushed_over_the_group_replace_the_model(engine, hf_dirs):
    other = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs[1])
    named = [(n, p.detach().clone()) for n, p in other.named_parameters()]
    engine.update_weights(bucketize(named, bucket_bytes=2**14), version=3)  # several buckets
    assert engine.weight_version == 3
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    want = HFEngine.from_pretrained(hf_dirs[1]).generate(PROMPTS, greedy)
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == [o.token_ids for o in want]


def test_a_failed_request_names_the_cause_and_the_engine_goes_on(engine):
    with pytest.raises(RuntimeError, match="has no parameter 'nope'"):
        engine.update_weights([[("nope", torch.zeros(2))]], version=9)
    assert len(engine.generate([[5, 6]], SamplingParams(max_new_tokens=2, temperature=0))) == 1


def test_a_killed_engine_is_one_clear_error_not_a_hang(hf_dirs):
    e = EngineProcess(EngineSpec(hf_dirs[0], threads=1))
    try:
        e.kill()
        t0 = time.monotonic()
        with pytest.raises(EngineLost, match=rf"pid {e.pid}\) exited with code -9 during generate"):
            e.generate(PROMPTS, SamplingParams(max_new_tokens=4))
        assert time.monotonic() - t0 < 5
    finally:
        e.shutdown()


def test_specs_name_every_tensor_and_refuse_other_dtypes():
    assert specs_of([("w", torch.zeros(2, 3, dtype=torch.bfloat16))]) == [TensorSpec("w", "bfloat16", (2, 3))]
    with pytest.raises(ValueError, match="'i' has dtype torch.int64"):
        specs_of([("i", torch.zeros(2, dtype=torch.long))])
