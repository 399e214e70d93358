"""The presets in examples/: each loads, passes validation on the GPU count it states, fits the models
it names (TP/PP against their real head and layer counts) and, by ``cooper plan``'s own verdict, the
memory of the GPUs it states with its colocated assistant counted; the paper preset holds the
paper's settings.

A preset states where it runs in a header line ``# launch: nodes=1,2 gpus_per_node=8
gpu_memory_gib=79.18``; a preset without one is a one-process run. Model paths in presets are
placeholders (``/models/...``), so validation runs with those paths pointed at empty stand-ins.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from cooper_mcore.config import checks
from cooper_mcore.config.checks import validate
from cooper_mcore.config.schema import load_config
from cooper_mcore.parallel import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "examples").glob("*.yaml"))
CONFIGS = ROOT / "examples" / "model_configs"
POLICY_CONFIGS = {"Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b-instruct", "Llama-3.2-1B-Instruct": "llama-3.2-1b-instruct",
                  "Qwen2.5-7B-Instruct": "qwen2.5-7b-instruct", "Qwen3-30B-A3B": "qwen3-30b-a3b"}
# the RM each policy's preset trains: VerifyRM (Qwen2.5-Math-1.5B's shape) unless named here
RM_CONFIGS = {"Qwen3-30B-A3B": "qwen3-4b"}
RM_SHAPES = {"Qwen3-30B-A3B": "verifyrm-qwen3-4b"}
HEADROOM = 0.10  # of the GPU left free by the predicted peak: the planner's figures are estimates, not measured
PATH_FIELDS = [("model", "policy_ckpt"), ("model", "policy_hf"), ("model", "rm_ckpt"),
               ("data", "train_path"), ("data", "eval_path")]

# The real models' shapes (their config.json on the hub), as far as the layout depends on them.
REAL_CONFIGS = {
    "Qwen2.5-1.5B-Instruct": dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                  vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B-Instruct": dict(architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
                                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                vocab_size=152064, tie_word_embeddings=False),
    "Llama-3.2-1B-Instruct": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                  head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
    "verifyrm-qwen3-4b": dict(architectures=["Qwen3ForSequenceClassification"], num_labels=1, hidden_size=2560,
                              intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # VerifyRM: Qwen2ForSequenceClassification(num_labels=1) on Qwen2.5-Math-1.5B-Instruct
    "verifyrm": dict(architectures=["Qwen2ForSequenceClassification"], num_labels=1, hidden_size=1536,
                     intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                     vocab_size=151936, tie_word_embeddings=True),
}


def launch_line(path: Path) -> tuple[list[int], int, float]:
    """(node counts, GPUs per node, GiB per GPU) a preset states it runs on, or ([1], 1, 0.0)."""
    m = re.search(r"^# launch: nodes=([0-9,]+) gpus_per_node=(\d+) gpu_memory_gib=([0-9.]+)\b",
                  path.read_text(), flags=re.M)
    if not m:
        return [1], 1, 0.0
    return [int(n) for n in m.group(1).split(",")], int(m.group(2)), float(m.group(3))


def launch_worlds(path: Path) -> list[int]:
    """World sizes a preset states it runs on, else [1]."""
    nodes, per_node, _ = launch_line(path)
    return [n * per_node for n in nodes]


def with_stand_in_paths(cfg, tmp_path: Path):
    """Point the preset's placeholder paths (which do not exist here) at empty stand-ins of the
    right kind: data files with the same suffix, an HF folder with a ``config.json``, checkpoints
    with a ``cooper_model.json`` that records the dtype and, for the policy, only whether it has experts
    (the shapes are checked below; the expert-parallel checks need to know an MoE policy)."""
    from cooper_mcore.models.arch import ArchSpec

    real = REAL_CONFIGS.get(Path(cfg.model.policy_hf).name)
    moe = ArchSpec.from_hf_config(dict(real)).moe if real else None
    policy_arch = {"moe": dataclasses.asdict(moe)} if moe else {}
    for section, name in PATH_FIELDS:
        value = getattr(getattr(cfg, section), name)
        if value and not Path(value).exists():
            stand_in = tmp_path / section / name
            if value.endswith((".jsonl", ".parquet")):
                stand_in = stand_in.with_suffix(Path(value).suffix)
                stand_in.parent.mkdir(parents=True, exist_ok=True)
                stand_in.touch()
            else:
                stand_in.mkdir(parents=True, exist_ok=True)
                marker = "config.json" if name == "policy_hf" else "cooper_model.json"
                arch = policy_arch if name == "policy_ckpt" else {}
                (stand_in / marker).write_text(json.dumps({"arch": arch, "dtype": cfg.model.dtype}))
            setattr(getattr(cfg, section), name, str(stand_in))
    return cfg


@pytest.fixture(autouse=True)
def sglang_installed(monkeypatch):
    """The presets run on their GPU image, where SGLang is installed: counted as installed here."""
    monkeypatch.setattr(checks, "sglang_installed", lambda: True)


def test_there_are_cluster_presets():
    names = {p.name for p in PRESETS}
    assert {"qwen2.5-1.5b_8xh100.yaml", "llama3.2-1b_8xh100.yaml", "qwen2.5-7b_multinode.yaml"} <= names


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_validates_on_its_gpu_count(preset, tmp_path):
    cfg = load_config(str(preset))
    worlds = launch_worlds(preset)
    for world in worlds:
        assert world % (cfg.parallel.tp * cfg.parallel.pp) == 0, (world, cfg.parallel)
        validate(with_stand_in_paths(cfg, tmp_path), world)


@pytest.mark.parametrize("preset", [p for p in PRESETS if launch_worlds(p) != [1]], ids=lambda p: p.name)
def test_cluster_preset_layout_fits_its_models(preset):
    """TP divides the key/value heads and vocabulary, PP the layers, of the policy and of VerifyRM:
    the same checks the model builder makes, on the real models' shapes."""
    from cooper_mcore.models.arch import ArchSpec
    from cooper_mcore.models.builder import transformer_config

    cfg = load_config(str(preset))
    policy = Path(cfg.model.policy_hf).name
    assert policy in REAL_CONFIGS, f"{preset.name}: no recorded shape for {policy}"
    parallel = ParallelConfig(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep, etp=cfg.parallel.etp,
                              sequence_parallel=cfg.parallel.sequence_parallel)
    for name in (policy, RM_SHAPES.get(policy, "verifyrm")):
        arch = ArchSpec.from_hf_config(dict(REAL_CONFIGS[name]))
        # a dense RM next to an MoE policy has no experts: only its TP/PP apply (the builder still
        # refuses ep > 1 for a dense model; rl/setup.py must pass ep=etp=1 for it, docs/moe.md)
        layout = parallel if arch.moe is not None else dataclasses.replace(parallel, ep=1, etp=1)
        config = transformer_config(arch, layout, torch.bfloat16, init_weights=False)
        assert config.num_layers // parallel.pp * parallel.pp == config.num_layers
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.engine == "sglang"
    assert cfg.model.policy_hf.startswith("/models/"), "model paths are the documented placeholders"
    for world in launch_worlds(preset):
        assert world % 8 == 0, "whole 8-GPU nodes"


def test_layout_check_rejects_a_tp_the_reward_model_cannot_split():
    """TP=4 would split the policy (4 kv heads) but not VerifyRM (2 kv heads)."""
    from cooper_mcore.models.arch import ArchSpec
    from cooper_mcore.models.builder import transformer_config

    transformer_config(ArchSpec.from_hf_config(dict(REAL_CONFIGS["Qwen2.5-7B-Instruct"])), ParallelConfig(tp=4))
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp=4"):
        transformer_config(ArchSpec.from_hf_config(dict(REAL_CONFIGS["verifyrm"])), ParallelConfig(tp=4))


def test_paper_preset_has_the_paper_settings():
    cfg = load_config(str(ROOT / "examples" / "qwen2.5-1.5b_8xh100.yaml"))
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.clip_grad) == (1e-6, 20, 1.0)
    assert (cfg.rollout.group_size, cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.max_new_tokens) == \
        (16, 1.0, 1.0, 512)
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.kl_coef, cfg.algo.kl_kind, cfg.algo.entropy_coef) == \
        (0.2, 0.2, 1e-3, "low_var_kl", 0.0)
    assert cfg.algo.clip_ratio_c == 3.0
    assert (cfg.rm.optim.lr, cfg.rm.optim.weight_decay, cfg.rm.optim.clip_grad) == (1e-5, 0.01, 1.0)
    assert cfg.rm.optim.warmup_steps == round(0.01 * cfg.train.steps)  # ~1% warm-up
    assert (cfg.reward.mode, cfg.rm.negatives, cfg.model.dtype, cfg.rollout.engine) == \
        ("cooper", "assistant", "bfloat16", "sglang")
    assert (cfg.eval.k, cfg.eval.temperature, cfg.eval.top_p) == (8, 0.7, 0.95)
    assert (cfg.parallel.tp, cfg.parallel.pp, launch_worlds(ROOT / "examples" / "qwen2.5-1.5b_8xh100.yaml")) == \
        (1, 1, [8])


@pytest.mark.parametrize("preset", [p for p in PRESETS if launch_worlds(p) != [1]], ids=lambda p: p.name)
def test_assistant_colocated_by_default_and_separate_by_override(preset, tmp_path):
    from cooper_mcore.llm_client import chat_completions_url

    cfg = load_config(str(preset))
    assert cfg.rm.negatives == "assistant" and cfg.rm.assistant_model
    # colocated: the launchers start the assistant's SGLang server on every node at this address
    assert chat_completions_url(cfg.rm.assistant_url) == "http://127.0.0.1:30010/v1/chat/completions"
    separate = load_config(str(preset), ["rm.assistant_url=http://assistant-host:30000"])
    assert chat_completions_url(separate.rm.assistant_url) == "http://assistant-host:30000/v1/chat/completions"
    validate(with_stand_in_paths(separate, tmp_path), launch_worlds(preset)[0])
    without = load_config(str(preset))
    without.rm.assistant_url = ""
    with pytest.raises(ValueError, match="assistant_url"):
        validate(with_stand_in_paths(without, tmp_path), launch_worlds(preset)[0])


def test_a_layout_that_does_not_divide_the_gpus_is_rejected(tmp_path):
    cfg = load_config(str(ROOT / "examples" / "qwen2.5-7b_multinode.yaml"), ["parallel.pp=3"])
    with pytest.raises(ValueError, match="not divisible by tp\\*pp"):
        validate(with_stand_in_paths(cfg, tmp_path), 16)


def test_placeholders_are_documented():
    readme = (ROOT / "examples" / "README.md").read_text()
    for preset in PRESETS:
        if launch_worlds(preset) == [1]:
            continue
        cfg = load_config(str(preset))
        assert preset.name in readme, preset.name
        for section, name in PATH_FIELDS:
            value = getattr(getattr(cfg, section), name)
            assert value.split("/")[1] in ("models", "ckpt", "data"), value
            assert value in readme, f"{preset.name}: {section}.{name}={value} is not in examples/README.md"


def test_the_examples_readme_calls_no_rehearsed_preset_unfinished():
    """Every preset is rehearsed on CPU (tests/rehearsal): the README must not call one planned only or
    work in progress (it did for the MoE preset after it ran)."""
    readme = (ROOT / "examples" / "README.md").read_text()
    stale = [phrase for phrase in ("work in progress", "planned, not run", "is planned (`cooper plan`), not run")
             if phrase in readme]
    assert not stale, stale


def test_each_sglang_engine_starts_on_its_own_gpu(monkeypatch):
    """One engine per model-parallel group: on the group leader's GPU (``base_gpu_id``), not GPU 0."""
    from cooper_mcore.rl import setup as run_setup

    seen = []
    monkeypatch.setattr(run_setup.SGLangEngine, "offline", classmethod(lambda cls, config: seen.append(config)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 6)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node
    cfg = load_config(str(ROOT / "examples" / "qwen2.5-7b_multinode.yaml"))
    run_setup.build_engine(cfg, policy=None)  # SGLang starts from model.policy_hf
    assert len(seen) == 1
    assert (seen[0].base_gpu_id, seen[0].tp_size, seen[0].dtype) == (6, 2, "bfloat16")
    assert seen[0].model_path == "/models/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("preset", [p for p in PRESETS if launch_worlds(p) != [1]], ids=lambda p: p.name)
def test_preset_fits_its_gpus_with_its_colocated_assistant(preset, capsys):
    """`cooper plan`'s verdict on every node count the preset states, as a user runs it: the colocated
    assistant the launcher starts is counted (its derived --mem-fraction-static, TP = parallel.tp), and
    the peak leaves HEADROOM of the GPU free."""
    from cooper_mcore.cli import main

    cfg = load_config(str(preset))
    policy = POLICY_CONFIGS[Path(cfg.model.policy_hf).name]
    rm = RM_CONFIGS.get(Path(cfg.model.policy_hf).name, "qwen2.5-1.5b-instruct")
    nodes, per_node, gib = launch_line(preset)
    assert gib > 0, f"{preset.name}: the launch line states no GPU memory"
    for n in nodes:
        # VerifyRM's backbone (Qwen2.5-Math-1.5B-Instruct) has Qwen2.5-1.5B-Instruct's shape
        assert main(["plan", "--config", str(preset), "--nodes", str(n), "--gpus-per-node", str(per_node),
                     "--gpu-memory-gib", str(gib), "--policy-config", str(CONFIGS / f"{policy}.json"),
                     "--rm-config", str(CONFIGS / f"{rm}.json"), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        peak = doc["as_configured"]["peak"]
        assert doc["fits"] is True and doc["needed_overrides"] == {}, (n, peak, doc["as_configured"]["problems"])
        assert peak["gib"] <= (1 - HEADROOM) * gib, (n, peak)
        assert doc["cluster"]["world_size"] == per_node * n
        assert doc["engine"]["tokens_at_once"] >= 512 + 512  # SGLang's KV pool holds at least one sequence
        asst = doc["assistant"]  # the presets' assistants are colocated: counted, and able to start
        assert asst is not None and asst["tp"] == cfg.parallel.tp and asst["tokens_at_once"] >= 65_536, asst
        assert asst["mem_fraction_static"] >= asst["min_mem_fraction_static"]
        components = doc["as_configured"]["phases"][0]["components_gib"]
        assert components["assistant_weights"] > 0 and components["contexts"] >= 3 * 0.75


def test_micro_batch_8_did_not_fit_with_the_assistant(capsys):
    """The old 1.5B setting (micro-batch 8) passes only when the assistant is left out: what the issue found.
    Its peak was the policy update's full-vocabulary fp32 logits; with the loss in chunks it is the
    reward model's update (8 pairs of 1024-token rows of activations)."""
    from cooper_mcore.cli import main

    preset = ROOT / "examples" / "qwen2.5-1.5b_8xh100.yaml"
    args = ["plan", "--config", str(preset), "--gpus-per-node", "8", "--gpu-memory-gib", "79.18", "--policy-config",
            str(CONFIGS / "qwen2.5-1.5b-instruct.json"), "--rm-config", str(CONFIGS / "qwen2.5-1.5b-instruct.json"),
            "--json", "train.micro_batch_size=8", "train.max_tokens_per_micro_batch=0", "train.pack_sequences=false"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] is False and doc["as_configured"]["peak"]["phase"] == "rm_update"
    assert main(args + ["rm.assistant_url=http://assistant-host:30000"]) == 0  # the assistant elsewhere
    assert json.loads(capsys.readouterr().out)["assistant"] is None
