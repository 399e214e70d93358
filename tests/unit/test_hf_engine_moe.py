"""The transformers engine with a Qwen3-MoE policy: weights pushed under the per-expert names the
weight sync sends (those of the safetensors files) fill transformers 5's fused expert tensors, and a
fused tensor pushed only in part stays stale after a release."""

import pytest
import torch
import transformers

from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.rollout.base import SamplingParams, bucketize
from cooper_mcore.rollout.hf_engine import HFEngine


def _per_expert(model) -> list[tuple[str, torch.Tensor]]:
    """The model's tensors under their safetensors (per-expert) names."""
    out = []
    for name, p in model.named_parameters():
        if name.endswith(".experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out += [(f"{prefix}{e}.gate_proj.weight", p[e, :half].clone()),
                        (f"{prefix}{e}.up_proj.weight", p[e, half:].clone())]
        elif name.endswith(".experts.down_proj"):
            out += [(f"{name[: -len('down_proj')]}{e}.down_proj.weight", p[e].clone()) for e in range(p.shape[0])]
        else:
            out.append((name, p.detach().clone()))
    return out


def _models():
    cfg = tiny_hf_config("qwen3_moe", eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    torch.manual_seed(1)
    return source, transformers.AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
def test_per_expert_push_fills_the_fused_experts_after_a_release():
    source, other = _models()
    engine = HFEngine(other)
    engine.release_memory()
    engine.resume_memory()
    engine.update_weights(bucketize(_per_expert(source), bucket_bytes=20_000), version=1)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(engine.model(ids).logits, source(ids).logits)
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0))


@torch.no_grad()
def test_a_part_pushed_fused_tensor_stays_stale():
    source, other = _models()
    engine = HFEngine(other)
    engine.release_memory()
    engine.resume_memory()
    engine.update_weights([[t for t in _per_expert(source) if ".experts.7." not in t[0]]], version=1)
    with pytest.raises(RuntimeError, match=r"experts\.(gate_up|down)_proj"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0))
