"""The offline ``sglang.Engine`` (SGLang 0.5.23, CPU backend) through ``SGLangEngine``: generation
against the Megatron policy's own log-probabilities, stop strings, the prefix cache, the weight
sync from Megatron at TP=1 (tied embeddings), CPU memory release semantics, and the trainer's
logging surviving the engine's construction.

Tolerance: SGLang and Megatron both run the tiny model in fp32 with different kernels (SGLang's
torch_native attention and its own RMSNorm/rotary code), so their log-probabilities differ by
accumulated fp32 rounding: about 1e-6 per op for dot products of length <= 96, over 4 layers and
an 80-way log-softmax, about 1e-6 (measured: at most 8.8e-7 with ATEN_CPU_CAPABILITY=default and
1.1e-6 with avx2; this machine has no AVX-512). ``TOL = 5e-5`` leaves margin for other CPUs; a
wrong weight mapping, a broken tie or stale weights move them by 1e-2 or more.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.sglang_engine import SGLangEngine, preserve_root_logging
from cooper_mcore.rollout.weight_sync import sync_weights
from tests.sglang.conftest import cpu_config, megatron_logprobs, megatron_step_max

pytestmark = pytest.mark.sglang
logger = logging.getLogger(__name__)
TOL = 5e-5
PROMPTS = ["12+7=", "What is 3*4? ", "9-5="]


@pytest.fixture(scope="module")
def tokenizer(assets):
    from cooper_mcore.data.tokenizer import load_tokenizer

    return load_tokenizer(assets.tokenizer)


@pytest.fixture(scope="module")
def policy(megatron_world, assets):
    """The tied model as a Megatron policy (TP=PP=1)."""
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.parallel import ParallelConfig

    return load_checkpoint_model(assets.mcore["tied"], ParallelConfig())


def check_against_megatron(model, tokenizer, outs, prompt_ids, greedy: bool) -> float:
    """Assert SGLang's logprobs equal Megatron's (and greedy picks Megatron's argmax); return the max diff."""
    worst = 0.0
    for out, ids in zip(outs, prompt_ids):
        assert out.token_ids and len(out.logprobs) == len(out.token_ids)
        ref = megatron_logprobs(model, ids, out.token_ids)
        diff = max(abs(a - b) for a, b in zip(out.logprobs, ref))
        assert diff < TOL, (diff, out.logprobs, ref)
        worst = max(worst, diff)
        if greedy:
            best = megatron_step_max(model, ids, out.token_ids)
            assert all(r >= m - TOL for r, m in zip(ref, best)), "SGLang's greedy token is not Megatron's argmax"
    logger.info("max |SGLang - Megatron| logprob difference: %.2e", worst)
    return worst


def test_generate_matches_megatron(offline, policy, tokenizer, assets):
    model, _ = policy
    eng = offline.engine
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert [o.finish_reason for o in outs] == ["length" if len(o.token_ids) == 12 else "stop" for o in outs]
    for o in outs:
        assert all(0 <= t < assets.vocab_size for t in o.token_ids)
        assert o.text == tokenizer.decode(o.token_ids, skip_special_tokens=True)
    check_against_megatron(model, tokenizer, outs, ids, greedy=True)
    by_ids = eng.generate(ids, SamplingParams(max_new_tokens=12, temperature=0.0))  # token-id prompts
    assert [o.token_ids for o in by_ids] == [o.token_ids for o in outs]


def test_sampled_logprobs_are_the_untempered_policys(offline, policy, tokenizer):
    """raw_logprobs: at temperature 0.7 the logprobs are still those of the temperature-1 policy."""
    model, _ = policy
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    outs = offline.engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.7))
    check_against_megatron(model, tokenizer, outs, ids, greedy=False)


def test_two_samples_of_a_prompt_differ(offline):
    outs = offline.engine.generate(["1+1="] * 4, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_stop_strings(offline, tokenizer):
    eng = offline.engine
    greedy = eng.generate(["4*4="], SamplingParams(max_new_tokens=16, temperature=0.0))[0]
    text = greedy.text
    assert len(text) >= 4, text
    cut = len(tokenizer.decode(greedy.token_ids[:3], skip_special_tokens=True))
    stop = text[cut:cut + 2]
    first = text.index(stop)  # the stop string may occur earlier than where it was taken
    out = eng.generate(["4*4="], SamplingParams(max_new_tokens=16, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[:first]
    n = len(out.token_ids)  # tokens up to the one that completes the stop string, as sampled
    assert out.token_ids == greedy.token_ids[:n]
    assert stop in tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert stop not in tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)


def test_flush_cache_drops_the_prefix_cache(offline):
    raw = offline.engine._engine  # sglang.Engine: cached_tokens is in its meta_info
    prompt = "123+456=" * 4
    sp = {"max_new_tokens": 1, "temperature": 0.0}
    raw.generate(prompt=prompt, sampling_params=sp)
    assert raw.generate(prompt=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] > 0
    offline.engine.flush_cache()
    assert raw.generate(prompt=prompt, sampling_params=sp)["meta_info"]["cached_tokens"] == 0


def test_weight_sync_tp1_tied(offline, policy, tokenizer):
    """sync_weights from a perturbed Megatron policy (tied embeddings): SGLang's logprobs are the
    new policy's; then the original weights go back."""
    model, arch = policy
    assert arch.tie_word_embeddings
    eng = offline.engine
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = dict(model.named_parameters())
    original = {n: p.detach().clone() for n, p in params.items()}
    gen = torch.Generator().manual_seed(3)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = eng.generate(ids, sp)
    try:
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            params["embedding.word_embeddings.weight"].mul_(3.0)  # the tied LM head must follow
        stats = sync_weights(model, arch, eng, version=3, bucket_bytes=16 * 1024)
        assert stats["buckets"] > 2 and eng.weight_version == 3
        after = eng.generate(ids, sp)
        check_against_megatron(model, tokenizer, after, ids, greedy=True)
        stale = max(abs(a - b) for o, i in zip(before, ids)
                    for a, b in zip(o.logprobs, megatron_logprobs(model, i, o.token_ids)))
        assert stale > 100 * TOL  # the old engine weights would have failed the check
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(original[n])
        sync_weights(model, arch, eng, version=4)
    again = eng.generate(ids, sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in before]
    check_against_megatron(model, tokenizer, again, ids, greedy=True)


def test_cpu_release_only_marks(offline):
    """SGLang's CPU backend cannot release memory: the engine sends nothing, but still refuses to
    generate until the tags are resumed."""
    eng = offline.engine
    eng.release_memory()
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.generate(["1+1="], SamplingParams(max_new_tokens=2))
    eng.resume_memory(["weights"])
    eng.resume_memory()
    assert eng.generate(["1+1="], SamplingParams(max_new_tokens=2))[0].token_ids


def test_trainer_logging_survives_the_engine(offline):
    root = logging.getLogger()
    assert offline.root_after == offline.root_before and offline.root_before[1] == logging.INFO
    assert offline.handler in root.handlers and root.level == logging.INFO
    logging.getLogger("cooper_mcore.rl.test").info("after the engine %d", 1)
    logging.getLogger("cooper_mcore.rl.test").warning("a warning")
    got = [r.getMessage() for r in offline.handler.records]
    assert "after the engine 1" in got and "a warning" in got
    # the control: SGLang's logger set-up, as sglang.Engine runs it, does remove the handler
    from sglang.srt.utils.common import configure_logger

    with preserve_root_logging():
        configure_logger(types.SimpleNamespace(log_level="error"))
        assert offline.handler not in root.handlers and root.level == logging.ERROR
    assert offline.handler in root.handlers and root.level == logging.INFO


def test_seeded_sampling_needs_deterministic_inference_which_cpu_lacks(assets):
    """SGLang 0.5.23 honours per-request sampling seeds only with enable_deterministic_inference,
    whose attention backends do not include the CPU's torch_native: refused up front."""
    from sglang.srt.arg_groups.choices import DETERMINISTIC_ATTENTION_BACKEND_CHOICES

    assert "torch_native" not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
    with pytest.raises(ValueError, match="enable_deterministic_inference.*torch_native"):
        SGLangEngine.offline(cpu_config(assets, "tied", enable_deterministic_inference=True))
