"""The pure HF<->Megatron mapping: layouts checked against hand-built tensors."""

import pytest
import torch

from cooper_mcore.models.arch import ArchSpec, RopeSpec
from cooper_mcore.models.hf_mapping import (
    ParamMapping,
    canonical_mcore_name,
    hf_shapes,
    param_mappings,
    to_hf,
    to_mcore,
)


def arch(**kw) -> ArchSpec:
    base = dict(family="qwen2", model_type="causal_lm", num_layers=2, hidden_size=4,
                ffn_hidden_size=6, num_attention_heads=4, num_query_groups=2, head_dim=1,
                vocab_size=10, max_position_embeddings=32, rms_norm_eps=1e-6,
                tie_word_embeddings=False, qkv_bias=True, qk_norm=False, rope=RopeSpec())
    base.update(kw)
    return ArchSpec(**base)


def test_qkv_interleaves_query_groups_by_hand():
    a = arch()  # 4 heads, 2 groups, head_dim 1: rows q0 q1 | q2 q3, k0 | k1, v0 | v1
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    m = ParamMapping("x", ("q", "k", "v"), "qkv")
    fused = to_mcore(m, [q, k, v], a)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = to_hf(m, fused, a)
    assert all(torch.equal(x, y) for x, y in zip(back, [q, k, v]))


def test_qkv_bias_and_head_dim_2():
    a = arch(num_attention_heads=2, num_query_groups=1, head_dim=2, hidden_size=4)
    q, k, v = torch.arange(4.0), torch.arange(10.0, 12.0), torch.arange(20.0, 22.0)
    fused = to_mcore(ParamMapping("b", ("q", "k", "v"), "qkv"), [q, k, v], a)
    assert fused.tolist() == [0, 1, 2, 3, 10, 11, 20, 21]


def test_gate_up_concatenates_gate_first():
    a = arch()
    gate, up = torch.zeros(6, 4), torch.ones(6, 4)
    m = ParamMapping("fc1", ("g", "u"), "gate_up")
    fused = to_mcore(m, [gate, up], a)
    assert fused.shape == (12, 4) and fused[:6].eq(0).all() and fused[6:].eq(1).all()
    g2, u2 = to_hf(m, fused, a)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


@pytest.mark.parametrize("kw,has_bias,has_qknorm,has_head", [
    (dict(), True, False, "lm_head.weight"),
    (dict(tie_word_embeddings=True), True, False, None),
    (dict(family="qwen3", qkv_bias=False, qk_norm=True), False, True, "lm_head.weight"),
    (dict(model_type="reward", tie_word_embeddings=True), True, False, "score.weight"),
])
def test_param_table(kw, has_bias, has_qknorm, has_head):
    a = arch(**kw)
    maps = param_mappings(a)
    hf = {n for m in maps for n in m.hf}
    assert ("model.layers.1.self_attn.q_proj.bias" in hf) == has_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in hf) == has_qknorm
    heads = {"lm_head.weight", "score.weight"} & hf
    assert heads == ({has_head} if has_head else set())
    assert len({m.mcore for m in maps}) == len(maps)
    shapes = hf_shapes(a)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (2, 4)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4, 6)


def test_random_roundtrip_is_exact():
    a = arch(num_attention_heads=8, num_query_groups=2, head_dim=3, hidden_size=8)
    for m in param_mappings(a):
        shapes = hf_shapes(a)
        hf = [torch.randn(shapes[n]) for n in m.hf]
        back = to_hf(m, to_mcore(m, hf, a), a)
        assert all(torch.equal(x, y) for x, y in zip(hf, back)), m


def test_canonical_names():
    assert canonical_mcore_name("module.module.decoder.layers.1.mlp.linear_fc2.weight", 4) == \
        "decoder.layers.5.mlp.linear_fc2.weight"
    assert canonical_mcore_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.0.input_layernorm.weight"
    assert canonical_mcore_name("decoder.layers.2.mlp.linear_fc1.layer_norm_weight", 2) == \
        "decoder.layers.4.pre_mlp_layernorm.weight"
    assert canonical_mcore_name("embedding.word_embeddings.weight", 3) == "embedding.word_embeddings.weight"
