"""Qwen3-MoE HF -> Megatron -> HF conversion: exact round trips, per-layer and stacked checkpoint keys.

megatron-core writes a model whose layers all look alike (dense, or all sparse) with one stored
tensor per parameter and a leading layer axis, and a model mixing dense and sparse layers with
per-layer keys; ``SequentialMLP`` experts are stored with an expert axis. Both are exported here.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from cooper_mcore.convert import hf as hf_module
from cooper_mcore.convert.hf import CkptKey, _ckpt_key, _export_order, hf_to_mcore, mcore_to_hf, per_layer_keys
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.models.tiny import save_tiny_hf_model

EXPERT_FC1 = "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"


def test_ckpt_key_stacked_and_per_layer():
    assert _ckpt_key("embedding.word_embeddings.weight") == CkptKey("embedding.word_embeddings.weight")
    assert _ckpt_key("decoder.layers.3.input_layernorm.weight") == CkptKey(
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)
    assert _ckpt_key("decoder.layers.3.input_layernorm.weight", per_layer=True) == CkptKey(
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
    assert _ckpt_key(EXPERT_FC1) == CkptKey("decoder.layers.mlp.experts.experts.linear_fc1.weight", 2, 5)
    assert _ckpt_key(EXPERT_FC1, per_layer=True) == CkptKey(
        "decoder.layers.2.mlp.experts.experts.linear_fc1.weight", None, 5)
    assert _ckpt_key("decoder.layers.2.mlp.router.weight", per_layer=True) == CkptKey(
        "decoder.layers.2.mlp.router.weight")


def test_export_order_reads_each_expert_unit_once(tmp_path):
    """Mixed layers are per-layer keys; in both layouts each stored expert weight (per layer) is one
    contiguous run of mappings, experts in order, so the streamer reads it once."""
    for overrides, per_layer in (({}, True), ({"mlp_only_layers": []}, False)):
        hf = save_tiny_hf_model(str(tmp_path / str(per_layer)), "qwen3_moe", **overrides)
        arch = ArchSpec.from_hf_config(load_hf_config(hf))
        assert per_layer_keys(arch) is per_layer
        units = [(ck.key, ck.layer) for _, ck in _export_order(arch) if ck.expert is not None]
        runs = [u for i, u in enumerate(units) if i == 0 or units[i - 1] != u]
        assert len(runs) == len(set(runs)) == 2 * sum(arch.moe_layers())
        experts = [ck.expert for _, ck in _export_order(arch) if ck.expert is not None]
        assert experts[:arch.moe.num_experts] == list(range(arch.moe.num_experts))


def _hf_tensors(d: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(d, "model.safetensors"))


@pytest.mark.parametrize("model_type", ["causal_lm", "reward"])
@pytest.mark.parametrize("pattern", ["mixed", "all_sparse"])
def test_moe_roundtrip_bitwise(tmp_path, monkeypatch, model_type, pattern):
    overrides = {"mlp_only_layers": []} if pattern == "all_sparse" else {}
    hf = save_tiny_hf_model(str(tmp_path / "hf"), "qwen3_moe", model_type, dtype=torch.bfloat16, **overrides)
    arch = hf_to_mcore(hf, str(tmp_path / "mc"))
    assert arch.moe_layers() == ([True] * 4 if pattern == "all_sparse" else [True, True, True, False])
    reads, load_unit = [], hf_module._load_unit

    def recording(*args):
        value = load_unit(*args)
        reads.append((args[-1], tuple(value.shape)))
        return value

    monkeypatch.setattr(hf_module, "_load_unit", recording)
    mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), weights_only=True)
    expert_reads = [shape for ck, shape in reads if ck.expert is not None]
    assert len(expert_reads) == 2 * sum(arch.moe_layers()), "each expert weight of each layer read once"
    assert {s[0] for s in expert_reads} == {8}, expert_reads  # one layer's experts, never all layers'
    a, b = _hf_tensors(hf), _hf_tensors(str(tmp_path / "back"))
    assert sorted(a) == sorted(b)
    assert [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))] == []
    orig = json.load(open(os.path.join(hf, "config.json")))
    back = json.load(open(tmp_path / "back" / "config.json"))
    added = {"num_labels"} if model_type == "reward" else set()  # the export names the head's size
    assert set(back) == set(orig) | added and {k: v for k, v in orig.items() if back[k] != v} == {}
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))  # as SGLang reads it
    assert cfg.num_experts == 8 and cfg.num_experts_per_tok == 2 and cfg.mlp_only_layers == orig["mlp_only_layers"]
