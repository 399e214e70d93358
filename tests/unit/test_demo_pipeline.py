"""The demo pipeline: its content cache, its helpers, and a smoke run of every stage (`--preset smoke`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cooper_mcore.convert.checkpoint import mcore_to_hf
from cooper_mcore.demo.config import load_demo_config
from cooper_mcore.demo.kinds import completion_kind, kind_shares
from cooper_mcore.demo.pipeline import (
    STAGE_FILE,
    hack_examples,
    mode_params,
    rm_data_params,
    run_stage,
    with_blind_spot,
    write_jsonl,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_stage_cache_reuses_and_keys_by_content(tmp_path):
    calls = []

    def fn(folder):
        calls.append(folder)
        with open(os.path.join(folder, "out.txt"), "w") as f:
            f.write("x")
        return {"n": len(calls)}

    a = run_stage(str(tmp_path), "a", {"lr": 1.0}, [], fn)
    again = run_stage(str(tmp_path), "a", {"lr": 1.0}, [], fn)
    assert len(calls) == 1 and again.path == a.path and again.info["n"] == 1
    other = run_stage(str(tmp_path), "a", {"lr": 2.0}, [], fn)  # a setting changed: a new folder
    assert len(calls) == 2 and other.path != a.path
    b1 = run_stage(str(tmp_path), "b", {}, [a], fn)
    b2 = run_stage(str(tmp_path), "b", {}, [other], fn)  # same settings, different input: re-run
    assert len(calls) == 4 and b1.path != b2.path


def test_stage_cache_reruns_an_unfinished_folder(tmp_path):
    def fails(folder):
        with open(os.path.join(folder, "half.txt"), "w") as f:
            f.write("partial")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_stage(str(tmp_path), "s", {}, [], fails)
    (folder,) = [p for p in tmp_path.iterdir()]
    assert not (folder / STAGE_FILE).exists()  # no marker: not reused
    done = run_stage(str(tmp_path), "s", {}, [], lambda d: {"ok": sorted(os.listdir(d))})
    assert done.path == str(folder) and done.info["ok"] == []  # the partial file was removed first


def test_hack_examples_are_the_distinct_rule_wrong_ones_the_rm_rewards_most(tmp_path):
    rows = [{"question": "1+1=", "reference": "2", "completion": c, "label": lab}
            for c, lab in (("a", True), ("b", False), ("c", False), ("d", False), ("d", False))]
    preds = [{"prob": p} for p in (0.99, 0.7, 0.2, 0.9, 0.9)]  # "d" sampled twice: shown once
    write_jsonl(str(tmp_path / "s.jsonl"), rows)
    write_jsonl(str(tmp_path / "p.jsonl"), preds)
    hacks = hack_examples(str(tmp_path / "s.jsonl"), str(tmp_path / "p.jsonl"), limit=5)
    assert [h["completion"] for h in hacks] == ["d", "b", "c"]  # rule-wrong only, highest RM reward first
    assert [h["rm_reward"] for h in hacks] == [0.9, 0.7, 0.2]
    assert [h["completion"] for h in hack_examples(str(tmp_path / "s.jsonl"), str(tmp_path / "p.jsonl"), 1)] == ["d"]


def test_demo_config_presets_and_overrides():
    cfg = load_demo_config(None, ["rl.steps=7", "task.max_operand=19", "cooper.negative_pick=hardest"])
    assert cfg.rl.steps == 7 and cfg.task.max_operand == 19 and cfg.cooper.negative_pick == "hardest"
    assert cfg.seeds == [0]
    full = load_demo_config("full")
    assert full.rl.steps > cfg.rl.steps and full.task.n_eval >= 500 and len(full.seeds) >= 3
    with pytest.raises(ValueError, match="no_such"):
        load_demo_config(None, ["rl.no_such=1"])
    with pytest.raises(ValueError, match="preset"):
        load_demo_config("huge")
    with pytest.raises(ValueError, match="hard"):  # a choice outside the Literal's
        load_demo_config(None, ["cooper.negative_pick=hard"])
    with pytest.raises(ValueError, match="distinct"):
        load_demo_config(None, ["seeds=[1,1]"])
    with pytest.raises(ValueError, match="rm.init=sft"):  # the RM made from the policy has the policy's size
        load_demo_config(None, ["model.rm_hidden=32"])
    assert load_demo_config(None, ["model.rm_hidden=32", "rm.init=random"]).model.rm_hidden == 32
    with pytest.raises(ValueError, match="head_std"):
        load_demo_config(None, ["rm.head_std=-0.1"])


def test_rm_training_settings_do_not_resample_the_rm_data():
    base = load_demo_config()
    for change in ("rm.init=random", "rm.head_std=0.02", "rm.lr=1e-3", "rm.epochs=2"):
        assert rm_data_params(load_demo_config(None, [change]), 0) == rm_data_params(base, 0), change
    assert rm_data_params(load_demo_config(None, ["rm.blind_spot=slip"]), 0) != rm_data_params(base, 0)


def test_rl_stage_keys_hold_only_the_settings_their_mode_reads():
    base = load_demo_config()
    coop = load_demo_config(None, ["cooper.anchor_weight=0.5"])
    transform = load_demo_config(None, ["rl.rm_transform=sigmoid"])
    for mode in ("rule", "static_rm"):  # a Cooper setting re-runs the Cooper runs only
        assert mode_params(coop, mode, 0) == mode_params(base, mode, 0)
    assert mode_params(coop, "cooper", 0) != mode_params(base, "cooper", 0)
    assert mode_params(transform, "rule", 0) == mode_params(base, "rule", 0)  # the rule reward has no RM
    assert mode_params(transform, "static_rm", 0) != mode_params(base, "static_rm", 0)
    assert mode_params(base, "rule", 1) != mode_params(base, "rule", 0)
    hacks = load_demo_config(None, ["eval.hack_examples=9"])  # read at report time only
    assert all(mode_params(hacks, m, 0) == mode_params(base, m, 0) for m in ("rule", "static_rm", "cooper"))


@pytest.mark.parametrize("completion,correct,kind", [
    ("7-1=6,6-1=5 \\boxed{5}", True, "correct"),
    ("7-1=6,6-1=5 \\boxed{6}", False, "intermediate"),  # right chain, the first result boxed
    ("7-1=6,6-1=4 \\boxed{6}", False, "intermediate"),  # a slipped chain, an earlier result boxed
    ("7-1=6,6-1=4 \\boxed{4}", False, "slip"),  # a wrong step, its own result boxed
    ("7-1=5,5-1=4 \\boxed{4}", False, "slip"),  # a slip carried on consistently
    ("7-1=6,6-1=5 \\boxed{7}", False, "other"),  # no result of the chain
    ("0+0=0,0+0=0 \\boxed{0}", False, "other"),  # another chain than the question's
    ("7+1=8,8-1=7 \\boxed{7}", False, "other"),  # another operator
    ("7-1=6 \\boxed{6}", False, "other"),  # a step missing
    ("7-1=6,6-1=5", False, "other"),  # nothing boxed
    ("7-1=6,6-1=5 \\boxed{5} \\boxed{5}", False, "other"),  # two answers
])
def test_completion_kinds(completion, correct, kind):
    assert completion_kind("7-1-1=", completion, correct) == kind


def test_kind_shares_cover_every_kind():
    rows = [("7-1-1=", "7-1=6,6-1=5 \\boxed{5}", True), ("7-1-1=", "7-1=6,6-1=5 \\boxed{6}", False),
            ("7-1-1=", "x", False), ("7-1-1=", "y", False)]
    assert kind_shares(rows) == {"correct": 0.25, "intermediate": 0.25, "slip": 0.0, "other": 0.5}
    assert completion_kind("not a question", "7-1=6 \\boxed{6}", False) == "other"


def test_blind_spot_relabels_only_the_rule_wrong_rows_of_its_kind():
    rows = [{"question": "7-1-1=", "completion": c, "label": ok} for c, ok in [
        ("7-1=6,6-1=5 \\boxed{5}", True), ("7-1=6,6-1=5 \\boxed{6}", False),  # correct, intermediate
        ("7-1=6,6-1=4 \\boxed{4}", False), ("x", False)]]  # slip, other
    assert with_blind_spot(rows, "none") is rows
    lenient = with_blind_spot(rows, "intermediate")
    assert [x["label"] for x in lenient] == [True, True, False, False]
    assert [x.get("blind_spot", False) for x in lenient] == [False, True, False, False]
    assert [x["label"] for x in with_blind_spot(rows, "slip")] == [True, False, True, False]
    assert [x["label"] for x in rows] == [True, False, False, False]  # the input is left as it was


def _demo(out, *extra):
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "cooper_mcore", "demo", "--preset", "smoke", "--out", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def test_demo_smoke_every_stage_then_cached(tmp_path):
    """Every stage at the smallest size: report keys, the last output line, the cache on a second run."""
    from math_verify import LatexExtractionConfig, parse, verify

    out = tmp_path / "demo"
    r = _demo(out)
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == f"report: {out / 'report'}"
    report = out / "report"
    summary = json.loads((report / "summary.json").read_text())
    for mode in ("rule", "static_rm", "cooper"):
        s = summary[mode]
        for key in ("acc_before", "acc_after", "train_reward_final", "rm_acc_before", "rm_acc_after"):
            assert key in s, (mode, key)
        assert 0.0 <= s["acc_before"] <= 1.0 and 0.0 <= s["acc_after"] <= 1.0
        assert (report / f"metrics_{mode}.jsonl").stat().st_size > 0
    assert summary["rule"]["rm_acc_before"] is None and summary["rule"]["rm_acc_after"] is None
    assert summary["static_rm"]["rm_acc_before"] is not None and summary["cooper"]["rm_acc_after"] is not None
    assert summary["rule"]["acc_before"] == summary["cooper"]["acc_before"]  # the same start
    for mode in ("rule", "static_rm", "cooper"):  # the curve's last point is the "after" measurement itself
        assert summary[mode]["eval_acc_last"] == summary[mode]["acc_after"], mode
    for png in ("train_reward.png", "eval_acc.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rule |" in (report / "report.md").read_text()

    # the labels the pipeline wrote agree with math-verify itself (gold first) on completions with a
    # boxed answer (without one the verifier falls back to the last number: not checked here)
    (before_dir,) = [p for p in (out / "stages").iterdir() if p.name.startswith("before-")]
    rows = [json.loads(x) for x in (before_dir / "eval_samples.jsonl").read_text().splitlines()]
    for row in rows:
        if "\\boxed{" in row["completion"]:
            pred = parse(row["completion"], [LatexExtractionConfig(boxed_match_priority=0)])
            assert row["label"] == bool(pred and verify(parse(f"${row['reference']}$"), pred)), row

    # the RM started from the SFT policy (rm.init=sft): its backbone is the policy's, its new head zero
    (sft_dir,) = [p for p in (out / "stages").iterdir() if p.name.startswith("sft-")]
    (rm_dir,) = [p for p in (out / "stages").iterdir() if p.name.startswith("rm-")]
    mcore_to_hf(str(rm_dir / "init"), str(tmp_path / "rm_init_hf"))
    rm_init = load_file(str(tmp_path / "rm_init_hf" / "model.safetensors"))
    policy = load_file(str(sft_dir / "policy_hf" / "model.safetensors"))
    assert sorted(rm_init) == sorted([k for k in policy if k != "lm_head.weight"] + ["score.weight"])
    assert all(torch.equal(rm_init[k], policy[k]) for k in rm_init if k != "score.weight")
    assert not rm_init["score.weight"].any()

    # a second run reuses every stage (and rewrites the same report)
    again = _demo(out)
    cached = [line.split("[")[1].split("]")[0] for line in again.stderr.splitlines() if "cached:" in line]
    assert sorted(cached) == sorted(["assets", "sft", "before", "rm_data", "rm", "rl_rule", "rl_static_rm",
                                     "rl_cooper"]), again.stderr[-3000:]
    assert json.loads((report / "summary.json").read_text())["cooper"] == summary["cooper"]


def test_hybrid_labels_keep_rows_where_rule_and_judge_agree(tmp_path):
    """With a judge configured, the RM's training rows are those where math-verify and the judge agree."""
    from cooper_mcore.demo.pipeline import hybrid_labels, read_jsonl
    from tests.chat_server import ChatServer

    rows = [{"question": "2+3=", "reference": "5", "completion": c, "label": None}
            for c in ("2+3=5 \\boxed{5}", "2+3=6 \\boxed{6}", "2+3=5 \\boxed{5}", "2+3=4 \\boxed{4}")]
    path = str(tmp_path / "rm_train.jsonl")
    write_jsonl(path, rows)
    with ChatServer(canned="yes") as server:  # a judge that calls everything correct
        cfg = load_demo_config(None, [f"rm.judge_url={server.url}", "rm.judge_model=judge",
                                      "rm.judge_api_key_env=NO_SUCH_KEY_VAR"])
        stats = hybrid_labels(cfg, path)
    kept = read_jsonl(path)
    assert [r["completion"] for r in kept] == ["2+3=5 \\boxed{5}", "2+3=5 \\boxed{5}"]  # rule-correct = judge
    assert all(r["label"] is True for r in kept)
    assert stats["agreement_rate"] == pytest.approx(0.5) and stats["kept"] == 2
    assert len(read_jsonl(str(tmp_path / "rm_train.rule_only.jsonl"))) == 4  # the rule-only rows are kept aside


def test_tiny_assets_policy_is_pretrained_unless_sft_steps_is_0(tmp_path):
    """``cooper tiny-assets``' policy writes worked solutions after its short SFT; sft_steps=0 keeps it random."""
    from cooper_mcore.data.datasets import read_prompts
    from cooper_mcore.demo.assets import build_tiny_assets
    from cooper_mcore.rollout.base import SamplingParams
    from cooper_mcore.rollout.hf_engine import HFEngine

    def greedy(paths):
        engine = HFEngine.from_pretrained(paths["policy_hf"])
        prompts, _ = read_prompts(paths["train"])
        ids = [engine.tokenizer(p.question, add_special_tokens=False)["input_ids"] for p in prompts[:16]]
        return [o.text for o in engine.generate(ids, SamplingParams(max_new_tokens=24, temperature=0.0))]

    random = build_tiny_assets(str(tmp_path / "random"), n_train=64, n_eval=8, sft_steps=0)
    trained = build_tiny_assets(str(tmp_path / "sft"), n_train=64, n_eval=8, sft_steps=60)
    assert not os.path.exists(tmp_path / "sft" / "policy_init_mcore")  # the random start is not kept
    assert not any("\\boxed{" in t for t in greedy(random))
    assert sum("\\boxed{" in t for t in greedy(trained)) >= 12  # the answer format is learned
    with pytest.raises(ValueError, match="sft_steps"):
        build_tiny_assets(str(tmp_path / "bad"), sft_steps=-1)
