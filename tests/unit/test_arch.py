"""Reading HF configs into ArchSpec, and the rotary frequencies against transformers."""

import importlib

import pytest
import torch

from cooper_mcore.models.arch import ArchSpec, rope_inv_freq
from cooper_mcore.models.tiny import tiny_hf_config


@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied", "llama", "qwen3"])
def test_inv_freq_matches_transformers(family):
    cfg = tiny_hf_config(family)
    arch = ArchSpec.from_hf_config(cfg.to_dict())
    module = importlib.import_module(f"transformers.models.{arch.family}.modeling_{arch.family}")
    prefix = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}[arch.family]
    ref = getattr(module, f"{prefix}RotaryEmbedding")(config=cfg).inv_freq
    assert arch.rope.rope_type == cfg.rope_parameters["rope_type"]
    torch.testing.assert_close(rope_inv_freq(arch.rope, arch.head_dim), ref.float(), rtol=0, atol=0)


def test_llama3_scaling_changes_low_frequencies():
    arch = ArchSpec.from_hf_config(tiny_hf_config("llama").to_dict())
    plain = ArchSpec.from_hf_config(tiny_hf_config("llama", rope_scaling=None).to_dict())
    a, b = rope_inv_freq(arch.rope, arch.head_dim), rope_inv_freq(plain.rope, plain.head_dim)
    assert torch.equal(a[0], b[0]) and a[-1] < b[-1]


def test_reads_transformers4_spelling():
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
           "vocab_size": 100, "rope_theta": 500000.0, "tie_word_embeddings": True,
           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    a = ArchSpec.from_hf_config(cfg)
    got = (a.family, a.model_type, a.head_dim, a.rope.theta, a.rope.factor)
    assert got == ("llama", "causal_lm", 16, 500000.0, 32.0)
    assert not a.qkv_bias and not a.qk_norm and a.tie_word_embeddings


def test_families_and_reward():
    q2 = ArchSpec.from_hf_config(tiny_hf_config("qwen2").to_dict())
    q3 = ArchSpec.from_hf_config(tiny_hf_config("qwen3").to_dict())
    rm = ArchSpec.from_hf_config(tiny_hf_config("qwen2", "reward").to_dict())
    assert q2.qkv_bias and not q2.qk_norm
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32
    assert rm.model_type == "reward" and rm.hf_architecture() == "Qwen2ForSequenceClassification"
    assert ArchSpec.from_dict(rm.to_dict()) == rm


@pytest.mark.parametrize("cfg,msg", [
    ({"architectures": ["MistralForCausalLM"]}, "unknown architecture 'MistralForCausalLM'"),
    ({"model_type": "gpt2"}, "unknown model_type 'gpt2'"),
])
def test_unknown_architecture_is_named(cfg, msg):
    with pytest.raises(ValueError, match=msg):
        ArchSpec.from_hf_config(cfg)


def test_unsupported_rope_type():
    cfg = tiny_hf_config("qwen2").to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ArchSpec.from_hf_config(cfg)
