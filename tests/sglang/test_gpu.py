"""SGLang 0.5.23 on a GPU through ``SGLangEngine``: what the CPU tier cannot run. Marked ``gpu``
(not ``sglang``): skipped without CUDA, and not selected by ``make test-sglang``; run them with
``pytest -m gpu tests/sglang`` where sglang and its CUDA kernels are installed.

The reference is transformers' forward of the same fp32 weights on the same GPU (tolerance 1e-4:
different attention kernels in fp32; TF32 is off in both by default).
"""

from __future__ import annotations

import pytest
import torch

from cooper_mcore.rollout.base import SamplingParams, bucketize
from cooper_mcore.rollout.sglang_engine import SGLangConfig, SGLangEngine
from tests.sglang.conftest import free_port

pytestmark = pytest.mark.gpu
TOL = 1e-4
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def hf_model(assets, name):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(assets.hf[name], dtype=torch.float32).cuda().eval()


def hf_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0].tolist()


def assert_matches(model, outs):
    for out, prompt in zip(outs, PROMPTS):
        ref = hf_logprobs(model, prompt, out.token_ids)
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref)) < TOL


def gpu_config(assets, name, **kw):
    return SGLangConfig(model_path=assets.hf[name], tokenizer_path=assets.tokenizer, dtype="float32",
                        mem_fraction_static=0.3, max_total_tokens=8192, port=free_port(), **kw)


def perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).cuda() * 0.05)
    return [(n, t.detach()) for n, t in model.state_dict().items()]


def test_release_resume_and_cuda_ipc_update(assets):
    """Release frees device memory; weights resumed without a backup are refilled over CUDA IPC
    (update_weights), then the KV cache; the engine then samples from the new weights."""
    model = hf_model(assets, "tied")
    engine = SGLangEngine.offline(gpu_config(assets, "tied"))
    try:
        sp = SamplingParams(max_new_tokens=8, temperature=0.0)
        assert_matches(model, engine.generate(PROMPTS, sp))
        free_before = torch.cuda.mem_get_info()[0]
        engine.release_memory()
        assert torch.cuda.mem_get_info()[0] > free_before  # the KV pool at least went back to the driver
        engine.resume_memory(["weights"])
        named = perturbed(model, seed=1)
        engine.update_weights(bucketize(named, 64 * 1024), version=1)  # CUDA tensors: IPC handles
        engine.resume_memory()
        assert engine.weight_version == 1
        assert_matches(model, engine.generate(PROMPTS, sp))
    finally:
        engine.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_engine_takes_one_payload_per_rank(assets):
    model = hf_model(assets, "untied")
    engine = SGLangEngine.offline(gpu_config(assets, "untied", tp_size=2))
    try:
        named = perturbed(model, seed=2)
        engine.update_weights(bucketize(named, 64 * 1024), version=2)
        assert_matches(model, engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0)))
    finally:
        engine.shutdown()
