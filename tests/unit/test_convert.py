"""HF -> Megatron -> HF conversion in one process: exact round trips, and clear errors."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cooper_mcore.checkpoint.model import load_model_checkpoint, read_meta
from cooper_mcore.cli import main as cli_main
from cooper_mcore.convert.hf import hf_to_mcore, mcore_to_hf
from cooper_mcore.models.tiny import save_tiny_hf_model, save_tiny_tokenizer
from tests.conftest import VARIANTS


def _hf_tensors(d):
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
        else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(d, f)))
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_roundtrip_bitwise(tiny_models, tmp_path, variant):
    hf_dir, ckpt = tiny_models[variant]
    out = tmp_path / "back"
    mcore_to_hf(ckpt, str(out), weights_only=True)
    a, b = _hf_tensors(hf_dir), _hf_tensors(str(out))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg = json.load(open(out / "config.json"))
    orig = json.load(open(os.path.join(hf_dir, "config.json")))
    assert cfg["architectures"] == orig["architectures"]
    assert cfg["tie_word_embeddings"] == orig["tie_word_embeddings"]


def test_export_loads_in_transformers_and_matches(tiny_models, tmp_path):
    import transformers

    hf_dir, ckpt = tiny_models[("llama", "reward")]
    out = tmp_path / "rm"
    mcore_to_hf(ckpt, str(out), weights_only=True)
    ids = torch.randint(1, 128, (2, 9))
    a = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    b = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    with torch.no_grad():
        la, lb = a(ids).logits, b(ids).logits
        sa, sb = a.state_dict(), b.state_dict()
        assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-6)  # same weights; kernels may differ by alignment


def test_bf16_sharded_input_and_output(tmp_path):
    import transformers

    hf_dir = str(tmp_path / "hf")
    save_tiny_hf_model(hf_dir, "qwen3", dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    shutil.rmtree(hf_dir)
    model.save_pretrained(hf_dir, max_shard_size="100KB")
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    assert read_meta(str(tmp_path / "mc"))[2] == torch.bfloat16
    mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "back"), max_shard_bytes=100_000, weights_only=True)
    a, b = _hf_tensors(hf_dir), _hf_tensors(str(tmp_path / "back"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in b.values())


def test_reward_from_causal_lm_initialises_head(tmp_path):
    hf_dir = save_tiny_hf_model(str(tmp_path / "lm"), "qwen2")
    arch = hf_to_mcore(hf_dir, str(tmp_path / "rm"), model_type="reward")
    assert arch.model_type == "reward"
    mcore_to_hf(str(tmp_path / "rm"), str(tmp_path / "rm_hf"), weights_only=True)
    t = load_file(str(tmp_path / "rm_hf" / "model.safetensors"))
    assert "score.weight" in t and "lm_head.weight" not in t and t["score.weight"].std() > 0
    assert torch.equal(t["model.norm.weight"], load_file(f"{hf_dir}/model.safetensors")["model.norm.weight"])


def test_reward_from_causal_lm_with_a_zero_head_scores_zero(tmp_path):
    """``head_std=0`` (the demo's RM made from its SFT policy): the backbone unchanged, transformers'
    forward of the export gives logit 0 for any input."""
    import transformers

    hf_dir = save_tiny_hf_model(str(tmp_path / "lm"), "qwen2_tied")
    hf_to_mcore(hf_dir, str(tmp_path / "rm"), model_type="reward", head_std=0.0)
    mcore_to_hf(str(tmp_path / "rm"), str(tmp_path / "rm_hf"), weights_only=True)
    lm, rm = load_file(f"{hf_dir}/model.safetensors"), _hf_tensors(str(tmp_path / "rm_hf"))
    assert not rm["score.weight"].any()
    assert all(torch.equal(rm[k], lm[k]) for k in rm if k != "score.weight")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm_hf"))
    ids = torch.randint(1, model.config.vocab_size, (2, 7))
    assert torch.equal(model(input_ids=ids).logits, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="head_std"):
        hf_to_mcore(hf_dir, str(tmp_path / "rm2"), model_type="reward", head_std=-1.0)


def _run_cli(*args):
    return cli_main(list(args))


def test_cli_convert_round_trip(tmp_path):
    """Both directions through `cooper convert` (its refusals are cases of the bad-input tier)."""
    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2_tied")
    save_tiny_tokenizer(hf_dir)
    assert _run_cli("convert", "hf-to-mcore", "--hf-dir", hf_dir, "--out", str(tmp_path / "mc")) == 0
    assert _run_cli("convert", "mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "b")) == 0
    extra = set(os.listdir(tmp_path / "mc" / "hf_extra"))  # the tokenizer goes into the checkpoint and back out
    assert "tokenizer.json" in extra and extra <= set(os.listdir(tmp_path / "b"))
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_unknown_architecture(tmp_path):
    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2")
    cfg = json.load(open(f"{hf_dir}/config.json"))
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    json.dump(cfg, open(f"{hf_dir}/config.json", "w"))
    with pytest.raises(ValueError, match="unknown architecture 'GPTNeoXForCausalLM'"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))


def test_config_checkpoint_shape_mismatch_names_tensor(tmp_path):
    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2")
    t = load_file(f"{hf_dir}/model.safetensors")
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:90].clone()
    save_file(t, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight': checkpoint shape "
                                         r"\(90, 64\) does not match the shape \(96, 64\)"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    assert not os.path.exists(tmp_path / "mc")


def test_missing_tensor_is_named(tmp_path):
    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2")
    t = load_file(f"{hf_dir}/model.safetensors")
    del t["model.layers.0.self_attn.k_proj.bias"]
    save_file(t, f"{hf_dir}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_proj.bias' is missing"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))


def test_loading_into_a_different_model_names_the_difference(tiny_models, tmp_path):
    from cooper_mcore.models.arch import ArchSpec
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    arch = read_meta(ckpt)[0]
    bigger = ArchSpec.from_dict({**arch.to_dict(), "ffn_hidden_size": 128})
    with single_process_world():
        model = build_model(bigger, ParallelConfig(), init_weights=False)
        with pytest.raises(ValueError, match="ffn_hidden_size: model 128 vs checkpoint 96"):
            load_model_checkpoint(model, ckpt, bigger)
        with pytest.raises(ValueError, match=r"'decoder.layers.mlp.linear_fc1.weight': checkpoint shape "
                                             r"\(4, 192, 64\) does not match the model's \(4, 256, 64\)"):
            load_model_checkpoint(model, ckpt)


def test_live_model_to_hf_names(tiny_models):
    """hf_tensors (the weight-sync path) maps a loaded Megatron model to the HF tensors."""
    from cooper_mcore.convert.hf import hf_tensors
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    hf_dir, ckpt = tiny_models[("qwen3", "reward")]
    arch = read_meta(ckpt)[0]
    ref = _hf_tensors(hf_dir)
    with single_process_world():
        model = build_model(arch, ParallelConfig(), init_weights=False)
        load_model_checkpoint(model, ckpt, arch)
        got = dict(hf_tensors(model, arch))
    assert sorted(got) == sorted(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_converter_save_makes_no_copy_of_fc1(tiny_models):
    """hf-to-mcore saves linear_fc1 whole (no view left for megatron's writer to clone)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    from cooper_mcore.checkpoint.model import _detach_views
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    _, ckpt = tiny_models[("llama", "causal_lm")]
    arch = read_meta(ckpt)[0]
    with single_process_world():
        model = build_model(arch, ParallelConfig(), init_weights=False)
        fc1 = {p.data_ptr() for n, p in model.named_parameters() if "linear_fc1" in n}
        sharded = model.sharded_state_dict()
        apply_factories(sharded)
        before = [s for s in nested_values(sharded) if isinstance(s, ShardedTensor) and "fc1.weight" in s.key]
        assert len(before) == 2 * arch.num_layers  # megatron's swiglu halves
        _detach_views(sharded, model)
        after = [s for s in nested_values(sharded) if isinstance(s, ShardedTensor) and "fc1.weight" in s.key]
    assert len(after) == arch.num_layers
    assert {s.data.data_ptr() for s in after} == fc1  # the parameters themselves, not copies
    assert all(s.global_shape == (arch.num_layers, 2 * arch.ffn_hidden_size, arch.hidden_size) for s in after)
