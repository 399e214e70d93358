"""Config validation: impossible layouts, batch sizes that do not divide, bad choices and missing
paths are all reported together, in one ValueError, before any work starts (what `cooper train` and
`cooper train-rm` then print are cases of the bad-input tier, ``tests/badinput/settings.py``)."""

from __future__ import annotations

import json
import os

import pytest

from cooper_mcore.config import checks
from cooper_mcore.config.checks import config_problems, validate
from cooper_mcore.config.schema import load_config


def _ckpt(path, heads=4, kv=2, layers=4, vocab=128, dtype="float32"):
    os.makedirs(path)
    arch = {"num_layers": layers, "num_attention_heads": heads, "num_query_groups": kv, "vocab_size": vocab,
            "hidden_size": 32}
    with open(os.path.join(path, "cooper_model.json"), "w") as f:
        json.dump({"arch": arch, "hf_config": {}, "dtype": dtype}, f)
    return str(path)


@pytest.fixture
def paths(tmp_path):
    hf = tmp_path / "policy_hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "1+1", "answer": "2"}\n')
    return {"model.policy_ckpt": _ckpt(tmp_path / "policy"), "model.rm_ckpt": _ckpt(tmp_path / "rm"),
            "model.policy_hf": str(hf), "data.train_path": str(train), "data.eval_path": str(train)}


def _cfg(paths, *overrides):
    base = [f"{k}={v}" for k, v in paths.items()]
    return load_config(None, base + ["rm.negatives=perturb", "train.prompts_per_step=8", "rollout.group_size=4",
                                     "train.micro_batch_size=4", *overrides])


def test_a_good_config_has_no_problem(paths):
    cfg = _cfg(paths)
    assert config_problems(cfg, 1) == []
    validate(cfg, 1)
    # 8 prompts / dp 2 * G 4 = 16 sequences per rank = 4 micro-batches of 4; heads 4, kv 2, vocab 128 by tp 2
    assert config_problems(_cfg(paths, "parallel.tp=2"), 4) == []
    assert config_problems(_cfg(paths, "parallel.pp=4"), 4) == []  # 4 layers over 4 stages, dp 1


def test_every_problem_is_listed_in_one_error(paths):
    cfg = _cfg({**paths, "data.train_path": "/nonexistent/train.jsonl"}, "reward.mode=cooperative",
               "parallel.tp=3", "rollout.group_size=1", "rollout.top_p=0", "algo.kl_kind=k9", "data.template=Question",
               "algo.clip_ratio_c=1")
    with pytest.raises(ValueError) as info:
        validate(cfg, 4)
    msg = str(info.value)
    lines = [ln for ln in msg.splitlines() if ln.startswith("  - ")]
    assert msg.startswith(f"invalid config ({len(lines)} problems):")
    expected = ["reward.mode must be one of", "algo.kl_kind must be one of", "rollout.group_size must be >= 2, got 1",
                "rollout.top_p must be in (0, 1], got 0.0", "data.template 'Question' has no {question}",
                "algo.clip_ratio_c must be > 1 (or null: no dual clip), got 1.0",
                "the world size 4 is not divisible by tp*pp = 3*1",
                "data.train_path: '/nonexistent/train.jsonl' does not exist"]
    for name in ("policy_ckpt", "rm_ckpt"):  # the fixture's models (4 heads, 2 kv heads, vocab 128) at tp 3
        expected += [f"model.{name} ({paths['model.' + name]}) has {n}, not divisible by parallel.tp=3"
                     for n in ("4 attention heads", "2 key/value heads", "128 vocabulary entries")]
    for e in expected:
        assert sum(e in ln for ln in lines) == 1, (e, msg)
    assert len(lines) == len(expected)


def test_layout_against_the_architecture(paths, tmp_path):
    # policy: 3 layers, 6 heads, 3 kv heads, vocab 100; rm: the fixture's (4 layers, 4/2 heads, vocab 128)
    paths = {**paths, "model.policy_ckpt": _ckpt(tmp_path / "odd", heads=6, kv=3, layers=3, vocab=100)}
    problems = config_problems(_cfg(paths, "parallel.tp=4", "parallel.pp=2", "train.prompts_per_step=1"), 8)
    pol = f"model.policy_ckpt ({paths['model.policy_ckpt']}) has"
    rm = f"model.rm_ckpt ({paths['model.rm_ckpt']}) has"
    assert problems == [
        f"{pol} 6 attention heads, not divisible by parallel.tp=4",
        f"{pol} 3 key/value heads, not divisible by parallel.tp=4",
        f"{pol} 3 layers, not divisible by parallel.pp=2",
        f"{rm} 2 key/value heads, not divisible by parallel.tp=4",
    ]
    # rule mode does not read the RM
    assert all("rm_ckpt" not in p for p in config_problems(
        _cfg(paths, "parallel.tp=4", "parallel.pp=2", "train.prompts_per_step=1", "reward.mode=rule"), 8))


@pytest.mark.parametrize("overrides, world, expected", [
    # dp = 4 / (1*1) = 4; 6 prompts do not split over 4 ranks
    (["train.prompts_per_step=6"], 4, "train.prompts_per_step=6 is not divisible by the data-parallel size 4"),
    # dp 2: 8 / 2 * 4 = 16 sequences per rank; 16 % (3*1) != 0
    (["train.micro_batch_size=3"], 2, "16 sequences per data-parallel rank (prompts_per_step 8 / dp 2 * group_size 4)"
                                      " are not divisible by micro_batch_size*mini_batches = 3*1"),
    # dp 1: 32 per rank; 32 % (4*3) != 0
    (["train.mini_batches=3"], 1, "32 sequences per data-parallel rank"),
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel needs parallel.tp > 1"),
    (["train.micro_batch_size=0"], 1, "train.micro_batch_size must be >= 1, got 0"),
])
def test_batch_sizes_that_do_not_divide(paths, overrides, world, expected):
    problems = config_problems(_cfg(paths, *overrides), world)
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("value, problems", [
    ("3", []), ("1.5", []), ("null", []),  # null turns the dual clip off
    ("1", ["algo.clip_ratio_c must be > 1 (or null: no dual clip), got 1.0"]),
    ("0", ["algo.clip_ratio_c must be > 1 (or null: no dual clip), got 0.0"]),
    ("0.5", ["algo.clip_ratio_c must be > 1 (or null: no dual clip), got 0.5"]),
])
def test_the_dual_clip_is_above_one_or_off(paths, value, problems):
    cfg = _cfg(paths, f"algo.clip_ratio_c={value}")
    assert cfg.algo.clip_ratio_c == (None if value == "null" else float(value))
    assert config_problems(cfg, 1) == problems


def test_paths_and_their_kinds(paths, tmp_path):
    not_ckpt = tmp_path / "plain"
    not_ckpt.mkdir()
    odd_data = tmp_path / "train.csv"
    odd_data.write_text("q,a\n")
    cfg = _cfg({**paths, "model.policy_ckpt": str(not_ckpt), "model.policy_hf": str(not_ckpt),
                "data.train_path": str(odd_data), "model.rm_ckpt": "''"}, "eval.every=2", "data.eval_path=''",
               "checkpoint.resume=/no/such/step")
    problems = config_problems(cfg, 1)
    assert problems == [
        "model.rm_ckpt is not set",
        "data.eval_path is not set",
        f"model.policy_ckpt: {str(not_ckpt)!r} is not a cooper_mcore checkpoint (no cooper_model.json; "
        "make one with `cooper convert hf-to-mcore`)",
        f"model.policy_hf: {str(not_ckpt)!r} has no config.json (an HF model folder is expected)",
        f"data.train_path: {str(odd_data)!r} is neither JSONL (.jsonl/.json/.ndjson) nor Parquet (.parquet/.pq)",
        "checkpoint.resume must be 'none', 'auto' or a checkpoint folder; got '/no/such/step'",
    ]


def test_a_data_directory_is_named_as_one(paths, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    problems = config_problems(_cfg({**paths, "data.train_path": str(folder)}), 1)
    assert problems == [f"data.train_path: {str(folder)!r} is a directory, expected a .jsonl or .parquet file"]


def _hf_config(folder, **fields):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, **fields}
    (folder / "config.json").write_text(json.dumps(cfg))


def test_policy_checkpoint_and_policy_hf_must_be_the_same_model(paths, tmp_path):
    hf = tmp_path / "policy_hf"
    _hf_config(hf)  # the fixture's checkpoint: vocab 128, hidden 32, 4 layers, 4 heads, 2 kv heads
    assert config_problems(_cfg(paths), 1) == []
    _hf_config(hf, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_key_value_heads=None)
    problems = config_problems(_cfg(paths), 1)
    assert problems == [
        f"model.policy_ckpt ({paths['model.policy_ckpt']}) and model.policy_hf ({hf}) are not the same model "
        "(checkpoint vs config.json: vocab_size 128 vs vocab_size 256, hidden_size 32 vs hidden_size 64, "
        "num_layers 4 vs num_hidden_layers 2, num_query_groups 2 vs num_key_value_heads 4); the rollout engine "
        "starts from model.policy_hf and receives the checkpoint's weights: convert model.policy_hf with `cooper "
        "convert hf-to-mcore`, or export the checkpoint with `cooper convert mcore-to-hf` and point "
        "model.policy_hf at it"]
    with pytest.raises(ValueError, match=r"^invalid config: model.policy_ckpt .* are not the same"):
        validate(_cfg(paths), 1)


def test_broken_json_metadata_is_listed_with_file_and_line(paths, tmp_path):
    (tmp_path / "policy_hf" / "config.json").write_text('{"vocab_size": 128,\n "hidden_size": }')
    (tmp_path / "rm" / "cooper_model.json").write_text("{\n\n[")
    problems = config_problems(_cfg(paths), 1)
    assert problems == [
        f"model.rm_ckpt: {tmp_path / 'rm' / 'cooper_model.json'} is not valid JSON: Expecting property name "
        "enclosed in double quotes at line 3, column 1; fix or restore the file",
        f"model.policy_hf: {tmp_path / 'policy_hf' / 'config.json'} is not valid JSON: Expecting value at line 2, "
        "column 17; fix or restore the file"]


def test_assistant_settings_and_dtype(paths):
    problems = config_problems(_cfg(paths, "rm.negatives=assistant", "rm.on_assistant_failure=retry",
                                    "rm.assistant_max_retries=-1", "model.dtype=bfloat16"), 1)
    assert problems == [
        "rm.on_assistant_failure must be one of ('mask', 'stop'), got 'retry'",
        "rm.negatives=assistant needs rm.assistant_url (or choose negatives policy/perturb/random)",
        "rm.negatives=assistant needs rm.assistant_model (or choose negatives policy/perturb/random)",
        "rm.assistant_max_retries must be >= 0, got -1",
        f"model.dtype=bfloat16 but {paths['model.policy_ckpt']} holds float32 weights; convert the checkpoint in "
        "the dtype you train in",
    ]


def _moe_ckpt(path, experts=8, expert_ffn=32, **pattern):
    ckpt = _ckpt(path)
    meta_path = os.path.join(ckpt, "cooper_model.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["arch"]["moe"] = {"num_experts": experts, "experts_per_token": 2, "expert_ffn_hidden_size": expert_ffn,
                           **pattern}
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return ckpt


def test_expert_parallel_layout(paths, tmp_path):
    """ep/etp against the world size and the models: experts must split over ep, the expert FFN over
    etp; a dense RM beside an MoE policy is built without the expert layout, two dense models are named."""
    moe = {**paths, "model.policy_ckpt": _moe_ckpt(tmp_path / "moe_policy"),
           "model.rm_ckpt": _moe_ckpt(tmp_path / "moe_rm")}
    assert config_problems(_cfg(moe, "parallel.ep=2"), 2) == []
    assert config_problems(_cfg(moe, "parallel.ep=4", "parallel.etp=2"), 8) == []
    assert config_problems(_cfg(moe, "parallel.ep=4"), 2) == [
        "the world size 2 is not divisible by the expert layout etp*ep*pp = 1*4*1"]
    odd = {**moe, "model.policy_ckpt": _moe_ckpt(tmp_path / "odd", experts=6, expert_ffn=33)}
    pol = f"model.policy_ckpt ({odd['model.policy_ckpt']}) has"
    assert config_problems(_cfg(odd, "parallel.ep=4", "parallel.etp=2", "train.prompts_per_step=8"), 8) == [
        f"{pol} 6 experts per sparse layer, not divisible by parallel.ep=4",
        f"{pol} experts of FFN size 33, not divisible by parallel.etp=2"]
    dense_rm = {**moe, "model.rm_ckpt": paths["model.rm_ckpt"]}
    assert config_problems(_cfg(dense_rm, "parallel.ep=2"), 2) == []
    assert config_problems(_cfg(paths, "parallel.ep=2"), 2) == [
        f"parallel.ep=2 needs a mixture-of-experts model, but model.policy_ckpt ({paths['model.policy_ckpt']})"
        f" and model.rm_ckpt ({paths['model.rm_ckpt']}) are dense"]
    # rule mode does not read the RM; a dense policy is refused all the same
    assert config_problems(_cfg(dense_rm, "parallel.ep=2", "reward.mode=rule"), 2) == []
    assert len(config_problems(_cfg(paths, "parallel.ep=2", "reward.mode=rule"), 2)) == 1
    assert config_problems(_cfg(moe, "parallel.tp=2", "parallel.sequence_parallel=true"), 2) == []
    assert config_problems(_cfg(moe, "parallel.tp=2", "reward.mode=rule"), 2) == [
        f"model.policy_ckpt ({moe['model.policy_ckpt']}) is a mixture-of-experts model: parallel.tp=2 needs "
        "parallel.sequence_parallel=true (megatron's MoE layer refuses to train without it)"]
    assert config_problems(_cfg(moe, "parallel.ep=0"), 2) == [
        "parallel.ep and parallel.etp must be >= 1, got ep=0 etp=1"]


def test_routing_replay_needs_a_moe_policy(paths, tmp_path):
    moe = {**paths, "model.policy_ckpt": _moe_ckpt(tmp_path / "moe_policy")}
    assert config_problems(_cfg(moe, "model.moe_routing_replay=true", "reward.mode=rule"), 1) == []
    assert config_problems(_cfg(paths, "model.moe_routing_replay=true", "reward.mode=rule"), 1) == [
        f"model.moe_routing_replay needs a mixture-of-experts policy; model.policy_ckpt "
        f"({paths['model.policy_ckpt']}) is dense"]


def test_expert_layouts_that_would_drift_are_refused(paths, tmp_path):
    """At ep=1 megatron reduces expert gradients over the data-parallel group only: with etp != tp the
    experts' copies on a TP group's ranks would never be reduced. etp follows tp unless set."""
    moe = {**paths, "model.policy_ckpt": _moe_ckpt(tmp_path / "moe_policy")}
    sp = "parallel.sequence_parallel=true"
    assert config_problems(_cfg(moe, "parallel.tp=2", sp, "reward.mode=rule"), 2) == []  # etp follows tp
    assert config_problems(_cfg(moe, "parallel.tp=2", "parallel.ep=2", "parallel.etp=1", sp, "reward.mode=rule",
                                "train.prompts_per_step=2"), 4) == []
    assert config_problems(_cfg(moe, "parallel.tp=2", "parallel.etp=1", sp, "reward.mode=rule"), 2) == [
        f"model.policy_ckpt ({moe['model.policy_ckpt']}) is a mixture-of-experts model: parallel.etp=1 with "
        "parallel.tp=2 at parallel.ep=1 would let the experts' copies on the TP ranks drift apart (megatron "
        "reduces expert gradients over the data-parallel group only at ep=1): set parallel.etp=2 (or leave it "
        "unset) or parallel.ep > 1"]
    assert len(config_problems(_cfg(moe, "parallel.etp=2", "reward.mode=rule"), 2)) == 1  # etp > tp at ep=1
    # a dense model ignores the expert layout
    assert config_problems(_cfg(paths, "parallel.tp=2", "parallel.etp=1", "reward.mode=rule"), 2) == []


@pytest.fixture
def sglang_here(monkeypatch):
    """SGLang counted as installed (the CPU venv has none): the checks of its settings alone."""
    monkeypatch.setattr(checks, "sglang_installed", lambda: True)


def test_sglang_refuses_a_moe_policy_with_dense_layers(paths, tmp_path, sglang_here):
    """SGLang's Qwen3-MoE builds every layer sparse: a policy with dense layers would be served wrong."""
    mixed = _moe_ckpt(tmp_path / "mixed", mlp_only_layers=[3], decoder_sparse_step=1)
    sparse = _moe_ckpt(tmp_path / "sparse", mlp_only_layers=[], decoder_sparse_step=1)
    assert config_problems(_cfg({**paths, "model.policy_ckpt": mixed}, "rollout.engine=hf"), 1) == []
    assert config_problems(_cfg({**paths, "model.policy_ckpt": sparse}, "rollout.engine=sglang"), 1) == []
    assert config_problems(_cfg({**paths, "model.policy_ckpt": mixed}, "rollout.engine=sglang"), 1) == [
        f"model.policy_ckpt ({mixed}) is a Qwen3-MoE with dense layers (mlp_only_layers=[3], decoder_sparse_step=1), "
        "which SGLang serves as all-sparse; use rollout.engine=hf, or a model whose layers are all sparse"]


def test_sglang_base_port_in_range(paths, sglang_here):
    assert config_problems(_cfg(paths, "rollout.engine=sglang", "rollout.sglang_base_port=31000"), 1) == []
    assert config_problems(_cfg(paths, "rollout.engine=hf", "rollout.sglang_base_port=80"), 1) == []
    assert config_problems(_cfg(paths, "rollout.engine=sglang", "rollout.sglang_base_port=80"), 1) == [
        "rollout.sglang_base_port must be in 1024..60000 (each local rank takes 10 ports above it), got 80"]


# ----------------------------------------------------------------------------- the other jobs' configs


def _job(cls, *overrides):
    from cooper_mcore.config.schema import SFTConfig, VerifyRMConfig  # noqa: F401 - cls is one of them

    return load_config(None, list(overrides), cls=cls)


def test_sft_configs_go_through_the_same_checks(tmp_path):
    from cooper_mcore.config.schema import SFTConfig

    ckpt = _ckpt(tmp_path / "policy", heads=4, kv=2, layers=4)
    good = _job(SFTConfig, f"ckpt={ckpt}", "train.global_batch_size=8", "train.micro_batch_size=4")
    validate(good, 1)
    validate(good, 2)  # 8 = 4 * dp 2
    bad = _job(SFTConfig, f"ckpt={ckpt}", "data.style=latex", "train.steps=0", "optim.lr=0", "train.min_lr=1",
               "data.mix_wrong=1.5", "data.template=Q", "parallel.tp=3", "train.global_batch_size=6",
               "train.micro_batch_size=4")
    with pytest.raises(ValueError) as info:
        validate(bad, 3)
    msg = str(info.value)
    lines = [ln for ln in msg.splitlines() if ln.startswith("  - ")]
    assert msg.startswith(f"invalid config ({len(lines)} problems):")
    for want in ("data.style must be one of ('boxed', 'gsm8k', 'boxed_period'), got 'latex'",
                 "train.steps must be >= 1, got 0",
                 "optim.lr must be > 0, got 0.0", "train.min_lr must be in [0, optim.lr=0.0]",
                 "data.mix_wrong must be in [0, 1], got 1.5", "data.template 'Q' has no {question} placeholder",
                 f"ckpt ({ckpt}) has 4 attention heads, not divisible by parallel.tp=3",
                 "train.global_batch_size=6 is not a multiple of train.micro_batch_size * the data-parallel size "
                 "= 4 * 1"):
        assert any(want in ln for ln in lines), (want, lines)
    with pytest.raises(ValueError, match=r"ckpt: '/missing' does not exist"):
        validate(_job(SFTConfig, "ckpt=/missing"), 1)


def test_verify_rm_configs_go_through_the_same_checks(tmp_path):
    from cooper_mcore.config.schema import VerifyRMConfig

    ckpt = _ckpt(tmp_path / "rm", heads=4, kv=2, layers=3)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "q", "reference": "1", "completion": "1", "label": true}\n')
    good = _job(VerifyRMConfig, f"ckpt={ckpt}", f"data.train_path={rows}", "train.global_batch_size=4",
                "train.micro_batch_size=2")
    validate(good, 2)
    bad = _job(VerifyRMConfig, f"ckpt={ckpt}", f"data.train_path={tmp_path}", "data.eval_path=/missing.jsonl",
               "data.eval_format=csv", "train.epochs=0", "optim.warmup_steps=3", "train.threshold=1.0",
               "parallel.pp=2", "train.global_batch_size=4", "train.micro_batch_size=4")
    with pytest.raises(ValueError) as info:
        validate(bad, 2)
    lines = [ln for ln in str(info.value).splitlines() if ln.startswith("  - ")]
    for want in ("data.eval_format must be one of ('auto', 'labeled', 'verifybench'), got 'csv'",
                 "train.epochs must be >= 1, got 0", "optim.warmup_steps must be 0",
                 "train.threshold must be in (0, 1)",
                 f"data.train_path: '{tmp_path}' is a directory", "data.eval_path: '/missing.jsonl' does not exist",
                 f"ckpt ({ckpt}) has 3 layers, not divisible by parallel.pp=2"):
        assert any(want in ln for ln in lines), (want, lines)
