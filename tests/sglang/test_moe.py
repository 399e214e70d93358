"""A tiny Qwen3-MoE on SGLang 0.5.23's CPU backend: generation log-probabilities equal transformers',
and after a weight sync from a Megatron policy (EP=1) they equal that policy's.

Routed-experts capture (``return_routed_experts``, for rollout routing replay) does not start on
SGLang's own CPU backend: SGLang 0.5.23's ``RoutedExpertsCapturer`` allocates its host buffer through
``ALLOC_MEMORY_FUNCS[device]``, which has no ``"cpu"`` entry and falls back to ``cudaHostRegister``;
the scheduler dies with "Found no NVIDIA driver" and SGLang SIGKILLs the whole process tree.
``SGLangConfig.validate`` therefore refuses it on CPU (checked here). This tier's ``sgl_kernel``
stand-in gives the capturer a plain host buffer instead of a pinned one (all it changes), and the
``moe`` engine is started past the refusal, so the rest of SGLang's capture and our decoding and
replay of it run for real.

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
from cooper_mcore.rollout.sglang_engine import SGLangConfig, SGLangEngine, _child_pids
from cooper_mcore.rollout.weight_sync import sync_weights
from tests.sglang.conftest import free_port, megatron_logprobs

pytestmark = pytest.mark.sglang
TOL = 5e-5
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def moe(assets, megatron_world, tmp_path_factory):
    """(engine serving one tiny Qwen3-MoE, its HF folder, a Megatron policy with other weights, its arch,
    the HF folder of those weights). The engine captures routed experts."""
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
    config = SGLangConfig.cpu(served, tokenizer_path=assets.tokenizer, random_seed=0, port=free_port(),
                              max_total_tokens=4096, max_running_requests=4, enable_return_routed_experts=True)
    with pytest.MonkeyPatch.context() as mp:  # past the CPU refusal: the stand-in provides the host buffer
        mp.setattr(SGLangConfig, "validate", lambda self: None)
        engine = SGLangEngine.offline(config)
    yield engine, served, model, arch, other
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
    engine, served, model, arch, _ = moe
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    outs = engine.generate(PROMPTS, params)
    assert max_diff(outs, lambda p, c: transformers_logprobs(served, p, c)) < TOL
    assert max_diff(outs, lambda p, c: megatron_logprobs(model, p, c)) > 1e-3  # the policy's weights differ
    stats = sync_weights(model, arch, engine, version=4, bucket_bytes=16 * 1024)
    assert stats["buckets"] > 2 and engine.weight_version == 4
    outs = engine.generate(PROMPTS, params)
    assert max_diff(outs, lambda p, c: megatron_logprobs(model, p, c)) < TOL


def transformers_routes(hf_dir: str, tokens: list[int]) -> torch.Tensor:
    """Each sparse layer's top-k experts ``[len(tokens), layers, k]`` in one transformers forward."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    seen = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.stack([seen[i] for i in range(len(model.model.layers))], dim=1)


def test_moe_routed_experts_refused_on_cpu(tmp_path):
    """The CPU engine with routed-experts capture is refused before SGLang starts (no child process),
    naming the way out."""
    before = _child_pids()
    with pytest.raises(ValueError, match="enable_return_routed_experts needs device='cuda'"):
        SGLangEngine.offline(SGLangConfig.cpu(str(tmp_path), port=free_port(), enable_return_routed_experts=True))
    assert _child_pids() <= before


def test_moe_routed_experts_are_replayed_by_the_policy(moe):
    """SGLang's routes cover the prompt and every output token but the last, one row of layers x top-k
    per position, and are transformers' routers' top-k (fp32 on both sides: no near-tie flips in these
    few tokens); the Megatron policy with the same weights, replaying them, gives SGLang's log-probs."""
    from cooper_mcore.micro_batching.runner import MicroBatching
    from cooper_mcore.models.routing_replay import enable_routing_replay, replaying, route_batch
    from cooper_mcore.train.tokens import build_token_batch, compute_logprobs

    engine, _, model, arch, other = moe
    sync_weights(model, arch, engine, version=5, bucket_bytes=16 * 1024)  # the policy's weights, whatever ran before
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, routed_experts=True))
    k = arch.moe.experts_per_token
    for out, prompt in zip(outs, PROMPTS):
        assert out.routed_experts.shape == (len(prompt) + len(out.token_ids) - 1, arch.num_layers * k)
        want = transformers_routes(other, prompt + out.token_ids[:-1]).sort(-1).values
        got = out.routed_experts.reshape(-1, arch.num_layers, k).sort(-1).values
        assert torch.equal(got, want.to(got.dtype))
    batch = build_token_batch(PROMPTS, [o.token_ids for o in outs], pad_id=0)
    enable_routing_replay(model)
    with replaying(model, route_batch([o.routed_experts for o in outs], batch.input_ids.shape[1], arch.num_layers,
                                      k)):
        logp = compute_logprobs(model, batch, MicroBatching(2))
    for i, (out, prompt) in enumerate(zip(outs, PROMPTS)):
        got = logp[i, len(prompt) - 1:len(prompt) - 1 + len(out.token_ids)]
        assert float((got - torch.tensor(out.logprobs)).abs().max()) < TOL
