"""The demo pipeline: its content cache, its helpers, and a smoke run of every stage (`--preset smoke`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cooper_mcore.demo.config import load_demo_config
from cooper_mcore.demo.pipeline import STAGE_FILE, hack_examples, run_stage, write_jsonl

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
    cfg = load_demo_config(None, ["rl.steps=7", "task.max_operand=19"])
    assert cfg.rl.steps == 7 and cfg.task.max_operand == 19
    full = load_demo_config("full")
    assert full.rl.steps > cfg.rl.steps and full.task.n_eval >= 500
    with pytest.raises(ValueError, match="no_such"):
        load_demo_config(None, ["rl.no_such=1"])
    with pytest.raises(ValueError, match="preset"):
        load_demo_config("huge")


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
    for png in ("train_reward.png", "eval_acc.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rule |" in (report / "report.md").read_text()

    # the labels the pipeline wrote agree with math-verify itself (gold first) on completions with a
    # boxed answer (without one the verifier falls back to the last number: not checked here)
    (sft_dir,) = [p for p in (out / "stages").iterdir() if p.name.startswith("sft-")]
    rows = [json.loads(x) for x in (sft_dir / "eval_samples.jsonl").read_text().splitlines()]
    for row in rows:
        if "\\boxed{" in row["completion"]:
            pred = parse(row["completion"], [LatexExtractionConfig(boxed_match_priority=0)])
            assert row["label"] == bool(pred and verify(parse(f"${row['reference']}$"), pred)), row

    # a second run reuses every stage (and rewrites the same report)
    again = _demo(out)
    cached = [line.split("[")[1].split("]")[0] for line in again.stderr.splitlines() if "cached:" in line]
    assert sorted(cached) == sorted(["assets", "sft", "rm_data", "rm", "rm_start", "rl_rule", "rl_static_rm",
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
