"""The memory planner (`cooper plan`) against hand computations, and its parameter and training-state
counts against the megatron model that cooper_mcore.models.builder really builds (single process;
the TP/PP/DP layouts are in tests/multiproc/test_plan_dist.py). The colocated assistant is checked
with the 7B preset's numbers (the shipped presets' verdicts are in tests/unit/test_presets.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from cooper_mcore.config.schema import CooperConfig, OffloadConfig, load_config
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.planner.plan import (
    ASSISTANT_KV_TOKENS,
    AssistantSpec,
    Layout,
    PlanOptions,
    assistant_mem_fraction,
    assistant_weights_bytes,
    colocated_assistant,
    pass_memory,
    plan,
    sglang_default_limits,
    sglang_workspace_bytes,
    training_activation_bytes,
)
from cooper_mcore.planner.sizes import (
    GIB,
    backward_workspace_bytes,
    kv_bytes_per_token,
    layer_activation_bytes,
    logits_bytes,
    model_numel,
    stage_numel,
    training_state,
)
from tests.conftest import ROOT

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
QWEN15_N = 1_543_714_304  # Qwen2.5-1.5B-Instruct, published parameter count
CTX = 3 * GIB // 4  # the planner's CUDA context per process and GPU (0.75 GiB, measured 736 MiB on an H100)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def arch(name: str, model_type: str = "causal_lm") -> ArchSpec:
    return ArchSpec.from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()), model_type)


def config(*overrides: str) -> CooperConfig:
    base = ["model.dtype=bfloat16", "reward.mode=rule", "rollout.engine=sglang", "rm.negatives=perturb"]
    return load_config(None, base + list(overrides))


@pytest.mark.parametrize("name, expected", [
    ("qwen2.5-1.5b-instruct", QWEN15_N),
    ("llama-3.2-1b-instruct", 1_235_814_400),
    ("qwen2.5-7b-instruct", 7_615_616_512),
])
def test_parameter_counts_equal_the_published_models(name, expected):
    assert model_numel(arch(name)) == expected


def test_example_configs_have_the_published_shapes():
    q, ll, q7 = arch("qwen2.5-1.5b-instruct"), arch("llama-3.2-1b-instruct"), arch("qwen2.5-7b-instruct")
    assert (q.hidden_size, q.num_layers, q.num_attention_heads, q.num_query_groups, q.ffn_hidden_size,
            q.vocab_size, q.tie_word_embeddings) == (1536, 28, 12, 2, 8960, 151936, True)
    assert (q7.hidden_size, q7.num_layers, q7.num_attention_heads, q7.num_query_groups, q7.ffn_hidden_size,
            q7.vocab_size, q7.tie_word_embeddings) == (3584, 28, 28, 4, 18944, 152064, False)
    assert (ll.hidden_size, ll.num_layers, ll.num_attention_heads, ll.num_query_groups, ll.ffn_hidden_size,
            ll.vocab_size, ll.tie_word_embeddings, ll.rope.rope_type, ll.rope.factor) == (
        2048, 16, 32, 8, 8192, 128256, True, "llama3", 32.0)


def test_per_gpu_parameters_at_tp2_pp2_by_hand():
    a = arch("qwen2.5-1.5b-instruct")
    # one layer on one of 2 TP ranks: 2 norms (1536 each, replicated) + QKV (1536+2*256 rows of 1536)/2
    # + QKV bias 2048/2 + output projection 1536*1536/2 + gate/up/down 3*1536*8960/2
    layer = 3072 + 1_572_864 + 1024 + 1_179_648 + 20_643_840
    assert layer == 23_400_448
    embedding_half = 151936 * 1536 // 2  # 116,686,848
    assert stage_numel(a, tp=2, pp=2, stage=0) == 14 * layer + embedding_half == 444_293_120
    # the last stage: its 14 layers, the final norm, and its own copy of the tied embedding
    assert stage_numel(a, tp=2, pp=2, stage=1) == 14 * layer + 1536 + embedding_half == 444_294_656
    # all 4 ranks together: the model + the last stage's embedding copy + norms replicated on the 2nd TP rank
    total = 2 * (444_293_120 + 444_294_656)
    assert total == QWEN15_N + 151936 * 1536 + (28 * 2 * 1536 + 1536)
    # the planner's per-GPU parameter bytes (bf16) on the worst stage
    p = plan(config("parallel.tp=2", "parallel.pp=2"), a, None, PlanOptions(gpus_per_node=8, gpu_memory_gib=80))
    assert (p.layout.tp, p.layout.pp, p.layout.dp) == (2, 2, 2)
    by_phase = {ph.phase: ph for ph in p.given.phases}
    assert by_phase["policy_update"].components["policy_params"] in (2 * 444_293_120, 2 * 444_294_656)
    assert by_phase["rollout"].stage == 0  # the engine sits on stage 0's GPUs
    assert by_phase["rollout"].components["policy_params"] == 2 * 444_293_120


def test_distributed_optimizer_shards_at_dp4():
    a = arch("qwen2.5-1.5b-instruct")
    n = stage_numel(a, tp=2)
    assert n == 28 * 23_400_448 + 151936 * 1536 // 2 + 1536 == 771_900_928
    p = plan(config("parallel.tp=2"), a, None, PlanOptions(gpus_per_node=8, gpu_memory_gib=80))
    assert p.layout.dp == 4
    c = p.given.phases[0].components
    assert c["policy_params"] == 2 * n  # bf16 parameters
    assert c["policy_grads"] == 4 * n  # fp32 grad buffer (grad_reduce_in_fp32)
    assert c["policy_optimizer"] == 12 * 192_975_232  # fp32 main params + 2 moments, 1/4 each
    assert training_state(n, 4, dp=4)["optimizer"] == 8 * 192_975_232  # fp32 model: main params are the params
    assert training_state(n, 2, dp=4, distributed_optimizer=False)["optimizer"] == 12 * n
    assert training_state(n, 2, dp=4, trainable=False) == {"params": 2 * n, "grads": 0, "optimizer": 0}


def test_kv_cache_bytes_per_token():
    q, ll = arch("qwen2.5-1.5b-instruct"), arch("llama-3.2-1b-instruct")
    assert kv_bytes_per_token(q, 2) == 2 * 28 * 2 * 128 * 2 == 28_672
    assert kv_bytes_per_token(q, 2, tp=2) == 14_336  # one KV head per GPU
    assert kv_bytes_per_token(q, 2, tp=4) == 14_336  # more GPUs than KV heads: the head is replicated
    assert kv_bytes_per_token(ll, 2) == 2 * 16 * 8 * 64 * 2 == 32_768
    assert kv_bytes_per_token(ll, 4, tp=2) == 32_768


def test_sglang_kv_pool_by_hand():
    a = arch("qwen2.5-1.5b-instruct")
    p = plan(config("rollout.sglang_mem_fraction=0.5"), a, None, PlanOptions(gpus_per_node=8, gpu_memory_gib=80))
    n = QWEN15_N
    resident = 2 * n + 4 * n + 12 * math.ceil(n / 8)  # the trainer's state when the engine starts (dp=8)
    free = 80 * GIB - 2 * GIB - 2 * CTX - resident  # overhead, the trainer's and the engine's CUDA contexts
    pool = int(0.5 * free) - 2 * n
    eng = p.given.engine
    assert (eng.weights, eng.kv_pool) == (2 * n, pool)
    assert eng.tokens_at_once == pool // 28_672
    assert eng.sequences == 32 // 8 * 16 and eng.tokens_needed == 64 * (512 + 512)


def test_activations_and_logits_by_hand():
    a = arch("qwen2.5-1.5b-instruct")
    tokens = 2 * 256  # micro-batch 2, sequence 100 + 156 tokens
    # per token, bf16: two RMSNorms of 4 h (fp32 input 2 h, normalised h, output h), attention 5 q, the
    # gated MLP 5 ffn (gate/up 2 ffn, silu, megatron's `up + offset` copy, product): 64,768 elements,
    # what the memory simulation measures autograd keeping (docs/planner.md)
    per_token_layer = 8 * 1536 + 5 * 1536 + 5 * 8960
    layer = tokens * 2 * per_token_layer
    assert layer_activation_bytes(a, tokens, 2) == layer == 66_322_432
    # 512 tokens <= the 1024-token chunk: one chunk of all of them. Train: the bf16 logits (2 B), the
    # entropy metric's two fp32 temporaries (8 B) in forward; their gradient (2 B) and one fp32
    # temporary (4 B) in backward: max(2 + 8, 2 + 2 + 4) = 10 B
    assert logits_bytes(a, tokens, 2, tp=1, train=True) == tokens * 151936 * 10
    assert logits_bytes(a, tokens, 2, tp=1, train=False) == tokens * 151936 * 6  # 2 + one fp32 temporary
    assert logits_bytes(a, tokens, 2, tp=2, train=True) == tokens * 75968 * 10
    # chunks of 128 of the 512 tokens: backward 2 + 2 B per token beside 4 B per chunk entry
    assert logits_bytes(a, tokens, 2, tp=1, train=True, chunk_tokens=128) == (4 * tokens + 4 * 128) * 151936
    assert logits_bytes(a, tokens, 2, tp=1, train=False, chunk_tokens=128) == 4 * tokens * 151936  # the transpose
    # a packed micro-batch is one row: its transpose is contiguous, no copy
    assert logits_bytes(a, tokens, 2, 1, False, 128, packed=True) == (2 * tokens + 4 * 128) * 151936
    assert logits_bytes(a, tokens, 2, tp=1, train=True, chunk_tokens=128, entropy_grad=True) == \
        (4 * tokens + 8 * 128) * 151936
    assert logits_bytes(a, tokens, 4, tp=1, train=True, chunk_tokens=128) == (8 * tokens + 4 * 128) * 151936

    cfg = config("train.micro_batch_size=2", "train.prompts_per_step=8", "rollout.group_size=4",
                 "rollout.max_new_tokens=156")
    opts = PlanOptions(gpus_per_node=1, gpu_memory_gib=80, prompt_tokens=100)
    update = {ph.phase: ph for ph in plan(cfg, a, None, opts).given.phases}["policy_update"].components
    # the peak is at the loss: 28 layers kept, the final norm's 4 h and the logits beside them (backward's
    # own workspace, the MLP's gradient 2 ffn, comes later, without the logits)
    final = tokens * 2 * 4 * 1536
    assert update["activations"] == 28 * layer + final
    assert update["logits"] == tokens * 151936 * 10
    assert backward_workspace_bytes(a, tokens, 2) == tokens * 2 * 2 * 8960 < update["logits"]
    rec = {ph.phase: ph for ph in plan(cfg, a, None, PlanOptions(gpus_per_node=1, gpu_memory_gib=80, prompt_tokens=100,
                                                                 recompute=True)).given.phases}["policy_update"]
    assert rec.components["activations"] == 28 * tokens * 1536 * 2 + layer + final


def test_the_logits_of_the_step_benchmark_fit_a_quarter_of_the_full_vocabulary_copies():
    """``benchmarks/cooper_step.py``'s GPU defaults (Qwen2.5-1.5B, bf16, 8 prompts x 16 rollouts of up
    to 512 new tokens after 512-token prompts, micro-batch 8: 8192 tokens): the full-vocabulary fp32
    loss needed 27 B per token and vocabulary entry (31.3 GiB); chunked, the logits term is the bf16
    logits and their gradient (4 B) plus one 1024-token fp32 chunk (5.22 GiB), under a quarter."""
    a = arch("qwen2.5-1.5b-instruct")
    cfg = config("model.dtype=bfloat16", "train.prompts_per_step=8", "rollout.group_size=16",
                 "rollout.max_new_tokens=512", "train.micro_batch_size=8")
    phases = {ph.phase: ph for ph in plan(cfg, a, a, PlanOptions(gpus_per_node=1, gpu_memory_gib=80)).given.phases}
    tokens = 8 * 1024
    assert phases["policy_update"].components["logits"] == (4 * tokens + 4 * 1024) * 151936
    assert phases["policy_update"].components["logits"] < 27 * tokens * 151936 / 4
    assert round(phases["policy_update"].components["logits"] / GIB, 2) == 5.22
    assert phases["logprobs"].components["logits"] == 4 * tokens * 151936  # 4.64 GiB


def test_pipeline_stages_hold_their_in_flight_micro_batches():
    a = arch("qwen2.5-1.5b-instruct")
    lay = Layout(tp=1, pp=4, dp=1, sequence_parallel=False)
    layer = layer_activation_bytes(a, 1000, 2)
    assert training_activation_bytes(a, lay, 0, 1000, 8, 2, False) == 4 * 7 * layer
    assert training_activation_bytes(a, lay, 3, 1000, 8, 2, False) == 1 * 7 * layer
    assert training_activation_bytes(a, lay, 0, 1000, 2, 2, False) == 2 * 7 * layer  # only 2 exist
    # a stage that is not the last has no logits: its peak is in backward, its workspace beside what it keeps
    first = pass_memory(a, lay, 0, 1000, 8, 2, True)
    assert first == {"activations": 4 * 7 * layer + backward_workspace_bytes(a, 1000, 2), "logits": 0,
                     "routing_margin": 0}


def _hf_rollout_setting():
    cfg = config("rollout.engine=hf", "train.micro_batch_size=1", "train.prompts_per_step=16",
                 "rollout.group_size=4", "rollout.max_new_tokens=512", "rollout.bucket_mb=16")
    return cfg, PlanOptions(gpus_per_node=1, gpu_memory_gib=80, prompt_tokens=1536, recompute=True)


def test_offload_turns_a_non_fitting_run_into_a_fitting_one():
    a = arch("qwen2.5-1.5b-instruct")
    n = QWEN15_N
    cfg, opts = _hf_rollout_setting()
    # rollout on one GPU by hand: training state (dp=1) + the HF engine's whole model + the KV cache of 64
    # sequences of 2048 tokens + prefill workspace of 64 x 1536 prompt tokens (a forward-only layer: 5 ffn + 4 h
    # per token) + 2 GiB overhead + the trainer's CUDA context (the HF engine runs inside the trainer)
    rollout = (2 + 4 + 12) * n + 2 * n + 64 * 2048 * 28_672 + 64 * 1536 * 2 * 50_944 + 2 * GIB + CTX
    ev = plan(cfg, a, None, opts).given
    assert ev.peak.phase == "rollout" and ev.peak.total == rollout
    # a GPU 1.5 x the parameters' bf16 bytes too small: offloading the bf16 params (2n) is not enough, the fp32
    # grads (4n) are, and move fewer bytes than the Adam state (12n)
    gib = (rollout - 3 * n) / GIB
    p = plan(cfg, a, None, PlanOptions(gpus_per_node=1, gpu_memory_gib=gib, prompt_tokens=1536, recompute=True))
    assert not p.fits and p.recommended is not None
    assert p.needed_overrides() == {"offload.policy_grads": True}
    assert p.recommended.fits and p.recommended.peak.total <= gib * GIB
    assert {ph.phase: ph.total for ph in p.recommended.phases}["rollout"] == rollout - 4 * n
    off, on = p.effects["policy_params"]
    assert not off.fits and not on.fits and off.peak.total - on.peak.total == 2 * n


def test_sglang_needs_the_engine_released_during_training():
    a = arch("qwen2.5-1.5b-instruct")
    cfg = config("offload.release_engine=false", "rollout.sglang_mem_fraction=0.7", "train.micro_batch_size=1")
    opts = PlanOptions(gpus_per_node=8, gpu_memory_gib=40)
    p = plan(cfg, a, None, opts)
    n = QWEN15_N
    static = int(0.7 * (40 * GIB - 2 * GIB - 2 * CTX - (6 * n + 12 * math.ceil(n / 8))))
    update = {ph.phase: ph for ph in p.given.phases}["policy_update"].components
    assert update["engine_weights"] + update["engine_kv"] == static
    # not released, its CUDA graphs and activations stay too: SGLang's estimate at its 40 GiB-GPU defaults
    assert update["engine_workspace"] == (512 + 1.5 * 4096 + 1 / 8 * 1024 + 2 * 32) * 2**20
    assert not p.fits and p.needed_overrides() == {"offload.release_engine": True}
    assert {ph.phase: ph for ph in p.recommended.phases}["policy_update"].components["engine_kv"] == 0


def test_a_kv_pool_smaller_than_one_sequence_fits_with_no_offload():
    # 4% of the ~67 GiB free when SGLang starts is less than its 2.9 GiB of weights
    p = plan(config("rollout.sglang_mem_fraction=0.04"), arch("qwen2.5-1.5b-instruct"), None,
             PlanOptions(gpus_per_node=8, gpu_memory_gib=80))
    assert not p.fits and p.given.problems and "sglang_mem_fraction" in p.given.problems[0]
    assert p.recommended is None and p.needed_overrides() is None


def test_the_rm_modes():
    a = arch("qwen2.5-1.5b-instruct")
    rm = arch("qwen2.5-1.5b-instruct", "reward")
    assert stage_numel(rm) == QWEN15_N + 1536  # the scalar head instead of the tied output layer
    opts = PlanOptions(gpus_per_node=8, gpu_memory_gib=80)
    cooper = plan(config("reward.mode=cooper"), a, rm, opts).given.phases[0].components
    static = plan(config("reward.mode=static_rm"), a, rm, opts).given.phases[0].components
    n = QWEN15_N + 1536
    assert (cooper["rm_params"], cooper["rm_grads"], cooper["rm_optimizer"]) == (2 * n, 4 * n, 12 * math.ceil(n / 8))
    assert (static["rm_params"], static["rm_grads"], static["rm_optimizer"]) == (2 * n, 0, 0)
    with pytest.raises(ValueError, match="reward model's shape"):
        plan(config("reward.mode=cooper"), a, None, opts)


def test_impossible_layouts_are_named():
    a = arch("qwen2.5-1.5b-instruct")
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp=4"):
        plan(config("parallel.tp=4"), a, None, PlanOptions(gpus_per_node=8, gpu_memory_gib=80))
    with pytest.raises(ValueError, match="not divisible by tp\\*pp"):
        plan(config("parallel.tp=2"), a, None, PlanOptions(gpus_per_node=3, gpu_memory_gib=80))


def test_cli_json_and_table(capsys, tmp_path):
    from cooper_mcore.cli import main

    policy = str(CONFIGS / "qwen2.5-1.5b-instruct.json")
    common = ["plan", "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--policy-config", policy,
              "model.dtype=bfloat16", "rollout.engine=sglang", "rm.negatives=perturb", "train.micro_batch_size=2"]
    assert main(common + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc["fits"], bool)
    expected = plan(config("reward.mode=cooper", "train.micro_batch_size=2"), arch("qwen2.5-1.5b-instruct"),
                    ArchSpec.from_hf_config(json.loads(Path(policy).read_text()), "reward"),
                    PlanOptions(gpus_per_node=8, gpu_memory_gib=80))
    assert doc["fits"] == expected.fits
    assert doc["as_configured"]["peak"]["gib"] == round(expected.given.peak.total / GIB, 2)
    assert doc["models"]["policy"]["params"] == QWEN15_N and doc["measured"] is False
    assert [ph["phase"] for ph in doc["as_configured"]["phases"]] == [
        "rollout", "rm_score", "logprobs", "policy_update", "rm_update", "weight_sync"]
    assert any("assumed to be the policy's backbone" in n for n in doc["notes"])
    grads = doc["offload_effects"]["policy_grads"]  # offloading grads lowers the rollout phase by 4 B/param
    assert grads["configured"] is False
    assert grads["phases_off_gib"]["rollout"] - grads["phases_on_gib"]["rollout"] == pytest.approx(
        4 * QWEN15_N / GIB, abs=0.011)
    assert grads["phases_off_gib"]["policy_update"] == grads["phases_on_gib"]["policy_update"]

    assert main(common) == 0
    text = capsys.readouterr().out
    assert "policy_update" in text and "verdict: " in text and "release_engine" in text

    # the shape from model.policy_hf's config.json
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(Path(policy).read_text())
    assert main(["plan", "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--json", "reward.mode=rule",
                 f"model.policy_hf={tmp_path / 'hf'}"]) == 0
    assert json.loads(capsys.readouterr().out)["models"]["policy"]["params"] == QWEN15_N  # none: a bad-input case


def test_offload_defaults_are_the_config_defaults():
    assert OffloadConfig() == CooperConfig().offload  # the planner's "as configured" starts from these


@pytest.mark.parametrize("family, model_type", [("qwen2_tied", "causal_lm"), ("qwen3", "reward")])
def test_counts_equal_the_built_megatron_model(world, family, model_type):
    """Independent reference: the model megatron-core builds, wrapped for training as the trainer does."""
    import torch

    from cooper_mcore.models.builder import build_model
    from cooper_mcore.models.tiny import tiny_hf_config
    from cooper_mcore.parallel import ParallelConfig
    from cooper_mcore.train.offload import ModelOffloader
    from cooper_mcore.train.step import OptimConfig, wrap_for_training

    a = ArchSpec.from_hf_config(tiny_hf_config(family, model_type).to_dict())
    model = build_model(a, ParallelConfig(), dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    assert numel == stage_numel(a) == model_numel(a)
    ddp, opt = wrap_for_training(model, OptimConfig(distributed_optimizer=True))
    off = ModelOffloader(ddp, opt)
    planned = training_state(numel, 2, dp=1)
    pad = tensors * 64 + 128  # DDP aligns each parameter to 64 elements and the buffer end to 128
    assert 0 <= off.device_bytes("params") - planned["params"] <= 2 * pad
    assert 0 <= off.device_bytes("grads") - planned["grads"] <= 4 * pad
    assert abs(off.device_bytes("optimizer") - planned["optimizer"]) <= 0.03 * planned["optimizer"]


def test_sglang_workspace_as_sglang_estimates_it():
    # 512 MiB + 1.5 MiB per chunked-prefill token + TP/8 GiB + 2 MiB per decode CUDA-graph batch size
    assert sglang_workspace_bytes(2) == (512 + 3072 + 256 + 128) * 2**20  # the assistant: 2048-token chunks, 64 running
    assert sglang_workspace_bytes(1, chunked_prefill=1024, max_running=8) == (512 + 3072 + 128 + 16) * 2**20
    assert sglang_default_limits(79.18, 2) == (8192, 256) and sglang_default_limits(79.18, 4) == (8192, 512)
    assert sglang_default_limits(39.4, 1) == (4096, 32) and sglang_default_limits(139.8, 8) == (8192, 512)


def _7b_weights_by_hand() -> int:
    """Qwen2.5-7B-Instruct on one of 2 TP ranks, bf16: the issue's "7.1 GiB of weights per GPU"."""
    layer = 2 * 3584 + (3584 + 2 * 512) * 3584 // 2 + (3584 + 2 * 512) // 2 + 3584 * 3584 // 2 + 3 * 3584 * 18944 // 2
    assert layer == 116_532_480
    per_rank = 28 * layer + 2 * (152064 * 3584 // 2) + 3584  # untied embedding and output layer halves, final norm
    return 2 * per_rank


def test_the_7b_assistant_needs_more_than_the_old_fixed_fraction():
    """The 7B preset's assistant (Qwen2.5-7B-Instruct, TP=2) on an H100 as torch reports it (79.18 GiB): the
    launcher's old fixed --mem-fraction-static 0.08 leaves no KV cache, so SGLang refused to start."""
    a7 = arch("qwen2.5-7b-instruct")
    weights = _7b_weights_by_hand()
    assert assistant_weights_bytes(a7, 2) == weights == 7_615_820_800  # 7.09 GiB
    free = 79.18 * GIB - 0.75 * GIB  # all but the server's own CUDA context
    kv = 2 * 28 * (4 // 2) * 128 * 2  # bytes per token on one GPU: K and V, 28 layers, 2 of 4 KV heads, bf16
    assert kv_bytes_per_token(a7, 2, tp=2) == kv == 28_672
    derived = assistant_mem_fraction(a7, 2, 79.18)
    assert derived == math.ceil((weights + ASSISTANT_KV_TOKENS * kv) / free * 100) / 100 == 0.12
    assert 0.08 * free - weights < 0  # the old default: weights alone exceed the static share

    cfg = config("reward.mode=cooper", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                 "train.micro_batch_size=4", "train.prompts_per_step=96")
    opts = dict(gpus_per_node=8, nodes=2, gpu_memory_gib=79.18)
    rm = arch("qwen2.5-1.5b-instruct", "reward")
    old = plan(cfg, a7, rm, PlanOptions(**opts, assistant=AssistantSpec(a7, tp=2, mem_fraction=0.08)))
    assert not old.fits and old.recommended is None  # no offload can help
    (problem,) = [p for p in old.given.problems if "assistant" in p]
    minimum = math.ceil((weights + 2048 * kv) / free * 1000) / 1000
    assert minimum == 0.092 and f"ASSISTANT_MEM_FRACTION >= {minimum:g}" in problem and "refuses to start" in problem
    new = plan(cfg, a7, rm, PlanOptions(**opts, assistant=AssistantSpec(a7, tp=2)))
    a = new.assistant
    assert (a.tp, a.replicas, a.mem_fraction, a.weights) == (2, 4, 0.12, weights)
    assert a.kv_pool == int(0.12 * int(free)) - weights and a.tokens_at_once == a.kv_pool // kv >= ASSISTANT_KV_TOKENS
    assert not [p for p in new.given.problems if "assistant" in p]


def test_the_assistant_is_counted_on_every_gpu_in_every_phase():
    a15, rm = arch("qwen2.5-1.5b-instruct"), arch("qwen2.5-1.5b-instruct", "reward")
    cfg = config("reward.mode=cooper", "train.micro_batch_size=4", "rollout.sglang_mem_fraction=0.4")
    base = PlanOptions(gpus_per_node=8, gpu_memory_gib=79.18)
    without = plan(cfg, a15, rm, dataclasses.replace(base, assistant="none"))
    spec = AssistantSpec(a15, tp=1)
    with_ = plan(cfg, a15, rm, dataclasses.replace(base, assistant=spec))
    a = with_.assistant
    assert a.mem_fraction == assistant_mem_fraction(a15, 1, 79.18) == 0.06
    held = a.weights + a.kv_pool + a.workspace + CTX  # static share, workspace, its scheduler's CUDA context
    assert a.weights + a.kv_pool == int(0.06 * int(78.43 * GIB)) and a.workspace == sglang_workspace_bytes(1)
    # the policy's engine starts after it and sizes its pool from what is left
    assert without.given.engine.kv_pool - with_.given.engine.kv_pool == pytest.approx(0.4 * held, abs=2)
    for ph_without, ph_with in zip(without.given.phases, with_.given.phases):
        engine_kv = ph_with.components["engine_kv"] - ph_without.components["engine_kv"]
        assert ph_with.total - ph_without.total - engine_kv == held, ph_with.phase


def test_the_colocated_assistant_is_inferred_from_the_config():
    a15 = arch("qwen2.5-1.5b-instruct")
    cfg = config("reward.mode=cooper", "rm.negatives=assistant", "rm.assistant_url=http://127.0.0.1:30010",
                 "rm.assistant_model=Qwen2.5-1.5B-Instruct", "model.policy_hf=/models/Qwen2.5-1.5B-Instruct")
    spec, notes = colocated_assistant(cfg, a15)
    assert spec == AssistantSpec(a15, tp=1) and "ASSISTANT_TP=1" in notes[0] and "assumed" not in notes[0]
    other = config("reward.mode=cooper", "rm.negatives=assistant", "rm.assistant_url=http://localhost:30010/v1",
                   "rm.assistant_model=Other", "parallel.tp=2")
    spec, notes = colocated_assistant(other, a15)
    assert spec.tp == 2 and "rm.assistant_model='Other': assumed" in notes[0]
    remote = config("reward.mode=cooper", "rm.negatives=assistant", "rm.assistant_url=http://assistant-host:30000",
                    "rm.assistant_model=M")
    assert colocated_assistant(remote, a15)[0] is None
    assert colocated_assistant(config("reward.mode=cooper", "rm.negatives=perturb"), a15) == (None, [])
    p = plan(cfg, a15, arch("qwen2.5-1.5b-instruct", "reward"), PlanOptions(gpus_per_node=8, gpu_memory_gib=79.18))
    assert p.assistant is not None and p.assistant.replicas == 8
    assert p.notes == colocated_assistant(cfg, a15)[1]


def test_assistant_settings_are_checked():
    a15 = arch("qwen2.5-1.5b-instruct")
    cfg = config()
    with pytest.raises(ValueError, match="ASSISTANT_TP=3 must divide the 8 GPUs"):
        plan(cfg, a15, None, PlanOptions(gpus_per_node=8, gpu_memory_gib=80, assistant=AssistantSpec(a15, tp=3)))
    with pytest.raises(ValueError, match="ASSISTANT_MEM_FRACTION must be in"):
        plan(cfg, a15, None, PlanOptions(gpus_per_node=8, gpu_memory_gib=80,
                                         assistant=AssistantSpec(a15, mem_fraction=1.2)))
    with pytest.raises(ValueError, match="more than the .* GiB free: raise ASSISTANT_TP"):
        assistant_mem_fraction(arch("qwen2.5-7b-instruct"), 1, 16)


def test_cli_assistant_options(capsys):
    """`cooper plan` counts the preset's colocated assistant, another one given on the command line,
    or none."""
    from cooper_mcore.cli import main as cli_main

    base = ["plan", "--config", str(ROOT / "examples" / "qwen2.5-1.5b_8xh100.yaml"), "--gpus-per-node", "8",
            "--gpu-memory-gib", "79.18", "--json",
            "--policy-config", str(ROOT / "examples" / "model_configs" / "qwen2.5-1.5b-instruct.json"),
            "--rm-config", str(ROOT / "examples" / "model_configs" / "qwen2.5-1.5b-instruct.json")]
    peaks = {}
    for name, extra in (("auto", []), ("none", ["--no-assistant"]),
                        ("7b", ["--assistant-config", str(ROOT / "examples" / "model_configs" /
                                                         "qwen2.5-7b-instruct.json"), "--assistant-tp", "2"])):
        assert cli_main(base + extra) == 0
        doc = json.loads(capsys.readouterr().out)
        peaks[name] = doc["as_configured"]["peak"]["gib"]
        if name == "none":
            assert doc["assistant"] is None
        if name == "7b":
            assert doc["assistant"]["tp"] == 2
    assert peaks["none"] < peaks["auto"] < peaks["7b"]


def test_token_budget_sets_the_micro_batch_tokens():
    """With train.max_tokens_per_micro_batch the planner sizes a micro-batch by the budget (or one
    sequence, when longer) instead of micro_batch_size x the longest sequence."""
    shape = ArchSpec.from_hf_config(json.loads((ROOT / "examples" / "model_configs" /
                                                "qwen2.5-1.5b-instruct.json").read_text()))
    opts = PlanOptions(gpus_per_node=8, gpu_memory_gib=79.18, assistant="none")
    base = ["reward.mode=rule", "rollout.max_new_tokens=512", "train.prompts_per_step=64", "rollout.group_size=8",
            "train.micro_batch_size=4"]

    def update_logits(*extra):
        p = plan(load_config(None, base + list(extra)), shape, None, opts)
        return {ph.phase: ph for ph in p.given.phases}["policy_update"].components["logits"]

    fixed = update_logits()
    seq = 512 + 512  # prompt_tokens + max_new_tokens
    assert fixed == logits_bytes(shape, 4 * seq, 4, 1, train=True)  # float32, the default
    assert update_logits(f"train.max_tokens_per_micro_batch={4 * seq}") == fixed  # the same tokens
    assert update_logits(f"train.max_tokens_per_micro_batch={2 * seq}") == logits_bytes(shape, 2 * seq, 4, 1, True)
    assert update_logits("train.max_tokens_per_micro_batch=100") == logits_bytes(shape, seq, 4, 1, True)  # one row
