"""The memory planner on mixture-of-experts models (Qwen3-MoE) against hand computations: parameter
counts (total, active per token, per TP/PP/EP rank, per SGLang GPU), expert training state sharded
over the expert data-parallel group, MoE activations and the uneven-routing margin, layout checks, and
``cooper plan``'s report; the tiny family's counts against transformers and the megatron model
the builder makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cooper_mcore.config.schema import load_config
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.planner.plan import Layout, PlanOptions, layout_of, pass_memory, plan, training_activation_bytes
from cooper_mcore.planner.sizes import (
    MOE_ROUTING_MARGIN,
    active_numel,
    backward_workspace_bytes,
    check_layout,
    expert_layer_numel,
    forward_activation_bytes,
    layer_activation_bytes,
    layer_numel,
    model_numel,
    moe_activation_bytes,
    routing_margin_bytes,
    serving_numel,
    stage_expert_numel,
    stage_numel,
    training_state,
)

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "model_configs"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Qwen3-30B-A3B (examples/model_configs/qwen3-30b-a3b.json), by hand
H, Q, KV, D, E, K, IE, V, L = 2048, 32 * 128, 2 * 4 * 128, 128, 128, 8, 768, 151936, 48
ATTENTION = 2 * H + (Q + KV) * H + 2 * D + H * Q  # norms, qkv, q/k norm, output projection: 18,878,720
ROUTER = E * H  # 262,144
EXPERT = 3 * H * IE  # gate+up, down: 4,718,592
EMBEDDING = V * H  # 311,164,928; untied: the output layer is another


def qwen3_30b() -> ArchSpec:
    return ArchSpec.from_hf_config(json.loads((CONFIGS / "qwen3-30b-a3b.json").read_text()))


def tiny(model_type: str = "causal_lm", **overrides) -> ArchSpec:
    return ArchSpec.from_hf_config(tiny_hf_config("qwen3_moe", model_type, **overrides).to_dict())


def test_the_30b_config_has_the_published_shape():
    a = qwen3_30b()
    m = a.moe
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.num_query_groups, a.head_dim, a.vocab_size,
            a.ffn_hidden_size, a.tie_word_embeddings, a.rope.theta) == (48, 2048, 32, 4, 128, 151936, 6144, False, 1e6)
    assert (m.num_experts, m.experts_per_token, m.expert_ffn_hidden_size, m.norm_topk_prob,
            m.decoder_sparse_step, m.mlp_only_layers) == (128, 8, 768, True, 1, ())
    assert all(a.moe_layers())


def test_30b_a3b_total_and_active_parameters_by_hand():
    a = qwen3_30b()
    total = L * (ATTENTION + ROUTER + E * EXPERT) + 2 * EMBEDDING + H
    active = L * (ATTENTION + ROUTER + K * EXPERT) + 2 * EMBEDDING + H
    assert model_numel(a) == total == 30_532_122_624  # "30.5B"
    assert active_numel(a) == active == 3_353_032_704  # "3.3B activated"
    assert layer_numel(a, sparse=True) == ATTENTION + ROUTER + E * EXPERT == 623_120_640
    assert layer_numel(a) == ATTENTION + 3 * H * 6144  # a dense layer would use intermediate_size


def test_30b_per_gpu_at_tp4_ep8_by_hand():
    a = qwen3_30b()
    attention = 2 * H + (Q + KV) * H // 4 + 2 * D + H * Q // 4
    experts = E // 8 * EXPERT  # 16 local experts, whole (etp=1)
    assert expert_layer_numel(a, ep=8) == experts == 75_497_472
    assert stage_expert_numel(a, ep=8) == L * experts == 3_623_878_656
    assert stage_numel(a, tp=4, ep=8) == L * (attention + ROUTER + experts) + 2 * EMBEDDING // 4 + H == 4_018_747_392
    # etp=2 halves each expert; pp=2 halves the layers (stage 0: embedding, stage 1: norm + output layer)
    assert stage_expert_numel(a, pp=2, stage=1, ep=8, etp=2) == 24 * experts // 2
    assert stage_numel(a, 4, 2, 0, 8, 2) == 24 * (attention + ROUTER + experts // 2) + EMBEDDING // 4


def test_sglang_splits_every_expert_over_its_tp():
    a = qwen3_30b()
    attention = 2 * H + (Q + KV) * H // 4 + 2 * D + H * Q // 4
    assert serving_numel(a, 4) == L * (attention + ROUTER + E * EXPERT // 4) + 2 * EMBEDDING // 4 + H == 7_642_626_048
    assert serving_numel(a, 1) == model_numel(a)


def test_expert_state_is_sharded_over_expert_dp():
    """32 GPUs at tp=4, ep=8: dp = 32/4 = 8 for the dense part, expert_dp = 32/8 = 4 for the experts."""
    a = qwen3_30b()
    n, experts = stage_numel(a, tp=4, ep=8), stage_expert_numel(a, ep=8)
    state = training_state(n, 2, dp=8, expert_numel=experts, expert_dp=4)
    assert state["params"] == 2 * n and state["grads"] == 4 * n
    assert state["optimizer"] == 12 * ((n - experts) // 8 + experts // 4) == 11_463_939_072
    assert training_state(n, 2, dp=8) != state  # without the expert split every shard would be 1/8
    assert training_state(n, 2, dp=8, distributed_optimizer=False, expert_numel=experts)["optimizer"] == 12 * n
    with pytest.raises(ValueError, match="expert_numel"):
        training_state(10, 2, dp=1, expert_numel=11)


def test_moe_activations_and_routing_margin_by_hand():
    """4096 tokens, tp=4 with sequence parallelism: 1024 tokens per rank enter the MoE block. What a layer
    keeps per routed token copy is the memory simulation's measure (docs/planner.md): the experts'
    permuted input h and 6 I (gate/up 2 I, silu, `up + offset`, product, its probability-weighted copy)."""
    a = qwen3_30b()
    routed = 1024 * K  # 8,192 token copies on one rank's experts at the mean routing
    router = 1024 * 2 * E * 4  # fp32 logits and scores
    moe = router + routed * 2 * (H + 6 * IE)
    assert moe_activation_bytes(a, 4096, 2, tp=4, sequence_parallel=True) == moe == 110_100_480
    kv = KV // 2  # the k (or v) elements of one token
    attention = 4096 * 2 * (8 * H // 4 + (5 * Q + 3 * (Q + kv)) // 4)  # norms 4 h each, Qwen3's q/k norms 3 (q + kv)
    layer = attention + moe
    assert layer_activation_bytes(a, 4096, 2, 4, True, sparse=True) == layer == 213_909_504
    # uneven routing: 1.5 x the mean copies, the margin a separate (not simulated) term
    assert MOE_ROUTING_MARGIN == 1.5
    assert routing_margin_bytes(a, 4096, 2, 4, True) == routed // 2 * 2 * (H + 6 * IE) == 54_525_952
    # forward only: the dispatched, exchanged and sorted inputs (3 h) beside the experts' 6 I, the residual
    # stream and norm (4 h over TP) and the gathered input (h)
    inside = 4096 * 2 * (4 * H // 4 + H) + router + routed * 2 * (3 * H + 6 * IE)
    assert forward_activation_bytes(a, 4096, 2, 4, True) == inside == 210_763_776
    # backward: the local experts' gate/up weight gradient and the copies' gradient
    assert backward_workspace_bytes(a, 4096, 2, 4, True, ep=8) == 2 * (E // 8 * 2 * IE * H + routed * 2 * IE)
    lay = Layout(tp=4, pp=1, dp=8, sequence_parallel=True, ep=8, etp=1, expert_dp=4)
    assert training_activation_bytes(a, lay, 0, 4096, 3, 2, False) == L * layer
    update = pass_memory(a, lay, 0, 4096, 3, 2, True, logits=1)
    assert update["routing_margin"] == L * 54_525_952
    dense = ArchSpec.from_hf_config(json.loads((CONFIGS / "qwen2.5-1.5b-instruct.json").read_text()))
    assert routing_margin_bytes(dense, 4096, 2) == 0
    with pytest.raises(ValueError, match="no experts"):
        moe_activation_bytes(dense, 4096, 2)


def test_mixed_dense_and_sparse_layers_by_stage():
    """The tiny family: 4 layers, the last dense (mlp_only_layers=[3]), 8 experts of 3*64*32."""
    a = tiny()
    h, expert = 64, 3 * 64 * 32
    assert a.moe_layers() == [True, True, True, False]
    assert stage_expert_numel(a, pp=2, stage=0, ep=2) == 2 * 4 * expert
    assert stage_expert_numel(a, pp=2, stage=1, ep=2) == 1 * 4 * expert
    assert stage_numel(a, 1, 2, 1, 2) == layer_numel(a, 1, True, 2) + layer_numel(a) + h + 128 * h
    sparse, dense = (layer_activation_bytes(a, 100, 2, sparse=s) for s in (True, False))
    lay = Layout(tp=1, pp=2, dp=1, sequence_parallel=False, ep=2)
    assert training_activation_bytes(a, lay, 1, 100, 4, 2, False) == 1 * (sparse + dense)
    # recomputed: each of stage 0's 2 layers keeps its input (h) for its 2 micro-batches in flight, plus
    # one layer's set while it is recomputed
    assert training_activation_bytes(a, lay, 0, 100, 4, 2, True) == 2 * 2 * 100 * h * 2 + sparse


@pytest.mark.parametrize("model_type", ["causal_lm", "reward"])
def test_tiny_counts_equal_transformers(model_type):
    import transformers

    cfg = tiny_hf_config("qwen3_moe", model_type)
    cls = transformers.Qwen3MoeForCausalLM if model_type == "causal_lm" else \
        transformers.Qwen3MoeForSequenceClassification
    model = cls(cfg)
    a = tiny(model_type)
    assert model_numel(a) == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == stage_expert_numel(a)


def test_tiny_counts_equal_the_built_megatron_model():
    """Independent reference at EP=1 (one process): the model megatron-core builds."""
    import torch

    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    a = tiny()
    with single_process_world():
        model = build_model(a, ParallelConfig(), dtype=torch.bfloat16)
        named = list(model.named_parameters())
    assert sum(p.numel() for _, p in named) == model_numel(a)
    assert sum(p.numel() for n, p in named if ".experts." in n) == stage_expert_numel(a)


def test_layout_checks_name_the_expert_setting():
    a = qwen3_30b()
    check_layout(a, 4, 2, "policy", ep=8, etp=2)
    with pytest.raises(ValueError, match="policy: num_experts=128 is not divisible by ep=3"):
        check_layout(a, 1, 1, "policy", ep=3)
    with pytest.raises(ValueError, match="moe_intermediate_size=768 is not divisible by etp=5"):
        check_layout(a, 1, 1, "policy", etp=5)
    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by tp=8"):
        check_layout(a, 8, 1, "policy")


def _moe_config(*overrides: str):
    base = ["model.dtype=bfloat16", "reward.mode=rule", "rollout.engine=sglang", "rm.negatives=perturb",
            "parallel.tp=4", "parallel.ep=8", "parallel.etp=1", "parallel.sequence_parallel=true",
            "train.prompts_per_step=8",
            "rollout.group_size=4", "train.micro_batch_size=1", "rollout.max_new_tokens=512"]
    return load_config(None, base + list(overrides))


def test_plan_counts_the_expert_state_and_the_engine():
    cfg, a = _moe_config(), qwen3_30b()
    assert layout_of(cfg, 32) == Layout(4, 1, 8, True, 8, 1, 4)
    result = plan(cfg, a, None, PlanOptions(gpus_per_node=8, nodes=4, gpu_memory_gib=79.18, assistant="none"))
    state = result.given.phases[-1].components  # weight sync: the whole training state
    assert state["policy_params"] == 2 * 4_018_747_392
    assert state["policy_optimizer"] == 11_463_939_072
    assert result.given.engine.weights == 2 * 7_642_626_048
    update = {p.phase: p for p in result.given.phases}["policy_update"].components
    lay = result.layout
    # the peak is at the loss: what the layers keep, the final norm's set (4 h over TP) and the logits
    final = 1024 * 2 * 4 * H // 4
    assert update["activations"] == training_activation_bytes(a, lay, 0, 1024, 1, 2, False) + final
    assert update["routing_margin"] == L * routing_margin_bytes(a, 1024, 2, 4, True)


def test_cli_reports_experts_and_active_parameters(capsys, tmp_path):
    from cooper_mcore.cli import main

    args = ["plan", "--gpus-per-node", "8", "--nodes", "4", "--gpu-memory-gib", "79.18", "--no-assistant",
            "--policy-config", str(CONFIGS / "qwen3-30b-a3b.json"), "model.dtype=bfloat16", "reward.mode=rule",
            "rollout.engine=sglang", "rm.negatives=perturb", "parallel.tp=4", "parallel.ep=8", "parallel.etp=1",
            "parallel.sequence_parallel=true", "train.prompts_per_step=8"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "ep=8 etp=1 expert_dp=4" in text and "3,353,032,704 active per token" in text
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    policy = doc["models"]["policy"]
    assert policy["params"] == 30_532_122_624 and policy["active_params_per_token"] == 3_353_032_704
    assert policy["moe"]["expert_params_per_gpu_by_stage"] == [3_623_878_656]
    assert (policy["moe"]["ep"], policy["moe"]["expert_dp"], doc["layout"]["expert_dp"]) == (8, 4, 4)
