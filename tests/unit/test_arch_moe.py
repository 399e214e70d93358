"""Mixture-of-experts configs (Qwen3-MoE) read into ArchSpec, and refused where only dense models work."""

from __future__ import annotations

import json

import pytest

from cooper_mcore.models.arch import ArchSpec, MoeSpec, sparse_layers
from cooper_mcore.models.tiny import tiny_hf_config

TINY_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=64, hidden_size=32,
    intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01, rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, tie_word_embeddings=False,
)


def moe_config(**overrides) -> dict:
    cfg = dict(TINY_MOE)
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("layers,step,dense,expected", [
    (4, 1, (), [True, True, True, True]),
    (4, 2, (), [False, True, False, True]),
    (6, 3, (), [False, False, True, False, False, True]),
    (4, 1, (0, 3), [False, True, True, False]),
    (4, 2, (1,), [False, False, False, True]),
    (3, 5, (), [False, False, False]),
])
def test_sparse_layer_pattern_by_hand(layers, step, dense, expected):
    assert sparse_layers(layers, step, dense) == expected


def test_sparse_step_below_one_is_refused():
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        sparse_layers(4, 0)


def test_reads_qwen3_moe_config():
    a = ArchSpec.from_hf_config(moe_config(mlp_only_layers=[3, 0], decoder_sparse_step=1))
    assert (a.family, a.model_type, a.qk_norm, a.qkv_bias) == ("qwen3_moe", "causal_lm", True, False)
    assert a.ffn_hidden_size == 48 and a.head_dim == 8 and a.rope.theta == 1e6
    assert a.moe == MoeSpec(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=16, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=(0, 3), router_aux_loss_coef=0.01)
    assert a.moe_layers() == [False, True, True, False]
    assert a.hf_architecture() == "Qwen3MoeForCausalLM"
    assert ArchSpec.from_dict(json.loads(json.dumps(a.to_dict()))) == a


def test_reward_variant_has_the_same_backbone():
    rm = ArchSpec.from_hf_config(moe_config(architectures=["Qwen3MoeForSequenceClassification"], num_labels=1))
    lm = ArchSpec.from_hf_config(moe_config())
    assert rm.model_type == "reward" and rm.moe == lm.moe
    assert rm.hf_architecture() == "Qwen3MoeForSequenceClassification"
    assert ArchSpec.from_hf_config(moe_config(), "reward").moe == lm.moe  # an RM made from the causal LM


def test_reads_transformers_saved_config():
    """transformers writes ``num_local_experts`` (its alias of ``num_experts``) to config.json."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], decoder_sparse_step=1,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    a = ArchSpec.from_hf_config(cfg.to_dict())
    assert a.moe.num_experts == 4 and a.moe_layers() == [True, False]
    assert a.moe.norm_topk_prob is False and a.moe.router_aux_loss_coef == 0.001


@pytest.mark.parametrize("change,key", [
    (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    (dict(n_shared_experts=1), "n_shared_experts"),
    (dict(num_experts=None), "num_experts"),
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=4, num_local_experts=8), "num_local_experts"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers"),
    (dict(mlp_only_layers="0"), "mlp_only_layers"),
    (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
])
def test_unrepresentable_config_names_the_key(change, key):
    cfg = moe_config(**change)
    if change.get("num_experts", 1) is None:
        del cfg["num_experts"]
    if change.get("moe_intermediate_size", 1) is None:
        del cfg["moe_intermediate_size"]
    with pytest.raises(ValueError, match=repr(key)):
        ArchSpec.from_hf_config(cfg)


def test_dense_architectures_keep_their_record():
    for family in ("qwen2", "qwen2_tied", "llama", "qwen3"):
        a = ArchSpec.from_hf_config(tiny_hf_config(family).to_dict())
        assert a.moe is None and "moe" not in a.to_dict() and not any(a.moe_layers())
        assert ArchSpec.from_dict(a.to_dict()) == a
        a.require_dense("anything")  # no error


def test_planner_takes_moe():
    """The planner counts experts now (hand-computed figures in tests/unit/test_plan_moe.py)."""
    from cooper_mcore.planner.sizes import check_layout, model_numel

    a = ArchSpec.from_hf_config(moe_config())
    check_layout(a, 1, 1)
    assert model_numel(a) > 0


def test_tiny_moe_fields_shape_only_the_moe_family():
    """One set of overrides shapes a rehearsal's MoE policy and its dense RM: the dense one ignores them."""
    from cooper_mcore.models.tiny import tiny_hf_config

    moe = tiny_hf_config("qwen3_moe", mlp_only_layers=[], num_hidden_layers=2)
    assert moe.mlp_only_layers == [] and ArchSpec.from_hf_config(moe.to_dict()).moe_layers() == [True, True]
    assert tiny_hf_config("qwen3_moe", num_hidden_layers=2).mlp_only_layers == [1]
    dense = tiny_hf_config("qwen3", "reward", mlp_only_layers=[], num_experts=8)
    assert "mlp_only_layers" not in dense.to_dict() and "num_experts" not in dense.to_dict()
