"""A tiny Qwen3-MoE on SGLang 0.5.23's CPU backend: generation log-probabilities equal transformers',
and after a weight sync from a Megatron policy (EP=1) they equal that policy's.

Every layer is sparse here: SGLang 0.5.23's ``Qwen3MoeDecoderLayer.stage_facts`` declares every
Qwen3-MoE layer sparse, ignoring ``mlp_only_layers`` and ``decoder_sparse_step``, so a model with
dense layers (the tiny family's default, last layer dense) is served with a wrong MLP in those layers
(measured: log-probabilities 1e-2 away from transformers', against 3e-7 with every layer sparse).
Qwen3-30B-A3B and Qwen3-235B-A22B have every layer sparse.

Tolerance: as ``test_offline.py`` (fp32 on both sides, different kernels; measured 2.6e-7).
"""

from __future__ import annotations

import pytest
import torch

from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.sglang_engine import SGLangConfig, SGLangEngine
from cooper_mcore.rollout.weight_sync import sync_weights
from tests.sglang.conftest import free_port, megatron_logprobs

pytestmark = pytest.mark.sglang
TOL = 5e-5
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def moe(assets, megatron_world, tmp_path_factory):
    """(engine serving one tiny Qwen3-MoE, its HF folder, a Megatron policy with other weights, its arch)."""
    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.parallel import ParallelConfig

    root = tmp_path_factory.mktemp("sglang-moe")
    kw = dict(dtype=torch.float32, vocab_size=assets.vocab_size, eos_token_id=assets.eos_id, bos_token_id=1,
              pad_token_id=0, max_position_embeddings=4096, mlp_only_layers=[])
    served = save_tiny_hf_model(str(root / "served"), "qwen3_moe", seed=20, **kw)
    other = save_tiny_hf_model(str(root / "other"), "qwen3_moe", seed=21, **kw)
    hf_to_mcore(other, str(root / "other-mcore"))
    model, arch = load_checkpoint_model(str(root / "other-mcore"), ParallelConfig())
    engine = SGLangEngine.offline(SGLangConfig.cpu(served, tokenizer_path=assets.tokenizer, random_seed=0,
                                                   port=free_port(), max_total_tokens=4096, max_running_requests=4))
    yield engine, served, model, arch
    engine.shutdown()


def transformers_logprobs(hf_dir: str, prompt: list[int], completion: list[int]) -> list[float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def max_diff(outs, reference) -> float:
    worst = 0.0
    for out, prompt in zip(outs, PROMPTS):
        assert out.token_ids and len(out.logprobs) == len(out.token_ids)
        worst = max(worst, *(abs(a - b) for a, b in zip(out.logprobs, reference(prompt, out.token_ids))))
    return worst


def test_moe_served_then_synced_from_megatron(moe):
    engine, served, model, arch = moe
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    outs = engine.generate(PROMPTS, params)
    assert max_diff(outs, lambda p, c: transformers_logprobs(served, p, c)) < TOL
    assert max_diff(outs, lambda p, c: megatron_logprobs(model, p, c)) > 1e-3  # the policy's weights differ
    stats = sync_weights(model, arch, engine, version=4, bucket_bytes=16 * 1024)
    assert stats["buckets"] > 2 and engine.weight_version == 4
    outs = engine.generate(PROMPTS, params)
    assert max_diff(outs, lambda p, c: megatron_logprobs(model, p, c)) < TOL
