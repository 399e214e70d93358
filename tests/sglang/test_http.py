"""An SGLang 0.5.23 HTTP server (``python -m sglang.launch_server``, CPU backend) through
``SGLangEngine``: generation against the Megatron policy, the weight sync from Megatron with the
weight version at TP=1 (in this process) and TP=2 (torchrun, gloo), a payload made by another
trainer rank, a dead server and a restarted one. Tolerance ``TOL``: see ``test_offline.py``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time

import pytest
import torch
from megatron.core import parallel_state

from cooper_mcore.rollout.base import EngineLost, SamplingParams, bucketize
from cooper_mcore.rollout.sglang_engine import SGLangEngine
from cooper_mcore.rollout.sglang_http import SGLangHTTPClient
from cooper_mcore.rollout.weight_group import WeightGroupSpec
from cooper_mcore.rollout.weight_sync import hf_named_tensors, sync_weights
from tests.conftest import last_json
from tests.sglang.conftest import free_port, megatron_logprobs, megatron_step_max, torchrun_sglang

pytestmark = pytest.mark.sglang
logger = logging.getLogger(__name__)
TOL = 5e-5
PROMPTS = ["3+8=", "Compute 6*7. ", "10-4="]


@pytest.fixture(scope="module")
def tokenizer(assets):
    from cooper_mcore.data.tokenizer import load_tokenizer

    return load_tokenizer(assets.tokenizer)


@pytest.fixture(scope="module")
def policy(megatron_world, assets):
    """The untied model as a Megatron policy (TP=PP=1)."""
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.parallel import ParallelConfig

    return load_checkpoint_model(assets.mcore["untied"], ParallelConfig())


def raw_generate(url: str, ids: list[list[int]], max_new_tokens: int = 8) -> list[dict]:
    """SGLang's own /generate answer (meta_info included), greedy."""
    client = SGLangHTTPClient(url)
    try:
        return client.request("POST", "/generate", "generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            "return_logprob": True}, idempotent=True)
    finally:
        client.close()


def assert_matches(model, outs, ids, greedy=True):
    worst = 0.0
    for out, prompt in zip(outs, ids):
        ref = megatron_logprobs(model, prompt, out.token_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(out.logprobs, ref)))
        assert worst < TOL, (out.logprobs, ref)
        if greedy:
            assert all(r >= m - TOL for r, m in zip(ref, megatron_step_max(model, prompt, out.token_ids)))
    logger.info("max |SGLang - Megatron| logprob difference: %.2e", worst)


def test_http_generate_matches_megatron(server, policy, tokenizer, assets):
    model, arch = policy
    assert not arch.tie_word_embeddings
    eng = server.engine
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0))
    for o in outs:
        assert o.text == tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.finish_reason in ("stop", "length") and all(0 <= t < assets.vocab_size for t in o.token_ids)
    assert_matches(model, outs, ids)
    sampled = eng.generate(ids, SamplingParams(max_new_tokens=10, temperature=0.8))
    assert_matches(model, sampled, ids, greedy=False)
    info = eng._client.request("GET", "/server_info", "server_info", idempotent=True)
    assert info["version"] == "0.5.23" and info["tp_size"] == 1


def test_http_weight_sync_with_version(server, policy, tokenizer):
    model, arch = policy
    eng = server.engine
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = dict(model.named_parameters())
    original = {n: p.detach().clone() for n, p in params.items()}
    gen = torch.Generator().manual_seed(4)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    try:
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            params["output_layer.weight"].mul_(3.0)  # untied: the LM head travels on its own
        stats = sync_weights(model, arch, eng, version=5, bucket_bytes=16 * 1024)
        assert stats["buckets"] > 2 and eng.weight_version == 5
        assert_matches(model, eng.generate(ids, sp), ids)
        assert {o["meta_info"]["weight_version"] for o in raw_generate(server.url, ids)} == {"5"}
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(original[n])
        sync_weights(model, arch, eng, version=6)
    assert_matches(model, eng.generate(ids, sp), ids)
    eng.flush_cache()


def test_weights_over_a_gloo_group_as_to_an_engine_apart(server, policy, tokenizer):
    """SGLang's own init_weights_update_group / update_weights_from_distributed with this process as the
    trainer's rank 0 (gloo, the weight group of docs/async.md): the policy's perturbed weights, in several
    buckets, reach the server with their version; after the group is left, pushes share tensors again."""
    model, arch = policy
    eng = server.engine
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = dict(model.named_parameters())
    original = {n: p.detach().clone() for n, p in params.items()}
    gen = torch.Generator().manual_seed(7)
    sp = SamplingParams(max_new_tokens=8, temperature=0.0)
    eng.init_weights_update_group(WeightGroupSpec("127.0.0.1", free_port(), world_size=2, backend="gloo",
                                                  timeout_s=120))
    try:
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        named = list(hf_named_tensors(model, arch, parallel_state.get_tensor_model_parallel_group(),
                                      parallel_state.get_pipeline_model_parallel_group()))
        eng.update_weights(bucketize(named, 16 * 1024), version=7)
        assert eng.weight_version == 7
        assert_matches(model, eng.generate(ids, sp), ids)
        assert {o["meta_info"]["weight_version"] for o in raw_generate(server.url, ids)} == {"7"}
    finally:
        eng.destroy_weights_update_group()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(original[n])
        sync_weights(model, arch, eng, version=8)  # shared tensors again
    assert_matches(model, eng.generate(ids, sp), ids)
    eng.flush_cache()


def test_weight_sync_tp2_and_a_payload_from_another_rank(server, assets, tokenizer):
    """torchrun, 2 ranks (gloo): the policy at TP=2 pushes into the server through rank 0, then
    rank 1 makes a payload that rank 0 hands to SGLang (gather_rank_payloads)."""
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    out = last_json(torchrun_sglang("sync_tp2.py", 2, "--ckpt", assets.mcore["untied"], "--url", server.url,
                                    "--prompts", json.dumps(ids)))
    assert out["tp2_sync"]["version"] == 9 and out["tp2_sync"]["meta_version"] == ["9"] * len(ids)
    assert out["tp2_sync"]["buckets"] > 2
    assert out["tp2_sync"]["max_diff"] < TOL and out["tp2_sync"]["greedy_ok"]
    assert out["tp2_sync"]["stale_diff"] > 100 * TOL
    assert out["from_rank1"]["max_diff"] < TOL and out["from_rank1"]["version"] == 10
    assert out["from_rank1"]["stale_diff"] > 100 * TOL


def test_dead_server_is_a_clear_bounded_error():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=re.escape(url) + r".*server_info.*3 attempt"):
        SGLangEngine.connect(url, device="cpu", max_retries=2, backoff_s=0.1, connect_timeout_s=1)
    assert time.monotonic() - t0 < 10


def test_killed_then_restarted_server(server, policy, tokenizer):
    """A connected engine reports a killed server by its URL without hanging, the engine that launched it
    as lost (:class:`EngineLost`, its pid and exit code), and works again once the server is back at the
    same address (with the checkpoint's weights)."""
    model, _ = policy
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    eng = SGLangEngine.connect(server.url, device="cpu", max_retries=1, backoff_s=0.1, connect_timeout_s=2)
    assert eng.tp_size == 1
    os.killpg(server.engine._process.pid, signal.SIGKILL)
    server.engine._process.wait(timeout=60)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=re.escape(server.url) + r".*generate \(POST /generate\)"):
        eng.generate(ids, SamplingParams(max_new_tokens=4))
    with pytest.raises(ConnectionError, match=re.escape(server.url) + ".*flush_cache"):
        eng.flush_cache()
    assert time.monotonic() - t0 < 15
    # the launched engine knows its server's process: a lost engine, which a disaggregated run starts again
    pid = server.engine._process.pid
    with pytest.raises(EngineLost, match=rf"\(pid {pid}\) exited with code -9 during generate"):
        server.engine.generate(ids, SamplingParams(max_new_tokens=4))
    assert time.monotonic() - t0 < 30
    server.restart()
    outs = eng.generate(ids, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert_matches(model, outs, ids)
    eng.shutdown()  # a connected engine leaves the server running
    assert server.engine.generate(["1+2="], SamplingParams(max_new_tokens=2))[0].token_ids
