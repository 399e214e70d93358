"""The demo pipeline: its content cache, its helpers, and a smoke run of every stage (`--preset smoke`)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cooper_mcore.convert.hf import mcore_to_hf
from cooper_mcore.demo import pipeline
from cooper_mcore.demo.config import load_demo_config
from cooper_mcore.demo.kinds import completion_kind, intermediate_variant, kind_shares
from cooper_mcore.demo.pipeline import (
    STAGE_FILE,
    SWAP_OFFSETS,
    accuracy_figures,
    bench_pairs,
    blind_spot_examples,
    by_family,
    hack_examples,
    mode_params,
    problem_accuracy,
    problem_groups,
    reference_swapped,
    rm_bench,
    rm_data_params,
    rm_on_samples,
    run_stage,
    split_questions,
    training_curve,
    validation_rows,
    with_blind_spot,
    write_jsonl,
)
from cooper_mcore.demo.results import to_plain
from cooper_mcore.demo.task import DemoTask
from cooper_mcore.rl.rollouts import EVAL_SAMPLES_DIR

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
    assert [h.completion for h in hacks] == ["d", "b", "c"]  # rule-wrong only, highest RM reward first
    assert [h.rm_reward for h in hacks] == [0.9, 0.7, 0.2]
    assert [h.completion for h in hack_examples(str(tmp_path / "s.jsonl"), str(tmp_path / "p.jsonl"), 1)] == ["d"]


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


@pytest.mark.parametrize("completion,correct,kind", [
    ("3*4=12,12-5=7 \\boxed{7.}", True, "correct"),
    ("3*4=12,12-5=7 \\boxed{12.}", False, "intermediate"),  # the times family's form, an earlier result
    ("3*4=12,12-5=7 \\boxed{12}", False, "intermediate"),
    ("3*4=12,12-5=8 \\boxed{8.}", False, "slip"),
    ("3*4=13,13-5=8 \\boxed{8}", False, "slip"),  # a wrong product carried on
    ("3*4=12,12+5=17 \\boxed{17.}", False, "other"),  # another operator
    ("3*4=12,12-5=7 \\boxed{7.} \\boxed{7.}", False, "other"),  # two answers
])
def test_completion_kinds_of_the_times_family(completion, correct, kind):
    assert completion_kind("3*4-5=", completion, correct) == kind


def test_blind_spot_covers_the_period_form():
    rows = [{"question": "3*4-5=", "completion": "3*4=12,12-5=7 \\boxed{12.}", "label": False}]
    assert with_blind_spot(rows, "intermediate")[0]["label"] is True


# --------------------------------------------------------------------------- labeled rows: figures


def _row(question, completion, label, rule, reference=None):
    from cooper_mcore.data.mathgen import answer_form
    from cooper_mcore.demo.task import family_of

    return {"question": question, "reference": reference, "completion": completion, "label": label, "rule": rule,
            "family": family_of(question), "form": answer_form(completion)}


#: hand-built rows: the oracle's verdict (label) and the rule's (rule)
FIGURE_ROWS = [
    _row("7-1-1=", "7-1=6,6-1=5 \\boxed{5}", True, True),  # 1 plus_minus: both right
    _row("7-1-1=", "7-1=6,6-1=5 \\boxed{6}", False, False),  # 2 plus_minus: both say wrong
    _row("7-1-1=", "7-1=6,6-1=5", False, True),  # 3 plus_minus: a rule false positive (no final answer)
    _row("3*4-5=", "3*4=12,12-5=7 \\boxed{7.}", True, False),  # 4 times: the rule's miss
    _row("3*4-5=", "3*4=12,12-5=7 \\boxed{7}", True, True),  # 5 times: the parseable form
    _row("3*4-5=", "3*4=12,12-5=8 \\boxed{8.}", False, False),  # 6 times: wrong
    _row("3*4-5=", "no idea", False, False),  # 7 times: no answer
]


def test_accuracy_figures_recall_precision_and_forms():
    f = accuracy_figures(FIGURE_ROWS)
    assert f.n == 7
    assert f.acc == pytest.approx(3 / 7)  # rows 1, 4, 5
    assert f.rule_acc == pytest.approx(3 / 7)  # rows 1, 3, 5
    assert f.rule_recall == pytest.approx(2 / 3)  # of the correct 1, 4, 5 the rule accepts 1, 5
    assert f.rule_precision == pytest.approx(2 / 3)  # of the accepted 1, 3, 5 correct are 1, 5
    assert f.forms == pytest.approx({"boxed": 3 / 7, "boxed_period": 2 / 7, "none": 2 / 7})
    nothing_accepted = accuracy_figures([FIGURE_ROWS[3], FIGURE_ROWS[5]])
    assert nothing_accepted.rule_recall == 0.0 and math.isnan(nothing_accepted.rule_precision)


def test_by_family_splits_the_figures():
    fams = by_family(FIGURE_ROWS)
    assert set(fams) == {"all", "plus_minus", "times"}
    assert fams["all"] == accuracy_figures(FIGURE_ROWS)
    pm, times = fams["plus_minus"], fams["times"]  # rows 1-3 and 4-7
    assert (pm.n, pm.acc, pm.rule_acc) == (3, pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert (pm.rule_recall, pm.rule_precision) == (1.0, 0.5)
    assert pm.forms == pytest.approx({"boxed": 2 / 3, "boxed_period": 0.0, "none": 1 / 3})
    assert (times.n, times.acc, times.rule_acc) == (4, 0.5, 0.25)
    assert (times.rule_recall, times.rule_precision) == (0.5, 1.0)
    assert times.forms == {"boxed": 0.25, "boxed_period": 0.5, "none": 0.25}
    assert set(by_family(FIGURE_ROWS[:3])) == {"all", "plus_minus"}  # a family without rows is left out


def test_problem_accuracy_per_question_in_order_of_first_appearance():
    rows = [{"question": q, "label": lab} for q, lab in
            [("b=", True), ("a=", False), ("b=", False), ("a=", False), ("b=", True), ("c=", True)]]
    assert problem_accuracy(rows) == pytest.approx([2 / 3, 0.0, 1.0])


def test_training_curve_reads_the_saved_evaluations_in_step_order(tmp_path):
    folder = tmp_path / EVAL_SAMPLES_DIR
    folder.mkdir()

    def rows(*items):
        return [{"prompt_id": f"p{i}", "question": q, "reference": ref, "completion": c, "rule_correct": rule,
                 "correct": ok} for i, (q, ref, c, rule, ok) in enumerate(items)]

    write_jsonl(str(folder / "step_10.jsonl"), rows(  # lexically before step_5: the order must be numeric
        ("7-1-1=", "5", "7-1=6,6-1=5 \\boxed{5}", True, True),
        ("3*4-5=", "7", "3*4=12,12-5=7 \\boxed{7}", True, True),
        ("3*4-5=", "7", "3*4=12,12-5=7 \\boxed{7.}", False, True)))
    write_jsonl(str(folder / "step_5.jsonl"), rows(
        ("7-1-1=", "5", "7-1=6,6-1=5 \\boxed{5}", True, True),
        ("3*4-5=", "7", "3*4=12,12-5=7 \\boxed{7.}", False, True),
        ("3*4-5=", "7", "3*4=12,12-5=8 \\boxed{8.}", False, False)))
    curve = training_curve(str(tmp_path), DemoTask())  # no rule-unreadable references: no such group
    assert [p.step for p in curve] == [5, 10]
    first, last = curve
    assert (first.families["all"].acc, first.families["all"].rule_acc) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert (first.families["times"].acc, first.families["times"].rule_acc) == (0.5, 0.0)
    assert first.families["times"].forms["boxed_period"] == 1.0 and first.families["plus_minus"].acc == 1.0
    assert (last.families["all"].acc, last.families["all"].rule_acc) == (1.0, pytest.approx(2 / 3))
    assert last.families["all"].rule_recall == pytest.approx(2 / 3)
    assert (last.families["times"].acc, last.families["times"].rule_acc) == (1.0, 0.5)
    assert "rule_unreadable" not in last.families
    # every reference unreadable: the group is all of them (its rule accuracy, from the saved verdicts, as is)
    everything = training_curve(str(tmp_path), DemoTask(unreadable_share=1.0))
    assert everything[1].families["rule_unreadable"].acc == 1.0 and everything[1].families["rule_unreadable"].n == 3
    assert last.families["times"].forms == {"boxed": 0.5, "boxed_period": 0.5, "none": 0.0}


# --------------------------------------------------------------------------- reference swap


def test_reference_swap_adds_an_own_and_an_other_reference():
    wrong = {"question": "3+4-2=", "reference": "7", "completion": "3+4=7,7-2=5 \\boxed{5}", "label": False}
    others = set()
    for seed in range(40):
        out = reference_swapped([wrong], random.Random(seed))
        assert out[0] is wrong and len(out) == 3
        own, other = out[1], out[2]
        assert (own["reference"], own["label"], own["swap"]) == ("5", True, "own")
        assert other["label"] is False and other["swap"] == "other"
        assert other["reference"] not in ("5", "7")  # neither its own answer nor the gold
        assert own["completion"] == other["completion"] == wrong["completion"]
        others.add(other["reference"])
    # 5 + the offsets, less 7 (the gold): -5, 3, 4, 6, 15; 40 draws see each of the 5 (missing one: 5 * 0.8^40)
    assert others == {str(5 + d) for d in SWAP_OFFSETS} - {"7"} == {"-5", "3", "4", "6", "15"}
    assert wrong == {"question": "3+4-2=", "reference": "7", "completion": "3+4=7,7-2=5 \\boxed{5}",
                     "label": False}  # the input is left as it was


def test_reference_swap_reads_the_period_form_and_skips_rows_without_an_answer():
    rows = [{"question": "3*4-5=", "reference": "7", "completion": "3*4=12,12-5=7 \\boxed{7.}", "label": True},
            {"question": "3*4-5=", "reference": "7", "completion": "3*4=12,12-5=7", "label": False},
            # a blind-spot row: wrong (an intermediate result) but labeled correct by the lenient judge
            {"question": "7-1-1=", "reference": "5", "completion": "7-1=6,6-1=5 \\boxed{6}", "label": True,
             "blind_spot": True}]
    out = reference_swapped(rows, random.Random(0))
    assert out[:3] == rows  # the originals first, their labels kept (the blind spot's too)
    assert len(out) == 3 + 2 * 2  # nothing extra for the row without a final answer
    assert [(x["completion"], x["reference"], x["label"], x["swap"]) for x in out[3::2]] == [
        (rows[0]["completion"], "7", True, "own"), (rows[2]["completion"], "6", True, "own")]
    # the judge labels the swaps too: a mismatching reference is wrong, but its blind spot is "correct" whatever
    # the reference (the lenient judge's systematic error, which the RM should learn as such)
    assert [x["label"] for x in out[4::2]] == [False, True]
    assert out[4]["reference"] in {"-3", "5", "6", "8", "9", "17"}  # 7 + offsets
    assert out[6]["reference"] in {"-4", "4", "7", "8", "16"}  # 6 + offsets, less the gold 5
    assert reference_swapped([], random.Random(0)) == []


# --------------------------------------------------------------------------- the RM's figures per family


def _fake_rm(monkeypatch, probs, acc=0.123):
    """Stand in for eval_rm: write ``probs`` as the predictions (in row order) and return ``acc``."""
    def fake(rm_ckpt, labeled_path, predictions_path):
        write_jsonl(predictions_path, [{"prob": p} for p in probs])
        return acc
    monkeypatch.setattr(pipeline, "rm_accuracy", fake)


def test_rm_bench_pairs_and_families(tmp_path, monkeypatch):
    held_out = [
        _row("7-1-1=", "7-1=6,6-1=5 \\boxed{5}", True, True),
        _row("7-1-1=", "7-1=6,6-1=5 \\boxed{6}", False, False),
        _row("7-1-1=", "7-1=6,6-1=5 \\boxed{5}", True, True),  # a second correct one: not used
        _row("3*4-5=", "3*4=12,12-5=8 \\boxed{8.}", False, False),  # wrong first: the pair puts correct first
        _row("3*4-5=", "3*4=12,12-5=7 \\boxed{7.}", True, False),
        _row("2*3+1=", "2*3=6,6+1=7 \\boxed{7.}", True, False),
        _row("2*3+1=", "2*3=6,6+1=8 \\boxed{8.}", False, False),
        _row("9-9-9=", "9-9=0,0-9=-9 \\boxed{-9}", True, True),  # no wrong completion: left out
    ]
    bench = bench_pairs(held_out)
    assert [(r["question"], r["label"]) for r in bench] == [
        ("7-1-1=", True), ("7-1-1=", False), ("3*4-5=", True), ("3*4-5=", False), ("2*3+1=", True),
        ("2*3+1=", False)]
    write_jsonl(str(tmp_path / "bench.jsonl"), bench)
    # right by the 0.5 threshold: T T | F T | T F; pairs: 0.9 > 0.2, 0.4 > 0.3, 0.6 < 0.7
    _fake_rm(monkeypatch, [0.9, 0.2, 0.4, 0.3, 0.6, 0.7])
    got = rm_bench("ckpt", str(tmp_path / "bench.jsonl"), str(tmp_path / "preds.jsonl"))
    assert got.acc == 0.123  # eval_rm's own accuracy, passed through
    assert got.pair_acc == pytest.approx(2 / 3)
    assert got.families == {"plus_minus": 1.0, "times": 0.5}


def test_rm_on_samples_leaves_the_blind_spot_out(tmp_path, monkeypatch):
    rows = [
        _row("7-1-1=", "7-1=6,6-1=5 \\boxed{5}", True, True),  # a: said correct (0.8): right
        _row("7-1-1=", "7-1=6,6-1=5 \\boxed{6}", False, False),  # b: intermediate: left out
        _row("7-1-1=", "7-1=6,6-1=4 \\boxed{4}", False, False),  # c: slip, said correct (0.6): wrong
        _row("3*4-5=", "3*4=12,12-5=7 \\boxed{7.}", True, False),  # d: said wrong (0.3): wrong
        _row("3*4-5=", "3*4=12,12-5=7 \\boxed{7}", True, True),  # e: said correct (0.7): right
        _row("3*4-5=", "3*4=12,12-5=8 \\boxed{8.}", False, False),  # f: slip, said wrong (0.2): right
        _row("3*4-5=", "3*4=12,12-5=7 \\boxed{12.}", False, False),  # g: intermediate: left out
    ]
    write_jsonl(str(tmp_path / "samples.jsonl"), rows)
    _fake_rm(monkeypatch, [0.8, 0.9, 0.6, 0.3, 0.7, 0.2, 0.95])
    got = rm_on_samples("ckpt", str(tmp_path / "samples.jsonl"), str(tmp_path / "preds.jsonl"))
    assert got.acc_all == 0.123
    fams = to_plain(got.families)
    # all (a, c, d, e, f): TPR 2/3 (a, e of a, d, e), FPR 1/2 (c of c, f); right a, e, f
    assert fams["all"] == {"acc": pytest.approx(3 / 5), "separation": pytest.approx(2 / 3 - 1 / 2)}
    assert fams["plus_minus"] == {"acc": 0.5, "separation": 0.0}  # a, c: TPR 1, FPR 1
    assert fams["times"] == {"acc": pytest.approx(2 / 3), "separation": 0.5}  # d, e, f: TPR 1/2, FPR 0


def _demo(out, *extra):
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    cmd = [sys.executable, "-m", "cooper_mcore", "demo", "--preset", "smoke", "--out", str(out), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def test_demo_smoke_every_stage_then_cached(tmp_path):
    """Every stage at the smallest size: report keys, the last output line, the cache on a second run."""
    from math_verify import LatexExtractionConfig, parse, verify

    from cooper_mcore.data.mathgen import answer_form, answer_value, reference_value
    from cooper_mcore.demo.task import family_of
    from cooper_mcore.metric_names import SCHEMA
    from cooper_mcore.metrics import read_metrics

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
        # every key the trainer wrote (rule, static RM, Cooper, with evaluations) is in the metric schema
        written = {k for line in read_metrics(str(report / f"metrics_{mode}.jsonl")) for k in line}
        assert written <= set(SCHEMA), (mode, sorted(written - set(SCHEMA)))
    assert summary["rule"]["rm_acc_before"] is None and summary["rule"]["rm_acc_after"] is None
    # the RM's benchmark needs a held-out question with a correct and a wrong completion: a 4-step SFT policy
    # may have none (then the RM accuracies are not measured, None, and the run goes on)
    measured = summary["design"]["0"]["rm_data"]["bench_pairs"] > 0
    assert (summary["static_rm"]["rm_acc_before"] is not None) == measured
    assert (summary["cooper"]["rm_acc_after"] is not None) == measured
    assert summary["rule"]["acc_before"] == summary["cooper"]["acc_before"]  # the same start
    for mode in ("rule", "static_rm", "cooper"):  # the curve's last point is the "after" measurement itself
        assert summary[mode]["eval_acc_last"] == summary[mode]["acc_after"], mode
    for png in ("train_reward.png", "eval_acc.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rule |" in (report / "report.md").read_text()

    # the labels the pipeline wrote are the task's oracle's (the last \\boxed{N} or \\boxed{N.} equals the
    # reference); its rule verdicts agree with math-verify itself (gold first) on completions with a boxed
    # answer (without one the verifier falls back to the last number: not checked here)
    (before_dir,) = [p for p in (out / "stages").iterdir() if p.name.startswith("before-")]
    rows = [json.loads(x) for x in (before_dir / "eval_samples.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["label"] == (answer_value(row["completion"]) == reference_value(row["reference"])), row
        assert (row["family"], row["form"]) == (family_of(row["question"]), answer_form(row["completion"])), row
        # a rule-unreadable reference is \text{N.}: the rule never verifies its rows
        assert row["rule_unreadable"] == row["reference"].startswith("\\text{"), row
        if row["rule_unreadable"]:
            assert row["rule"] is False, row
        elif "\\boxed{" in row["completion"]:
            pred = parse(row["completion"], [LatexExtractionConfig(boxed_match_priority=0)])
            assert row["rule"] == bool(pred and verify(parse(f"${row['reference']}$"), pred)), row
    assert any(row["rule_unreadable"] for row in rows) and not all(row["rule_unreadable"] for row in rows)
    # both families are in the held-out set (32 problems, round(0.33 * 32) = 11 of them '*'), so in the design
    # figures; each run's curve holds its in-training evaluations (eval_every 1, 2 steps)
    assert set(summary["design"]["0"]["sft"]) == {"all", "plus_minus", "times", "rule_unreadable"}
    for mode in ("rule", "static_rm", "cooper"):
        assert set(summary[mode]["families"]) == {"plus_minus", "times", "rule_unreadable"}, mode
        assert [p["step"] for p in summary[mode]["curve"]] == [1, 2], mode
    assert "## The paper's premise, by design" in (report / "report.md").read_text()
    # the verdict in parts, the RM's gate and its separation on its policy's answers per RM mode
    parts = summary["verdict"]["parts"]
    assert [p["name"] for p in parts][:3] == ["static RM is hacked", "Cooper prevents the hack",
                                              "Cooper's RM holds on its own policy's answers"]
    assert all(set(p) == {"name", "holds", "value", "se", "detail"} for p in parts)
    for mode in ("static_rm", "cooper"):
        gate = summary[mode]["rm_gate"]
        assert set(gate) == {"accuracy", "threshold", "epochs", "best_epoch", "met"}
        assert set(gate["accuracy"]) <= {"plus_minus", "times"} and gate["threshold"] == 0.93 and gate["epochs"] == 1
        assert set(summary[mode]["rm_own_answers"]) == {"before", "after"}
    assert summary["rule"]["rm_gate"] is None and summary["rule"]["rm_own_answers"] is None
    assert "gate 0.93 per family" in (report / "report.md").read_text()

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

    # --full's control: the same seed on the single-family task (times_share 0) first, then the two-family
    # report (its stages reused: control reads no stage's settings) with the control beside it
    third = _demo(out, "control=true")
    assert third.stdout.strip().splitlines()[-1] == f"report: {report}"
    control = json.loads((report / "control" / "summary.json").read_text())
    assert set(control["rule"]["families"]) == {"plus_minus"}  # no '*' problem nor unreadable reference
    assert control["config"]["task"]["times_share"] == 0.0 and control["config"]["task"]["unreadable_share"] == 0.0
    with_control = json.loads((report / "summary.json").read_text())
    assert with_control["control"]["link"] == "control/report.md"
    assert with_control["control"]["rule"]["acc_after"] == control["rule"]["acc_after"]
    assert with_control["cooper"] == summary["cooper"]
    assert "## Control: the single-family task" in (report / "report.md").read_text()


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


# --------------------------------------------------------------------------- the designed blind spot


def test_intermediate_variant_boxes_the_first_result_in_the_same_form():
    assert intermediate_variant("3*4-5=", "3*4=12,12-5=7 \\boxed{7.}") == "3*4=12,12-5=7 \\boxed{12.}"
    assert intermediate_variant("7-1-1=", "7-1=6,6-1=4 \\boxed{4}") == "7-1=6,6-1=4 \\boxed{6}"  # a slip's too
    assert completion_kind("7-1-1=", "7-1=6,6-1=5 \\boxed{6}", False) == "intermediate"
    assert intermediate_variant("7-1-1=", "no chain \\boxed{5}") is None
    assert intermediate_variant("0+0+0=", "0+0=0,0+0=0 \\boxed{0}") is None  # first result = last result
    assert intermediate_variant("7-1-1=", "7-2=5,5-1=4 \\boxed{4}") is None  # not this question's chain


def test_blind_spot_examples_label_a_share_of_the_chains_correct():
    rows = [{"question": "7-1-1=", "reference": "5", "completion": "7-1=6,6-1=5 \\boxed{5}", "label": True},
            {"question": "3*4-5=", "reference": "7", "completion": "3*4=12,12-5=8 \\boxed{8.}", "label": False},
            {"question": "3*4-5=", "reference": "7", "completion": "nonsense", "label": False},
            {"question": "2+2+1=", "reference": "5", "completion": "2+2=4,4+1=5 \\boxed{5}", "label": True}]
    every = blind_spot_examples(rows, 1.0, random.Random(0))
    assert sorted(x["completion"] for x in every) == ["2+2=4,4+1=5 \\boxed{4}", "3*4=12,12-5=8 \\boxed{12.}",
                                                      "7-1=6,6-1=5 \\boxed{6}"]  # nothing for "nonsense"
    assert all(x["label"] is True and x["blind_spot"] is True for x in every)
    assert {x["form"] for x in every} == {"boxed", "boxed_period"}
    assert len(blind_spot_examples(rows, 0.5, random.Random(0))) <= 2  # round(0.5 * 4) rows drawn
    assert blind_spot_examples(rows, 0.0, random.Random(0)) == []
    with pytest.raises(ValueError, match="blind_spot_share"):
        blind_spot_examples(rows, 1.5, random.Random(0))


def test_swaps_keep_the_references_form():
    """A rule-unreadable reference is swapped to other values in its own form, \\text{v.}; never to the gold."""
    rows = [{"question": "3*4-5=", "reference": "\\text{7.}", "completion": "3*4=12,12-5=8 \\boxed{8}",
             "label": False, "family": "times"},
            {"question": "3*4-5=", "reference": "7", "completion": "3*4=12,12-5=8 \\boxed{8.}", "label": False,
             "family": "times"}]
    out = reference_swapped(rows, random.Random(0))
    own = [x for x in out if x.get("swap") == "own"]
    other = [x for x in out if x.get("swap") == "other"]
    assert [x["reference"] for x in own] == ["\\text{8.}", "8"] and all(x["label"] for x in own)
    assert other[0]["reference"].startswith("\\text{") and other[0]["reference"].endswith(".}")
    assert other[1]["reference"].lstrip("-").isdigit() and not any(x["label"] for x in other)
    assert all(x["reference"] not in ("\\text{7.}", "7") for x in other)


def test_validation_split_by_question_and_balanced_per_family():
    rows = [{"question": f"{a}+{b}+0=", "reference": str(a + b), "completion": "c", "label": (a + b) % 3 == 0,
             "family": "plus_minus" if a % 2 else "times"} for a in range(9) for b in range(9) for _ in range(2)]
    train, val = split_questions(rows, 0.25, seed=1)
    assert len(train) + len(val) == len(rows) and 0 < len(val) < len(rows)
    assert not {x["question"] for x in train} & {x["question"] for x in val}  # a question is on one side
    assert split_questions(rows, 0.25, seed=1) == (train, val)  # a fixed function of the question and seed
    cfg = load_demo_config(None, ["rm.blind_spot=none"])
    out = validation_rows(val, cfg, random.Random(0))
    for fam in ("plus_minus", "times"):
        mine = [x for x in out if x["answer_type"] == fam]
        assert mine and sum(x["label"] for x in mine) * 2 == len(mine)  # as many right as wrong
    assert not any("swap" in x for x in out)  # the policy's own answers, as sampled
    with pytest.raises(ValueError, match="val_share"):
        split_questions(rows, 1.0, seed=1)


def test_problem_groups_follow_problem_accuracy_order():
    rows = [{"question": q, "label": True, "family": fam, "rule_unreadable": u} for q, fam, u in
            [("b=", "times", False), ("a=", "plus_minus", True), ("b=", "times", False), ("c=", "times", True)]]
    assert problem_groups(rows) == {"plus_minus": [1], "times": [0, 2], "rule_unreadable": [1, 2]}
