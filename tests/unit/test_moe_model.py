"""A tiny Qwen3-MoE built by the project's builder and converter computes transformers' outputs (TP=PP=EP=1).

The references are ``transformers.Qwen3MoeForCausalLM`` / ``Qwen3MoeForSequenceClassification`` built
from a config with random weights: one sparse and one dense layer, both top-k normalisations.
"""

from __future__ import annotations

import pytest
import torch

from cooper_mcore.convert.compare import compare_logits, logits_diff
from cooper_mcore.convert.hf import hf_to_mcore, load_hf_weights
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.models.builder import build_model, moe_config
from cooper_mcore.parallel import ParallelConfig, single_process_world

transformers = pytest.importorskip("transformers")

# fp32 on CPU: both sides run the same ops in another order; 1e-5 is ~100 ulps of logits of size ~1
TOL = 1e-5


def tiny_moe_config(**overrides):
    """2 layers (layer 0 sparse, layer 1 dense), 4 experts, top-2, hidden 32."""
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
              mlp_only_layers=[1], decoder_sparse_step=1, max_position_embeddings=64, pad_token_id=0)
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def save_tiny(tmp_path, cls=None, seed=0, **overrides) -> str:
    torch.manual_seed(seed)
    model = (cls or transformers.Qwen3MoeForCausalLM)(tiny_moe_config(**overrides)).eval()
    path = str(tmp_path / "hf")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_built_moe_logits_equal_transformers(tmp_path, norm_topk_prob):
    hf = save_tiny(tmp_path, norm_topk_prob=norm_topk_prob)
    arch = ArchSpec.from_hf_config(load_hf_config(hf))
    assert arch.moe_layers() == [True, False]
    with single_process_world():
        model = build_model(arch, ParallelConfig(), init_weights=False, use_te=False)
        load_hf_weights(model, hf, arch)
        assert logits_diff(model, arch, hf) < TOL


def test_moe_reward_model_scores_equal_transformers(tmp_path):
    hf = save_tiny(tmp_path, cls=transformers.Qwen3MoeForSequenceClassification, num_labels=1)
    arch = ArchSpec.from_hf_config(load_hf_config(hf))
    assert arch.model_type == "reward" and arch.moe is not None
    with single_process_world():
        model = build_model(arch, ParallelConfig(), init_weights=False, use_te=False)
        load_hf_weights(model, hf, arch)
        assert logits_diff(model, arch, hf) < TOL


def test_all_sparse_layers_convert_and_load(tmp_path):
    hf = save_tiny(tmp_path, mlp_only_layers=[])
    arch = hf_to_mcore(hf, str(tmp_path / "mcore"))
    assert arch.moe_layers() == [True, True]
    with single_process_world():
        assert compare_logits(hf, str(tmp_path / "mcore"), ParallelConfig()) < TOL


def test_moe_config_maps_the_routing():
    arch = ArchSpec.from_hf_config({**tiny_moe_config(norm_topk_prob=True, router_aux_loss_coef=0.01).to_dict(),
                                    "architectures": ["Qwen3MoeForCausalLM"]})
    kw = moe_config(arch, ParallelConfig(ep=2))
    assert kw["moe_layer_freq"] == [1, 0] and kw["moe_router_pre_softmax"] is False
    assert kw["num_moe_experts"] == 4 and kw["moe_router_topk"] == 2 and kw["moe_ffn_hidden_size"] == 16
    assert kw["moe_aux_loss_coeff"] == 0.01 and kw["moe_router_dtype"] == "fp32"
    assert kw["expert_model_parallel_size"] == 2


def test_expert_layouts_are_checked():
    moe = ArchSpec.from_hf_config({**tiny_moe_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by parallel.ep=3"):
        moe_config(moe, ParallelConfig(ep=3))
    dense = ArchSpec.from_hf_config({**transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8).to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    assert moe_config(dense, ParallelConfig()) == {}
    with pytest.raises(ValueError, match=r"parallel.ep=2 .* need a mixture-of-experts model"):
        moe_config(dense, ParallelConfig(ep=2))
    with pytest.raises(ValueError, match=r"expert layout etp\*ep\*pp = 1\*4\*1"):
        ParallelConfig(ep=4).validate(2)
