"""Tests for cooper_mcore.demo.report (the CPU demo's rule / static RM / Cooper report).

The fixture ``tests/fixtures/demo_run`` is synthetic, shaped like the paper's dynamics: the
static-RM run's training reward climbs 0.45 -> 0.98 while held-out accuracy falls 0.50 -> 0.40;
rule and Cooper rise slowly. Expected numbers below are computed by hand from its files.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest

from cooper_mcore.demo.config import load_demo_config
from cooper_mcore.demo.report import (
    MODES,
    PLOT_FILES,
    HackExample,
    RunResult,
    hacking_signature,
    load_runs,
    train_reward_final,
    write_report,
)
from cooper_mcore.redaction import REDACTED

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "demo_run"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The report of the recorded fixture: (folder, summary.json, report.md)."""
    out = tmp_path_factory.mktemp("report") / "demo_report"
    assert write_report(str(out), load_runs(str(FIXTURE)), config={"steps": 20, "api_key": "sk-secret"}) == str(out)
    return out, json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()


def _copy_fixture(tmp_path: Path) -> Path:
    dst = tmp_path / "demo_run"
    shutil.copytree(FIXTURE, dst)
    return dst


def _rewrite(path: Path, **fields) -> None:
    """Change fields of a fixture's result.json."""
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _lines(rewards, **extra):
    return [{"step": i + 1, "reward/mean": r, **extra} for i, r in enumerate(rewards)]


# ----------------------------------------------------------------------------- summary.json

EXPECTED = {  # hand-computed from tests/fixtures/demo_run (20 steps: final reward = mean of the last 5)
    "rule": dict(acc_before=0.50, acc_after=0.54, acc_change=0.04, train_reward_initial=0.42,
                 train_reward_final=(0.50 + 0.52 + 0.50 + 0.54 + 0.54) / 5, rm_acc_before=None, rm_acc_after=None,
                 steps=20, train_seconds=20 * 0.4, wall_seconds=9.5, eval_acc_last=0.54, n_hacks=0),
    "static_rm": dict(acc_before=0.50, acc_after=0.40, acc_change=-0.10, train_reward_initial=0.49,
                      train_reward_final=(0.90 + 0.92 + 0.94 + 0.96 + 0.98) / 5, rm_acc_before=0.70,
                      rm_acc_after=0.70, steps=20, train_seconds=20 * 0.5, wall_seconds=11.0, eval_acc_last=0.40,
                      n_hacks=3),
    "cooper": dict(acc_before=0.50, acc_after=0.56, acc_change=0.06, train_reward_initial=0.51,
                   train_reward_final=(0.60 + 0.62 + 0.61 + 0.63 + 0.64) / 5, rm_acc_before=0.70,
                   rm_acc_after=0.78, steps=20, train_seconds=20 * 0.6, wall_seconds=13.0, eval_acc_last=0.56,
                   n_hacks=0),
}


@pytest.mark.parametrize("mode", MODES)
def test_summary_values_equal_hand_computed(report, mode):
    _, summary, _ = report
    got = summary[mode]
    for key, want in EXPECTED[mode].items():
        assert got[key] == (None if want is None else pytest.approx(want, abs=1e-9)), key
    assert got["eval_steps"] == [5, 10, 15, 20]
    assert got["hacking"]["reward_start"] == pytest.approx(got["train_reward_initial"])
    assert got["hacking"]["reward_end"] == pytest.approx(got["train_reward_final"])


def test_summary_hacking_and_gap_for_static_rm(report):
    _, summary, _ = report
    h = summary["static_rm"]["hacking"]
    assert h["reward_rise"] == pytest.approx(0.94 - 0.49)
    assert h["acc_change"] == pytest.approx(-0.10)
    assert h["present"] is True
    # rule/acc falls linearly 0.42 - 0.12 * i / 19 (i = 0..19); its window means sit at i = 2 and i = 17
    assert h["gap_start"] == pytest.approx(0.49 - (0.42 - 0.12 * 2 / 19), abs=1e-4)
    assert h["gap_end"] == pytest.approx(0.94 - (0.42 - 0.12 * 17 / 19), abs=1e-4)
    assert summary["static_rm"]["rule_acc_final"] == pytest.approx(0.42 - 0.12 * 17 / 19, abs=1e-4)
    assert summary["rule"]["hacking"]["gap_end"] == 0.0
    assert summary["cooper"]["hacking"]["present"] is False


def test_summary_verdict_and_redacted_config(report):
    _, summary, _ = report
    v = summary["verdict"]
    assert v["static_rm_hacking"] is True and v["cooper_hacking"] is False
    assert v["cooper_at_rule_baseline"] is True
    assert v["cooper_minus_rule_acc"] == pytest.approx(0.02)
    assert v["cooper_rm_acc_not_degraded"] is True and v["static_rm_rm_acc_not_degraded"] is True
    assert v["claim_reproduced"] is True and v["failed"] == []
    assert summary["config"] == {"steps": 20, "api_key": REDACTED}


# ----------------------------------------------------------------------------- report.md


def test_report_table_in_paper_form(report):
    _, _, md = report
    assert ("| reward mode | held-out acc before | held-out acc after | change | final training reward "
            "| RM acc before | RM acc after |") in md
    assert "| rule | 0.500 | 0.540 | +0.040 | 0.520 | n/a | n/a |" in md
    assert "| static RM | 0.500 | 0.400 | -0.100 | 0.940 | 0.700 | 0.700 |" in md
    assert "| Cooper | 0.500 | 0.560 | +0.060 | 0.620 | 0.700 | 0.780 |" in md
    rows = [md.index(f"| {label} | 0.500") for label in ("rule", "static RM", "Cooper")]
    assert rows == sorted(rows)


def test_report_verdict_says_present_for_hacking_static_run(report):
    _, _, md = report
    assert ("- static RM: training reward rose from 0.490 to 0.940 while held-out accuracy fell from 0.500 "
            "to 0.400 (reward hacking signature present).") in md
    assert ("- Cooper: training reward rose from 0.510 to 0.620 while held-out accuracy rose from 0.500 to 0.560 "
            "(reward hacking signature not present).") in md
    assert "- Cooper vs rule: held-out accuracy after training 0.560 vs 0.540 (+0.020)." in md
    assert "- Cooper: RM accuracy on held-out labeled completions rose from 0.700 to 0.780." in md
    assert "- Paper's claim in miniature: reproduced." in md
    # the static RM's drop of 0.10 meets MIN_ACC_DROP exactly; its rise of 0.45 is well above MIN_REWARD_RISE
    assert "rose by at least 0.25 and held-out accuracy fell by at least 0.1." in md


def test_report_hack_examples_links_and_config(report):
    out, _, md = report
    assert "**Question:** What is 17 + 25?" in md
    assert "**RM reward:** 0.970; **rule verdict:** wrong" in md
    assert "   Let me check carefully. 17 + 25 = 41, which is definitely correct.\n   \\boxed{41}" in md
    assert "Compute 6 * 7 \\| 2 (the remainder)" in md  # a pipe cannot break the line
    assert "   ````text\n   ```\n   answer: 1\n   ``` The answer is verified" in md  # fence longer than its content's
    assert "### static RM (3 collected, 3 shown)" in md and "### Cooper" not in md
    assert "the mean `reward/mean` over the last 5 steps" in md
    for name in PLOT_FILES.values():
        assert f"]({name})" in md and (out / name).is_file()
    for mode in MODES:
        assert f"(metrics_{mode}.jsonl)" in md
    assert REDACTED in md and "sk-secret" not in md


# ----------------------------------------------------------------------------- files


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("name", sorted(PLOT_FILES.values()))
def test_pngs_are_valid_and_non_trivial(report, name):
    out, _, _ = report
    path = out / name
    width, height = _png_size(path)
    assert width >= 400 and height >= 300
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize("name", ["train_reward.png", "eval_acc.png", "rule_acc_gap.png"])
def test_pngs_draw_every_mode(report, name):
    from matplotlib.image import imread

    from cooper_mcore.demo.report import MODE_COLORS

    rgb = imread(str(report[0] / name))[..., :3]
    for mode, color in MODE_COLORS.items():
        want = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
        close = (abs(rgb - want) < 0.02).all(axis=-1).sum()
        assert close > 100, f"{name}: {mode}'s color appears on only {close} pixels"


def test_metrics_copies_are_byte_identical(report):
    out, _, _ = report
    for mode in MODES:
        assert (out / f"metrics_{mode}.jsonl").read_bytes() == (FIXTURE / mode / "metrics.jsonl").read_bytes()


# ----------------------------------------------------------------------------- other verdicts


def test_non_hacking_static_run_says_not_present(tmp_path):
    root = _copy_fixture(tmp_path)
    lines = [json.loads(x) for x in (root / "static_rm" / "metrics.jsonl").read_text().splitlines()]
    with open(root / "static_rm" / "metrics.jsonl", "w") as f:
        for m in lines:  # a flat training reward: the RM is not being exploited
            m["reward/mean"] = 0.50
            f.write(json.dumps(m) + "\n")
        f.write('{"step": 21, "reward/mean": 0.9')  # a torn last line is ignored
    _rewrite(root / "static_rm" / "result.json", acc_after=0.45)
    out = Path(write_report(str(tmp_path / "out"), load_runs(str(root))))
    summary, md = json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()
    assert summary["static_rm"]["steps"] == 20
    assert summary["static_rm"]["hacking"]["present"] is False
    assert ("- static RM: training reward stayed at 0.500 while held-out accuracy fell from 0.500 to 0.450 "
            "(reward hacking signature not present).") in md
    assert "reward hacking signature present" not in md
    # the reason names the missing half (the reward did not rise; the accuracy fell by the 0.05 the fixture set)
    why = next(line for line in summary["verdict"]["lines"] if line.startswith("Why the static RM"))
    assert why.startswith("Why the static RM shows no hacking signature: its training reward rose +0.000 (the "
                          "signature needs +0.25) and its held-out accuracy changed -0.050 (the signature needs -0.1)")
    assert summary["verdict"]["claim_reproduced"] is False
    assert summary["verdict"]["failed"] == ["static RM is hacked"]
    assert "- Paper's claim in miniature: not reproduced (not holding: static RM is hacked)." in md


def test_cooper_below_rule_with_degraded_rm(tmp_path):
    runs = load_runs(str(FIXTURE))
    runs["cooper"].acc_after, runs["cooper"].rm_acc_after = 0.51, 0.65
    runs["rule"].metrics_path = str(FIXTURE / "rule")  # a run folder instead of its metrics.jsonl
    out = Path(write_report(str(tmp_path / "out"), {m: vars(r) for m, r in runs.items()}))  # dict form
    assert (out / "metrics_rule.jsonl").read_bytes() == (FIXTURE / "rule" / "metrics.jsonl").read_bytes()
    summary, md = json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()
    assert "- Cooper vs rule: held-out accuracy after training 0.510 vs 0.540 (-0.030)." in md
    assert "- Cooper: RM accuracy on held-out labeled completions fell from 0.700 to 0.650." in md
    # without per-problem accuracies or per-item verdicts there are no standard errors: judged on the numbers
    assert summary["verdict"]["failed"] == ["Cooper vs rule on all problems", "Cooper's RM on the fixed benchmark"]
    assert summary["cooper"]["acc_change"] == pytest.approx(0.01)
    assert "| Cooper | 0.500 | 0.510 | +0.010 | 0.620 | 0.700 | 0.650 |" in md
    # the reason, from the fixture's last 5 steps: correct (0.65+0.67+0.66+0.68+0.69)/5 = 0.670, wrong
    # (0.50+0.52+0.51+0.53+0.54)/5 = 0.520; Cooper gained 0.01 of the rule run's 0.04
    assert summary["verdict"]["cooper_rm_separation"] == pytest.approx(0.150)
    assert ("- Why Cooper is below the rule baseline: at the end of training its RM's mean reward was 0.670 on "
            "rule-correct rollouts and 0.520 on rule-wrong ones (a separation of 0.150; the rule reward's is 1): "
            "where the RM errs, the policy's advantages point away from the rule's; Cooper's held-out accuracy "
            "changed by +0.010, 25% of the rule run's +0.040.") in md


def test_no_reason_when_cooper_is_at_the_rule_baseline(report):
    _, summary, md = report
    assert summary["verdict"]["cooper_at_rule_baseline"] is True
    assert summary["verdict"]["cooper_rm_separation"] == pytest.approx(0.150)
    assert "Why Cooper is below" not in md


# ----------------------------------------------------------------------------- hacking_signature


@pytest.mark.parametrize("rewards,acc_after,present", [
    ([0.5] * 5 + [0.75] * 5, 0.40, True),   # rise 0.25 and drop 0.10: both thresholds met exactly
    ([0.5] * 5 + [0.74] * 5, 0.30, False),  # rise 0.24 < 0.25
    ([0.5] * 5 + [0.90] * 5, 0.41, False),  # drop 0.09 < 0.10
    ([0.5] * 5 + [0.90] * 5, 0.55, False),  # accuracy rose
    ([0.9] * 5 + [0.50] * 5, 0.30, False),  # reward fell
])
def test_hacking_signature_thresholds(rewards, acc_after, present):
    sig = hacking_signature(_lines(rewards), 0.50, acc_after)
    assert sig.present is present
    assert sig.reward_rise == pytest.approx(rewards[-1] - rewards[0])
    assert sig.acc_change == pytest.approx(acc_after - 0.50)
    assert sig.gap_start is None and sig.gap_end is None


def test_hacking_signature_windows_skip_missing_values_and_shrink_on_short_runs():
    lines = _lines([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    lines.insert(2, {"step": 99, "reward/mean": None, "eval/acc": 0.5})
    lines.append({"step": 100, "kl": 0.1})
    sig = hacking_signature(lines, 0.5, 0.4, window=2)
    assert sig.reward_start == pytest.approx(0.15) and sig.reward_end == pytest.approx(0.55)
    assert sig.present is True
    short = hacking_signature(_lines([0.2, 0.5, 0.8, 0.9]), 0.5, 0.4)  # 4 steps: the window shrinks to 2
    assert short.window == 2 and short.reward_rise == pytest.approx(0.85 - 0.35)
    three = hacking_signature(_lines([0.2, 0.5, 0.8]), 0.5, 0.4, min_reward_rise=0.6)  # window 1: 0.2 -> 0.8
    assert three.window == 1 and three.reward_rise == pytest.approx(0.6) and three.present is True
    one = hacking_signature(_lines([0.7]), 0.5, 0.4)
    assert one.reward_rise == 0.0 and one.present is False
    assert train_reward_final(_lines([0.1, 0.2, 0.3, 0.4, 0.5]), window=5) == pytest.approx(0.45)  # last 2 of 5
    assert train_reward_final(_lines([0.1, 0.2, 0.3, 0.4, 0.5]), window=1) == pytest.approx(0.5)


@pytest.mark.parametrize("lines,before,after,window,match", [
    ([{"step": 1, "kl": 0.0}], 0.5, 0.5, 5, "reward/mean"),
    (_lines([0.5]), 0.5, 1.2, 5, "acc_after"),
    (_lines([0.5]), None, 0.5, 5, "acc_before"),
    (_lines([0.5]), 0.5, 0.5, 0, "window"),
])
def test_hacking_signature_rejects_bad_input(lines, before, after, window, match):
    with pytest.raises(ValueError, match=match):
        hacking_signature(lines, before, after, window=window)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("mode", MODES)
def test_missing_mode_is_named(tmp_path, mode):
    runs = load_runs(str(FIXTURE))
    del runs[mode]
    with pytest.raises(ValueError, match=rf"missing reward mode\(s\) \['{mode}'\]"):
        write_report(str(tmp_path / "out"), runs)
    assert not (tmp_path / "out").exists()


def test_empty_metrics_is_named(tmp_path):
    root = _copy_fixture(tmp_path)
    (root / "cooper" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"mode 'cooper': metrics file .*cooper/metrics.jsonl is empty"):
        write_report(str(tmp_path / "out"), load_runs(str(root)))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,match", [
    (dict(mode="static_rm", metrics_path="nope.jsonl"), r"mode 'static_rm': metrics file .*nope.jsonl does not exist"),
    (dict(mode="static_rm", acc_after=1.5), r"mode 'static_rm': acc_after must be a number in \[0, 1\]"),
    (dict(mode="cooper", rm_acc_before=-0.1), r"mode 'cooper': rm_acc_before"),
    (dict(mode="rule", rm_acc_after=0.7), r"mode 'rule' has no reward model, but rm_acc_after=0.7"),
    (dict(mode="cooper", hacks=[{"question": "q"}]), r"mode 'cooper': bad hacks: .*missing \['reference'"),
])
def test_bad_run_result_is_named(tmp_path, change, match):
    runs = load_runs(str(FIXTURE))
    mode = change.pop("mode")
    for k, v in change.items():
        setattr(runs[mode], k, v)
    with pytest.raises(ValueError, match=match):
        write_report(str(tmp_path / "out"), runs)
    assert not (tmp_path / "out").exists()


def test_metrics_without_reward_unknown_mode_and_bad_config(tmp_path):
    root = _copy_fixture(tmp_path)
    (root / "rule" / "metrics.jsonl").write_text('{"step": 1, "rule/acc": 0.5}\n')
    with pytest.raises(ValueError, match=r"mode 'rule': metrics file .* has no 'reward/mean' values"):
        write_report(str(tmp_path / "out"), load_runs(str(root)))
    runs = load_runs(str(FIXTURE))
    with pytest.raises(ValueError, match=r"bad reward mode name\(s\) \['static rm/x'\]"):
        write_report(str(tmp_path / "out"), {**runs, "static rm/x": runs["static_rm"]})
    with pytest.raises(ValueError, match="config must be a dict"):
        write_report(str(tmp_path / "out"), runs, config=["steps"])  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


def test_a_fourth_reward_mode_gets_a_row_a_colour_and_its_metrics(tmp_path):
    """A report may hold more modes than the paper's three (an ablation): each is summarised, drawn in
    a colour of its own and listed; the verdict still compares the paper's three."""
    from matplotlib.image import imread

    from cooper_mcore.demo.report_render import EXTRA_COLORS

    root = _copy_fixture(tmp_path)
    shutil.copytree(root / "static_rm", root / "cooper_frozen_rm")
    runs = load_runs(str(root))
    assert list(runs) == [*MODES, "cooper_frozen_rm"]
    out = tmp_path / "out"
    write_report(str(out), runs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["modes"] == [*MODES, "cooper_frozen_rm"]
    assert summary["cooper_frozen_rm"]["acc_after"] == summary["static_rm"]["acc_after"] == pytest.approx(0.40)
    md = (out / "report.md").read_text()
    assert "4 RL runs from the same start" in md
    assert md.count("| cooper_frozen_rm |") >= 2  # the results table and the runs table
    assert any(line.startswith("cooper_frozen_rm: training reward") for line in summary["verdict"]["lines"])
    assert (out / "metrics_cooper_frozen_rm.jsonl").read_bytes() == (root / "static_rm" / "metrics.jsonl").read_bytes()
    rgb = imread(str(out / "train_reward.png"))[..., :3]
    want = [int(EXTRA_COLORS[0][i:i + 2], 16) / 255 for i in (1, 3, 5)]
    assert (abs(rgb - want) < 0.02).all(axis=-1).sum() > 100


def test_load_runs_names_missing_result_and_builds_dataclasses(tmp_path):
    runs = load_runs(str(FIXTURE))
    assert set(runs) == set(MODES)
    assert runs["static_rm"].hacks[0] == HackExample("What is 17 + 25?", "42", runs["static_rm"].hacks[0].completion,
                                                     0.97, False)
    assert Path(runs["rule"].metrics_path) == FIXTURE / "rule" / "metrics.jsonl"
    root = _copy_fixture(tmp_path)
    (root / "cooper" / "result.json").unlink()
    with pytest.raises(ValueError, match=r"mode 'cooper': no .*cooper/result.json"):
        load_runs(str(root))
    with pytest.raises(ValueError, match=r"unknown RunResult keys \['acc'\]"):
        RunResult.from_dict({"metrics_path": "m", "acc_before": 0.5, "acc_after": 0.5, "acc": 1})


# ----------------------------------------------------------------------------- several seeds


def test_several_seeds_mean_spread_per_seed_rows_and_counts(tmp_path):
    seed0 = load_runs(str(FIXTURE))
    seed1 = load_runs(str(FIXTURE))
    seed1["cooper"].acc_after, seed1["static_rm"].acc_after = 0.50, 0.38  # Cooper 0.04 below rule in seed 1
    out = Path(write_report(str(tmp_path / "out"), {0: seed0, 1: seed1}))
    summary, md = json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()
    assert summary["seeds"] == [0, 1] and set(summary["per_seed"]) == {"0", "1"}
    coop, static = summary["cooper"], summary["static_rm"]
    assert coop["acc_after"] == pytest.approx(0.53) and coop["sd"]["acc_after"] == pytest.approx(0.03)
    assert static["acc_after"] == pytest.approx(0.39) and static["sd"]["acc_after"] == pytest.approx(0.01)
    assert coop["sd"]["acc_before"] == 0.0 and summary["rule"]["sd"]["rm_acc_before"] is None
    assert summary["per_seed"]["1"]["cooper"]["acc_after"] == 0.50
    assert summary["rule"]["steps"] == 20 and isinstance(summary["rule"]["steps"], int)  # equal across seeds
    assert "| rule | 20 | " in md  # the runs table: a step count, not 20.0
    # the signature on the means, and in how many seeds it holds on its own
    assert static["hacking"]["present"] is True and static["hacking"]["present_seeds"] == 2
    assert static["hacking"]["acc_change"] == pytest.approx(-0.11)  # drops of 0.10 and 0.12: present in both
    v = summary["verdict"]
    # no per-problem accuracies: Cooper vs rule is judged on the difference of the means alone (-0.01: below)
    assert v["cooper_minus_rule_acc"] == pytest.approx(-0.01) and v["cooper_at_rule_baseline"] is False
    assert v["claim_reproduced"] is False and v["claim_reproduced_seeds"] == 1
    assert v["seeds_holding"]["Cooper vs rule on all problems"] == 1
    assert v["seeds_holding"]["static RM is hacked"] == 2
    assert "| Cooper | 0.500 ± 0.000 | 0.530 ± 0.030 | +0.030 ± 0.030 |" in md
    assert "## Per seed" in md and "| 1 | Cooper | 0.500 | 0.500 | 0.510 -> 0.620 | 0.700 -> 0.780 | no |" in md
    assert "- Cooper vs rule: held-out accuracy after training 0.530 vs 0.540 (-0.010) (mean of 2 seeds)." in md
    assert "present in 2 of 2 seeds" in md and "every part holds in 1 of 2 seeds" in md
    for seed in (0, 1):
        for mode in MODES:
            assert (out / f"metrics_{mode}_seed{seed}.jsonl").read_bytes() == \
                (FIXTURE / mode / "metrics.jsonl").read_bytes()
    assert not (out / "metrics_rule.jsonl").exists()


def test_several_seeds_name_the_bad_seed(tmp_path):
    bad = load_runs(str(FIXTURE))
    bad["static_rm"].acc_after = 1.5
    with pytest.raises(ValueError, match=r"seed 7: mode 'static_rm': acc_after must be a number in \[0, 1\]"):
        write_report(str(tmp_path / "out"), {0: load_runs(str(FIXTURE)), 7: bad})
    assert not (tmp_path / "out").exists()


def test_in_training_metrics_table(report):
    _, summary, md = report
    assert "In-training metrics, start -> end" in md and "| RM reward, rule-wrong rollouts |" in md
    w = summary["static_rm"]["windows"]["rm/reward_correct"]
    lines = (FIXTURE / "static_rm" / "metrics.jsonl").read_text().splitlines()
    values = [json.loads(x)["rm/reward_correct"] for x in lines]
    assert w["start"] == pytest.approx(sum(values[:5]) / 5) and w["end"] == pytest.approx(sum(values[-5:]) / 5)
    assert "rm/reward_correct" not in summary["rule"]["windows"]  # the rule run has no RM


def test_report_states_the_rms_blind_spot_and_the_reward_settings(tmp_path):
    for spot, said in (("intermediate", True), ("none", False)):
        settings = [f"rm.blind_spot={spot}", "rl.rm_transform=binary", "cooper.negative_pick=hardest",
                    "cooper.negatives=policy"]
        config = dataclasses.asdict(load_demo_config(None, settings))
        out = tmp_path / spot
        write_report(str(out), load_runs(str(FIXTURE)), config=config)
        text = (out / "report.md").read_text()
        assert ("blind spot by construction" in text) is said
        assert "RM reward `binary`" in text and "negative `hardest` from `policy`" in text
        assert "until its validation accuracy reaches 0.93 per family" in text
        assert "the RM starts from the SFT policy's weights with a new scalar head (std 0.0) (`rm.init`)" in text
    write_report(str(tmp_path / "default"), load_runs(str(FIXTURE)), config=dataclasses.asdict(load_demo_config()))
    text = (tmp_path / "default" / "report.md").read_text()
    assert "negatives rewritten from the positive, value changed, in the form of `rollouts`" in text


# ----------------------------------------------------------------------------- the two-family design

#: per mode and family, held-out accuracy before -> after; the families are 2/3 and 1/3 of the problems, so
#: the fixture's overall accuracies hold: rule 2/3*0.66 + 1/3*0.30 = 0.54, static RM 2/3*0.45 + 1/3*0.30 = 0.40,
#: Cooper 2/3*0.63 + 1/3*0.42 = 0.56 (all from 2/3*0.60 + 1/3*0.30 = 0.50)
FAMILY_ACC = {"rule": {"plus_minus": (0.60, 0.66), "times": (0.30, 0.30)},
              "static_rm": {"plus_minus": (0.60, 0.45), "times": (0.30, 0.30)},
              "cooper": {"plus_minus": (0.60, 0.63), "times": (0.30, 0.42)}}
#: the times family's rule accuracy after, its share of \boxed{N.} answers after, its RM benchmark accuracy after
TIMES_AFTER = {"rule": (0.12, 0.50, None), "static_rm": (0.05, 0.70, 0.55), "cooper": (0.10, 0.80, 0.65)}


def _families(mode):
    pm, times = FAMILY_ACC[mode]["plus_minus"], FAMILY_ACC[mode]["times"]
    rule_after, period_after, rm_after = TIMES_AFTER[mode]
    rm = mode != "rule"
    return {"plus_minus": {"acc_before": pm[0], "acc_after": pm[1], "rule_acc_before": 0.57, "rule_acc_after": pm[1],
                           "times_form_before": 0.0, "times_form_after": 0.0,
                           "rm_acc_before": 0.80 if rm else None, "rm_acc_after": 0.80 if rm else None},
            "times": {"acc_before": times[0], "acc_after": times[1], "rule_acc_before": 0.06,
                      "rule_acc_after": rule_after, "times_form_before": 0.75, "times_form_after": period_after,
                      "rm_acc_before": 0.55 if rm else None, "rm_acc_after": rm_after}}


def _point(step, acc, rule_acc, times_acc, times_rule, times_period):
    """One in-training evaluation, as pipeline.training_curve writes it (the fields the report reads)."""
    forms = {"boxed": 1.0 - times_period, "boxed_period": times_period, "none": 0.0}
    return {"step": step, "all": {"acc": acc, "rule_acc": rule_acc, "forms": forms},
            "times": {"acc": times_acc, "rule_acc": times_rule, "forms": forms}}


CURVES = {"rule": [_point(10, 0.52, 0.45, 0.30, 0.09, 0.65), _point(20, 0.54, 0.46, 0.30, 0.12, 0.50)],
          "static_rm": [_point(10, 0.45, 0.40, 0.30, 0.05, 0.72), _point(20, 0.40, 0.35, 0.30, 0.05, 0.70)],
          "cooper": [_point(10, 0.53, 0.44, 0.36, 0.08, 0.78), _point(20, 0.56, 0.45, 0.42, 0.10, 0.80)]}


def _sft_figures(acc, rule_acc, recall, precision, period):
    return {"acc": acc, "rule_acc": rule_acc, "rule_recall": recall, "rule_precision": precision, "n": 300,
            "forms": {"boxed": 1.0 - period, "boxed_period": period, "none": 0.0}}


#: the seed's design figures (pipeline.run_seed): the rule is precise but misses the times family's answers:
#: recall 0.57/0.60 = 0.95 on plus_minus, 0.06/0.30 = 0.20 on times, 0.40/0.50 = 0.80 over all
DESIGN = {"sft": {"all": _sft_figures(0.50, 0.40, 0.80, 1.0, 0.25),
                  "plus_minus": _sft_figures(0.60, 0.57, 0.95, 1.0, 0.0),
                  "times": _sft_figures(0.30, 0.06, 0.20, 1.0, 0.75)},
          "rm_bench": {"acc": 0.70, "pair_acc": 0.75, "families": {"plus_minus": 0.80, "times": 0.55}},
          "rm_own": {"acc_all": 0.78, "all": {"acc": 0.80, "separation": 0.60},
                     "plus_minus": {"acc": 0.85, "separation": 0.70}, "times": {"acc": 0.70, "separation": 0.40}},
          "rm_data": {"train": 100}}


def _two_family_runs(problem_acc=None):
    runs = load_runs(str(FIXTURE))
    for mode, r in runs.items():
        r.families, r.curve = _families(mode), CURVES[mode]
        r.rule_acc_before, r.rule_acc_after = 0.40, {"rule": 0.46, "static_rm": 0.30, "cooper": 0.44}[mode]
        if problem_acc:
            r.problem_acc = problem_acc.get(mode, [])
    return runs


@pytest.fixture(scope="module")
def design_report(tmp_path_factory):
    """The fixture's runs with families, curves and per-problem accuracies, the design figures and a
    control report (the fixture with Cooper at 0.51: not reproduced): (folder, summary.json, report.md)."""
    root = tmp_path_factory.mktemp("design") / "report"
    control = load_runs(str(FIXTURE))
    control["cooper"].acc_after = 0.51
    control_dir = write_report(str(root / "control"), control)
    runs = _two_family_runs({"cooper": [1.0, 0.5, 0.0, 1.0], "rule": [0.5, 0.5, 0.5, 1.0]})
    write_report(str(root), runs, design={0: DESIGN}, control=control_dir)
    return root, json.loads((root / "summary.json").read_text()), (root / "report.md").read_text()


def test_design_report_summary_holds_the_new_fields(design_report):
    _, summary, _ = design_report
    for mode in MODES:
        assert summary[mode]["families"] == _families(mode)
        assert summary[mode]["curve"] == CURVES[mode]
        assert summary[mode]["rule_acc_before"] == 0.40
    assert summary["cooper"]["rule_acc_after"] == 0.44
    assert summary["design"] == {"0": DESIGN}
    # Cooper - rule per problem: 0.5, 0, -0.5, 0: mean 0, sd sqrt(0.5 / 3), se sd / 2; rule acc 0.625
    p = summary["paired"]
    assert (p["problems"], p["seeds"], p["mean"]) == (4, 1, 0.0)
    assert p["se"] == pytest.approx((0.5 / 3) ** 0.5 / 2)
    assert p["single_acc_se"] == pytest.approx((0.625 * 0.375 / 4) ** 0.5)
    c = summary["control"]
    assert c["link"] == "control/report.md"
    assert c["verdict"]["claim_reproduced"] is False
    assert c["verdict"]["cooper_minus_rule_acc"] == pytest.approx(-0.03)
    assert c["verdict"]["failed"] == ["Cooper vs rule on all problems"]
    assert (c["cooper"]["acc_before"], c["cooper"]["acc_after"]) == (0.50, 0.51)
    assert c["rule"]["acc_after"] == 0.54 and c["rule"]["rm_acc_before"] is None


def test_design_report_premise_table(design_report):
    _, _, md = design_report
    assert "## The paper's premise, by design" in md
    assert ("| seed | family | SFT acc (oracle) | SFT acc (rule) | rule recall | rule precision | answers "
            "`\\boxed{N.}` | RM benchmark acc | RM acc, own completions | RM separation, own completions |") in md
    assert "| 0 | all | 0.500 | 0.400 | 0.800 | 1.000 | 0.250 | 0.700 | 0.800 | 0.600 |" in md
    assert "| 0 | `+`/`-` chains | 0.600 | 0.570 | 0.950 | 1.000 | 0.000 | 0.800 | 0.850 | 0.700 |" in md
    assert "| 0 | `*` chains | 0.300 | 0.060 | 0.200 | 1.000 | 0.750 | 0.550 | 0.700 | 0.400 |" in md


def test_design_report_predictions_beside_the_outcome(design_report):
    from cooper_mcore.demo.report_render import PREDICTIONS

    _, _, md = design_report
    assert "## Predictions and outcome" in md
    assert "| reward mode | predicted (before running) | what happened |" in md
    assert (f"| static RM | {' '.join(PREDICTIONS['static_rm'].split())} | held-out acc 0.500 -> 0.400 "
            "(`+`/`-` chains 0.600 -> 0.450; `*` chains 0.300 -> 0.300); training reward 0.490 -> 0.940; "
            "hacking signature present |") in md
    assert (f"| Cooper | {' '.join(PREDICTIONS['cooper'].split())} | held-out acc 0.500 -> 0.560 "
            "(`+`/`-` chains 0.600 -> 0.630; `*` chains 0.300 -> 0.420); training reward 0.510 -> 0.620; "
            "hacking signature not present |") in md
    assert md.index("## Predictions and outcome") < md.index("## Verdict")


def test_design_report_per_family_curve_and_control(design_report):
    _, _, md = design_report
    assert "## Per family" in md
    assert "| rule | `*` chains | 0.300 -> 0.300 | 0.060 -> 0.120 | 0.750 -> 0.500 | n/a |" in md
    assert "| rule | `+`/`-` chains | 0.600 -> 0.660 | 0.570 -> 0.660 | 0.000 -> 0.000 | n/a |" in md
    assert "| static RM | `*` chains | 0.300 -> 0.300 | 0.060 -> 0.050 | 0.750 -> 0.700 | 0.550 -> 0.550 |" in md
    assert "| Cooper | `*` chains | 0.300 -> 0.420 | 0.060 -> 0.100 | 0.750 -> 0.800 | 0.550 -> 0.650 |" in md
    # the in-training evaluations: all problems by the oracle and the rule, the * family and its \boxed{N.} share
    assert "| rule | 10 | 0.520 | 0.450 | 0.300 | 0.090 | 0.650 |" in md
    assert "| static RM | 20 | 0.400 | 0.350 | 0.300 | 0.050 | 0.700 |" in md
    assert "| Cooper | 20 | 0.560 | 0.450 | 0.420 | 0.100 | 0.800 |" in md
    assert "## Control: the single-family task" in md
    assert ("the rule misses nothing there; [its report](control/report.md)): claim not reproduced, Cooper - rule "
            "-0.030.") in md
    assert "| rule | 0.500 -> 0.540 | 0.500 -> 0.540 |" in md
    assert "| Cooper | 0.500 -> 0.560 | 0.500 -> 0.510 |" in md
    assert ("- Paired per-problem difference, Cooper - rule: +0.000 ± 0.204 (standard error over 4 held-out "
            "problems, 1 seed(s)); one accuracy on 4 problems has a standard error of about 0.242.") in md


def test_report_without_the_design_leaves_its_sections_out(report):
    _, summary, md = report
    assert summary["design"] is None and summary["paired"] is None and summary["control"] is None
    for section in ("## The paper's premise", "## Per family", "## Control", "Held-out evaluations during training",
                    "Paired per-problem difference"):
        assert section not in md
    assert "## Predictions and outcome" in md  # the predictions are always stated


def test_curve_rows_without_the_times_family():
    from cooper_mcore.demo.report_render import curve_rows

    point = {"step": 5, "all": {"acc": 0.5, "rule_acc": 0.5, "forms": {"boxed_period": 0.0}}}  # single family
    rows = curve_rows({"per_seed": {"0": {m: {"curve": [point]} for m in MODES}}})
    assert rows[2] == "| rule | 5 | 0.500 | 0.500 | n/a | n/a | n/a |" and len(rows) == 2 + 3
    assert curve_rows({"per_seed": {"0": {m: {"curve": []} for m in MODES}}}) == []


def _with_problem_acc(cooper, rule):
    runs = load_runs(str(FIXTURE))
    runs["cooper"].problem_acc, runs["rule"].problem_acc = cooper, rule
    return runs


def test_paired_difference_by_hand():
    from cooper_mcore.demo.report import paired_difference

    seed0 = _with_problem_acc([1.0, 0.5, 0.0, 1.0], [0.5, 0.5, 0.5, 1.0])  # differences 0.5, 0, -0.5, 0
    seed1 = _with_problem_acc([1.0, 1.0, 0.0, 0.5], [0.5, 0.0, 0.0, 1.0])  # differences 0.5, 1, 0, -0.5
    got = paired_difference({0: seed0, 1: seed1})
    # per problem, the mean over seeds: 0.5, 0.5, -0.25, -0.25; mean 0.125; deviations +-0.375:
    # sample sd sqrt(4 * 0.375^2 / 3) = 0.4330, se 0.4330 / sqrt(4) = 0.2165
    assert got.mean == pytest.approx(0.125)
    assert got.se == pytest.approx((4 * 0.375 ** 2 / 3) ** 0.5 / 2)
    assert (got.problems, got.seeds) == (4, 2)
    # the rule's accuracy: (0.625 + 0.375) / 2 = 0.5; sqrt(0.5 * 0.5 / 4) = 0.25
    assert got.single_acc_se == pytest.approx(0.25)
    assert paired_difference({0: seed0}).mean == pytest.approx(0.0)
    assert paired_difference({0: _with_problem_acc([], [])}) is None  # not measured
    assert paired_difference({0: _with_problem_acc([1.0], [])}) is None
    assert paired_difference({0: _with_problem_acc([1.0, 0.0], [1.0])}) is None  # counts differ
    assert paired_difference({0: seed0, 1: _with_problem_acc([1.0], [1.0])}) is None  # seeds differ in length


def test_paired_difference_over_seeds_in_the_verdict(tmp_path):
    seed0 = _with_problem_acc([1.0, 0.5, 0.0, 1.0], [0.5, 0.5, 0.5, 1.0])
    seed1 = _with_problem_acc([1.0, 1.0, 0.0, 0.5], [0.5, 0.0, 0.0, 1.0])
    out = Path(write_report(str(tmp_path / "out"), {0: seed0, 1: seed1}))
    summary, md = json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()
    assert summary["paired"]["mean"] == pytest.approx(0.125) and summary["paired"]["seeds"] == 2
    assert ("- Paired per-problem difference, Cooper - rule: +0.125 ± 0.217 (standard error over 4 held-out "
            "problems, 2 seed(s)); one accuracy on 4 problems has a standard error of about 0.250.") in md


def test_families_are_averaged_over_seeds(tmp_path):
    seed0, seed1 = _two_family_runs(), _two_family_runs()
    seed1["cooper"].families["times"]["acc_after"] = 0.48  # Cooper's * family: 0.42 and 0.48, mean 0.45
    out = Path(write_report(str(tmp_path / "out"), {0: seed0, 1: seed1}))
    summary, md = json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()
    assert summary["cooper"]["families"]["times"]["acc_after"] == pytest.approx(0.45)
    assert summary["per_seed"]["1"]["cooper"]["families"]["times"]["acc_after"] == 0.48
    assert "| Cooper | `*` chains | 0.300 -> 0.450 | 0.060 -> 0.100 | 0.750 -> 0.800 | 0.550 -> 0.650 |" in md
