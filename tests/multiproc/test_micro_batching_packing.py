"""Sequence packing at TP=2 and PP=2 (gloo on CPU): packed rows equal the same sequences unpacked.

The worker (workers/micro_batching_packing.py) compares logits, per-token log-probabilities (vocab-parallel
cross entropy), reward-model scores and the gradients of a token-mean loss through megatron's
training schedule, with two packs of different widths (at PP=2 the stages exchange shapes).
fp32 throughout: only the order of fp32 additions differs between the two layouts (see
tests/unit/test_micro_batching_packing.py for the bound), so 1e-5 absolute on values of order 1, and 1e-5
relative to the largest gradient entry.

Sequence parallelism is not covered here: megatron-core's torch norms (no apex, no Transformer
Engine) refuse it, so it only runs on GPUs; ``multiple_of`` padding, which it needs, is tested
at TP=1.
"""

import pytest

from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_packed_equals_unpacked(tiny_models, layout):
    _, policy = tiny_models[("llama", "causal_lm")]
    _, rm = tiny_models[("qwen3", "reward")]
    out = last_json(torchrun("micro_batching_packing.py", 2, "--policy", policy, "--rm", rm, *layout))
    assert out["widths"] == [26, 20]  # two packs of different widths
    assert out["logits"] < 1e-5, out
    assert out["logprobs"] < 1e-5 and out["logprob_zeros_outside"], out
    assert out["scores"] < 1e-5 and out["score_scale"] > 1e-3, out
    assert out["grads"] < 1e-5 and out["grad_scale"] > 1e-3, out
