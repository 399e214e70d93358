"""The Qwen3-MoE HF<->Megatron mapping against transformers' checkpoint names and a tiny megatron MoE model.

The megatron model is built here directly from megatron-core's local spec (the project's builder
refuses MoE until it has MoE layers), with the layer pattern and sizes the builder will use.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.hf_mapping import (
    ParamMapping,
    canonical_mcore_name,
    expert_linear,
    hf_shapes,
    is_expert_param,
    is_stacked_expert_param,
    mapping_tensors,
    moe_mappings,
    param_mappings,
    to_hf,
    to_mcore,
)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


def tiny_config(**overrides):
    """2 layers (layer 0 sparse, layer 1 dense: ``mlp_only_layers=[1]``), 4 experts, hidden 32."""
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
              mlp_only_layers=[1], decoder_sparse_step=1, max_position_embeddings=64)
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


def saved_tensors(model, tmp_path) -> dict[str, torch.Tensor]:
    """The tensors transformers writes to the safetensors files (what the converter reads)."""
    model.save_pretrained(tmp_path)
    out = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        with safetensors.safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("model_type", ["causal_lm", "reward"])
def test_mapping_covers_exactly_the_saved_checkpoint(model_type, tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config()
    if model_type == "reward":
        cfg.num_labels = 1
        model = transformers.Qwen3MoeForSequenceClassification(cfg)
    else:
        model = transformers.Qwen3MoeForCausalLM(cfg)
    cfg.architectures = [type(model).__name__]
    arch = ArchSpec.from_hf_config(cfg.to_dict())
    assert arch.model_type == model_type and arch.moe_layers() == [True, False]
    tensors = saved_tensors(model, tmp_path)
    shapes = hf_shapes(arch)
    assert set(shapes) == set(tensors)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in shapes
    assert "model.layers.1.mlp.gate_proj.weight" in shapes  # the dense layer


def test_mapping_covers_transformers_fused_state_dict():
    """transformers 5 holds each layer's experts fused (``gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I]); the per-expert names are exactly those tensors unrolled."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_config())
    arch = ArchSpec.from_hf_config({**tiny_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    state = model.state_dict()
    fused = {re.sub(r"experts\.\d+\.(gate|up)_proj\.weight$", "experts.gate_up_proj", n) for n in hf_shapes(arch)}
    fused = {re.sub(r"experts\.\d+\.down_proj\.weight$", "experts.down_proj", n) for n in fused}
    assert fused == set(state)
    gate_up, down = state["model.layers.0.mlp.experts.gate_up_proj"], state["model.layers.0.mlp.experts.down_proj"]
    assert gate_up.shape == (4, 32, 32) and down.shape == (4, 32, 16)


def build_tiny_mcore_moe(arch: ArchSpec):
    """A megatron-core GPTModel with MoE layers where ``arch`` has them (local spec, CPU)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cooper_mcore.models.norms import RMSNorm

    moe = arch.moe
    config = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim, normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, qk_layernorm=arch.qk_norm, use_cpu_initialization=True,
        num_moe_experts=moe.num_experts, moe_router_topk=moe.experts_per_token,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size, moe_layer_freq=[int(s) for s in arch.moe_layers()],
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.router_aux_loss_coef, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )
    specs = [get_gpt_layer_local_spec(num_experts=moe.num_experts if s else None, qk_layernorm=arch.qk_norm,
                                      normalization="RMSNorm") for s in arch.moe_layers()]
    return GPTModel(config=config, transformer_layer_spec=TransformerBlockSubmodules(layer_specs=specs,
                                                                                     layer_norm=RMSNorm),
                    vocab_size=arch.vocab_size, max_sequence_length=arch.max_position_embeddings,
                    position_embedding_type="rope", pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def test_mapping_covers_a_tiny_megatron_moe_model():
    from cooper_mcore.parallel import single_process_world

    arch = ArchSpec.from_hf_config({**tiny_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    with single_process_world():  # the experts' linears need the expert groups
        model = build_tiny_mcore_moe(arch)
        _check_names_shapes_and_one_expert(model, arch)


def _check_names_shapes_and_one_expert(model, arch: ArchSpec) -> None:
    params = {canonical_mcore_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    maps = param_mappings(arch)
    assert set(params) == {m.mcore for m in maps} and len(maps) == len(params)
    assert type(model.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    shapes = hf_shapes(arch)
    torch.manual_seed(0)
    for m in maps:
        hf = [torch.randn(shapes[n]) for n in m.hf]
        fused = to_mcore(m, hf, arch)
        assert fused.shape == params[m.mcore].shape, m.mcore
        assert all(torch.equal(a, b) for a, b in zip(to_hf(m, fused, arch), hf))

    # an expert filled through the mapping computes HF's expert: down(silu(gate x) * up x)
    gate, up, down = torch.randn(16, 32), torch.randn(16, 32), torch.randn(32, 16)
    expert = model.decoder.layers[0].mlp.experts.local_experts[2]
    fc1 = next(m for m in maps if m.mcore == "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight")
    with torch.no_grad():
        expert.linear_fc1.weight.copy_(to_mcore(fc1, [gate, up], arch))
        expert.linear_fc2.weight.copy_(down)
        x = torch.randn(5, 32)
        got, _ = expert(x, torch.ones(5))
    torch.testing.assert_close(got, F.linear(F.silu(x @ gate.T) * (x @ up.T), down))


def test_moe_mappings_names_by_hand():
    arch = ArchSpec.from_hf_config({**tiny_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    maps = moe_mappings(arch, 0)
    assert maps[0] == ParamMapping("decoder.layers.0.mlp.router.weight", ("model.layers.0.mlp.gate.weight",))
    assert maps[1] == ParamMapping("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
                                   ("model.layers.0.mlp.experts.0.gate_proj.weight",
                                    "model.layers.0.mlp.experts.0.up_proj.weight"), "gate_up")
    assert maps[-1] == ParamMapping("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
                                    ("model.layers.0.mlp.experts.3.down_proj.weight",))
    assert len(maps) == 1 + 2 * 4


def test_canonical_name_adds_the_expert_offset():
    name = "module.decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert canonical_mcore_name(name, layer_offset=2, expert_offset=4) == \
        "decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight"
    assert canonical_mcore_name("decoder.layers.0.mlp.router.weight", 0, 4) == "decoder.layers.0.mlp.router.weight"


def test_is_expert_param_picks_the_sequential_mlp_experts():
    """The weight sync gathers these over the expert groups instead of TP."""
    assert is_expert_param("module.decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight")
    assert is_expert_param("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight")
    for name in ("decoder.layers.0.mlp.router.weight", "decoder.layers.3.mlp.linear_fc1.weight",
                 "decoder.layers.0.pre_mlp_layernorm.weight", "embedding.word_embeddings.weight"):
        assert not is_expert_param(name), name


def test_dense_arch_has_no_moe_mappings():
    arch = ArchSpec.from_hf_config({**tiny_config().to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    arch.moe = None
    with pytest.raises(ValueError, match="has no experts"):
        moe_mappings(arch, 0)


def test_every_expert_layout_maps_to_sequential_names():
    """SequentialMLP's modules, GroupedExperts' stacked weights and TEGroupedMLP's per-expert ``weight{e}``
    name each expert's tensor the same way, with the expert-parallel rank's offset."""
    stacked = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2)
    got = mapping_tensors("module.decoder.layers.1.mlp.experts.linear_fc1.weight", stacked, layer_offset=2,
                          expert_offset=6)
    assert [n for n, _ in got] == [f"decoder.layers.3.mlp.experts.local_experts.{e}.linear_fc1.weight"
                                   for e in (6, 7, 8)]
    assert all(t.data_ptr() == stacked[i].data_ptr() and torch.equal(t, stacked[i]) for i, (_, t) in enumerate(got))
    te = "decoder.layers.0.mlp.experts.linear_fc2.weight5"
    assert canonical_mcore_name(te, expert_offset=8) == \
        "decoder.layers.0.mlp.experts.local_experts.13.linear_fc2.weight"
    one = stacked[0]
    [(name, t)] = mapping_tensors(te, one)
    assert name == "decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight" and t is one
    for name in ("decoder.layers.0.mlp.experts.linear_fc1.weight", te,
                 "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"):
        assert is_expert_param(name), name
    assert is_stacked_expert_param("decoder.layers.0.mlp.experts.linear_fc2.weight")
    assert not is_stacked_expert_param(te) and not is_stacked_expert_param("decoder.layers.0.mlp.linear_fc1.weight")
    assert not is_expert_param("decoder.layers.0.mlp.linear_fc1.weight")


def test_expert_gather_axis_is_the_layers_not_the_attribute():
    """fc1 (column-parallel) joins its ETP shards along rows, fc2 (row-parallel) along columns, whatever
    ``partition_dim`` a parameter carries (Transformer Engine marks 0 on both under ETP)."""
    from cooper_mcore.rollout.weight_sync import expert_split_dim

    assert expert_linear("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight") == "linear_fc1"
    assert expert_split_dim("decoder.layers.0.mlp.experts.linear_fc1.weight2") == 0
    assert expert_split_dim("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight") == 1
    with pytest.raises(ValueError, match="not an expert weight"):
        expert_linear("decoder.layers.0.mlp.linear_fc2.weight")
