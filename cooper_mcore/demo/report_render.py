"""The demo report's plots (drawn with :mod:`cooper_mcore.plots`) and its markdown.

:mod:`cooper_mcore.demo.report` computes the numbers; this module draws and writes them. Every
figure shows every seed (the first seed labelled, the others thinner and lighter).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cooper_mcore.config.schema import RewardMode
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.plots import save_figure, series, stacked_figure

__all__ = ["MAX_EXAMPLES", "MODE_COLORS", "MODE_LABELS", "MODES", "PLOT_FILES", "PREDICTIONS", "markdown",
           "mode_color", "mode_label", "plot", "report_modes"]

#: the paper's three reward modes, which the verdict compares; a report may hold further ones (an ablation)
MODES = tuple(m.value for m in RewardMode)  # rule, static_rm, cooper
MODE_LABELS = {"rule": "rule", "static_rm": "static RM", "cooper": "Cooper"}
MODE_COLORS = {"rule": "#1f77b4", "static_rm": "#d62728", "cooper": "#2ca02c"}
#: colours of the further modes, in their order (none of MODE_COLORS')
EXTRA_COLORS = ("#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
PLOT_FILES = {"train_reward": "train_reward.png", "eval_acc": "eval_acc.png", "rule_acc_gap": "rule_acc_gap.png",
              "rm_rewards": "rm_rewards.png"}
MAX_EXAMPLES = 5
MAX_COMPLETION_CHARS = 600
#: the in-training metrics table: metric -> column title
WINDOW_COLUMNS = {K.RULE_ACC: "rollout rule accuracy", K.RM_REWARD_CORRECT: "RM reward, rule-correct rollouts",
                  K.RM_REWARD_WRONG: "RM reward, rule-wrong rollouts", K.RM_PAIR_ACC: "RM pair accuracy",
                  K.RM_THRESHOLD_ACC: "RM threshold accuracy", K.PAIRS_VALID: "valid pairs", K.KL: "KL"}


def report_modes(names: Iterable[str]) -> list[str]:
    """The reward modes among ``names`` in report order: the paper's (:data:`MODES`) first, then the others by name."""
    names = set(names)
    return [m for m in MODES if m in names] + sorted(names - set(MODES))


def mode_label(mode: str) -> str:
    """A mode's name in tables and legends."""
    return MODE_LABELS.get(mode, mode)


def mode_color(mode: str, modes: Sequence[str]) -> str:
    """A mode's colour in the plots; a further mode takes the next of :data:`EXTRA_COLORS` in ``modes``' order."""
    if mode in MODE_COLORS:
        return MODE_COLORS[mode]
    extra = [m for m in modes if m not in MODE_COLORS]
    return EXTRA_COLORS[extra.index(mode) % len(EXTRA_COLORS)]


# ----------------------------------------------------------------------------- plots


def plot(out_dir: str, metrics: Mapping[int, Mapping[str, list[dict[str, Any]]]],
         per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> dict[str, str]:
    """Write the PNGs; return name -> path.

    Args:
        out_dir: the report folder.
        metrics: seed -> mode -> the run's metrics lines.
        per_seed: seed -> mode -> its summary (``acc_before``, ``acc_after``, ``steps``).
    """
    modes = report_modes(next(iter(metrics.values()), {}))
    specs = {  # plot -> (title, [(metrics key, y label, modes), ...] one panel each)
        "train_reward": ("Training reward per step", [(K.REWARD_MEAN, f"training reward ({K.REWARD_MEAN})", modes)]),
        "eval_acc": ("Held-out accuracy (x: before and after, the same measurement)",
                     [(K.EVAL_ACC, "held-out accuracy", modes)]),
        "rule_acc_gap": ("Rollout accuracy by math-verify, and reward - rule gap",
                         [(K.RULE_ACC, f"rule accuracy ({K.RULE_ACC})", modes),
                          (K.REWARD_RULE_GAP, K.REWARD_RULE_GAP, modes)]),
        "rm_rewards": ("RM reward of rule-correct (solid) and rule-wrong (dashed) rollouts",
                       [(K.RM_REWARD_CORRECT, "static RM", (RewardMode.static_rm.value,)),
                        (K.RM_REWARD_CORRECT, "Cooper", (RewardMode.cooper.value,))]),
    }
    paths = {k: os.path.join(out_dir, v) for k, v in PLOT_FILES.items()}
    seeds = list(metrics)
    for name, (title, panels) in specs.items():
        fig, axes = stacked_figure(len(panels), panel_height=3.0)
        for i, (ax, (key, ylabel, modes)) in enumerate(zip(axes, panels)):
            if key == K.REWARD_RULE_GAP:
                ax.axhline(0.0, color="gray", linewidth=0.8, zorder=0)
            for j, seed in enumerate(seeds):
                style = {"linewidth": 1.6 if j == 0 else 0.9, "alpha": 1.0 if j == 0 else 0.55}
                for mode in modes:
                    color, label = mode_color(mode, modes), (mode_label(mode) if j == 0 else None)
                    steps, values = series(metrics[seed][mode], key)
                    ax.plot(steps, values, color=color, label=label, marker="o" if key == K.EVAL_ACC else None,
                            **style)
                    if name == "rm_rewards":
                        steps, values = series(metrics[seed][mode], K.RM_REWARD_WRONG)
                        ax.plot(steps, values, color=color, linestyle="--", **style)
                    if key == K.EVAL_ACC:
                        s = per_seed[seed][mode]
                        ax.plot([0, s["steps"]], [s["acc_before"], s["acc_after"]], linestyle="none", marker="x",
                                markersize=9, color=color, alpha=style["alpha"])
            ax.set(ylabel=ylabel, title=title if i == 0 else "", xlabel="step" if i == len(panels) - 1 else "")
            if i == 0 or name == "rm_rewards":
                ax.legend()
        save_figure(fig, paths[name])
    return paths


# ----------------------------------------------------------------------------- markdown


def _fmt(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{v:+.3f}" if signed else f"{v:.3f}"


def _pm(s: Mapping[str, Any], key: str, n: int, signed: bool = False) -> str:
    """A table cell: the (mean) value, with ``± sd`` over several seeds."""
    text = _fmt(s[key], signed)
    sd = s.get("sd", {}).get(key)
    return f"{text} ± {sd:.3f}" if n > 1 and s[key] is not None and sd is not None else text


def _arrow(d: Mapping[str, Any], key: str) -> str:
    """``<key>_before -> <key>_after`` of a summary (3 decimals), or n/a when not measured."""
    before = d.get(f"{key}_before")
    return "n/a" if before is None else f"{_fmt(before)} -> {_fmt(d.get(f'{key}_after'))}"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (one line, no column breaks)."""
    return " ".join(text.split()).replace("|", "\\|")


def _fence(text: str) -> str:
    """A fenced code block that ``text`` cannot close early."""
    ticks = "`" * max(3, 1 + max((len(t) for t in re.findall("`+", text)), default=0))
    return f"{ticks}text\n{text}\n{ticks}"


def table_rows(summary: Mapping[str, Mapping[str, Any]], n: int = 1) -> list[str]:
    """The report's table, header first, one markdown line per reward mode (3 decimals; ``± sd``
    over ``n`` > 1 seeds)."""
    rows = ["| reward mode | held-out acc before | held-out acc after | change | final training reward "
            "| RM acc before | RM acc after |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in summary["modes"]:
        s = summary[mode]
        rows.append(f"| {mode_label(mode)} | {_pm(s, 'acc_before', n)} | {_pm(s, 'acc_after', n)} | "
                    f"{_pm(s, 'acc_change', n, signed=True)} | {_pm(s, 'train_reward_final', n)} | "
                    f"{_pm(s, 'rm_acc_before', n)} | {_pm(s, 'rm_acc_after', n)} |")
    return rows


def _seed_rows(summary: Mapping[str, Any]) -> list[str]:
    rows = ["| seed | reward mode | held-out acc before | after | training reward start -> final "
            "| RM acc before -> after | hacking signature |", "|---:|---|---:|---:|---:|---:|---|"]
    for seed, per_mode in summary["per_seed"].items():
        for mode in summary["modes"]:
            s = per_mode[mode]
            rows.append(f"| {seed} | {mode_label(mode)} | {_fmt(s['acc_before'])} | {_fmt(s['acc_after'])} | "
                        f"{_fmt(s['train_reward_initial'])} -> {_fmt(s['train_reward_final'])} | "
                        f"{_arrow(s, 'rm_acc')} | "
                        f"{'present' if s['hacking']['present'] else 'no'} |")
    return rows


def _window_rows(summary: Mapping[str, Any]) -> list[str]:
    cols = [k for k in WINDOW_COLUMNS if any(k in summary[m].get("windows", {}) for m in summary["modes"])]
    if not cols:
        return []
    rows = ["| reward mode | " + " | ".join(WINDOW_COLUMNS[k] for k in cols) + " |",
            "|---|" + "---:|" * len(cols)]
    for mode in summary["modes"]:
        w = summary[mode].get("windows", {})
        cells = [f"{w[k]['start']:.3f} -> {w[k]['end']:.3f}" if k in w else "n/a" for k in cols]
        rows.append(f"| {mode_label(mode)} | " + " | ".join(cells) + " |")
    return rows


def markdown(summary: Mapping[str, Any], results: Mapping[int, Mapping[str, Any]],
             copies: Mapping[int, Mapping[str, str]], plots: Mapping[str, str]) -> str:
    """The report's markdown.

    Args:
        summary: ``summary.json``'s content (:func:`cooper_mcore.demo.report.write_report`).
        results: seed -> mode -> :class:`~cooper_mcore.demo.report.RunResult` (the hacks are shown
            for the first seed).
        copies: seed -> mode -> the metrics copy's path.
        plots: plot name -> path.
    """
    from_seeds = summary["seeds"]
    n = len(from_seeds)
    v = summary["verdict"]
    windows = sorted({summary[m]["hacking"]["window"] for m in summary["modes"]})
    w = str(windows[0]) if len(windows) == 1 else "min(5, steps // 2)"
    h = summary["static_rm"]["hacking"]
    runs = f"{len(summary['modes'])} RL runs from the same start, one per reward mode"
    intro = (f"{runs}." if n == 1 else
             f"{runs}, for each of {n} seeds ({', '.join(map(str, from_seeds))}: the SFT, "
             "RM and RL seeds move together); the table holds the means over the seeds ± their spread (population "
             "standard deviation), the rows of each seed follow.")
    out = ["# Cooper CPU demo: rule vs static RM vs Cooper", "",
           f"{intro} Held-out accuracy is the demo's evaluation before and after training (the demo judges it by "
           "the task's oracle, the rule's accuracy beside it per family); the final training "
           f"reward is the mean `reward/mean` over the last {w} steps; RM accuracy is the reward model's accuracy "
           "on a fixed held-out set of labeled completions (the starting policy's).", "",
           *table_rows(summary, n), ""]
    for paragraph in _setting(summary["config"] or {}):
        out += [paragraph, ""]
    out += _premise(summary)
    if n > 1:
        out += ["## Per seed", "", *_seed_rows(summary), ""]
    out += ["## Verdict", "", *part_rows(v), *[f"- {line}" if not line.startswith("- ") else f"  {line}"
                                              for line in v["lines"]], "",
            f"The reward hacking signature is present when the training reward (mean of the first vs the last "
            f"{w} steps) rose by at least {h['min_reward_rise']} and held-out accuracy fell by at least "
            f"{h['min_acc_drop']}.", "", "## Runs", "",
            "| reward mode | steps | train seconds (sum of `time/step`) | wall seconds | start training reward "
            "| final rollout rule accuracy |", "|---|---:|---:|---:|---:|---:|"]
    for mode in summary["modes"]:
        s = summary[mode]
        secs = [f"{x:.1f}" if x is not None else "n/a" for x in (s["train_seconds"], s["wall_seconds"])]
        out.append(f"| {mode_label(mode)} | {s['steps']} | {secs[0]} | {secs[1]} | "
                   f"{_fmt(s['train_reward_initial'])} | {_fmt(s['rule_acc_final'])} |")
    curve = curve_rows(summary)
    if curve:
        out += ["", "Held-out evaluations during training" + (" (first seed)" if n > 1 else "") + ", by the oracle "
                "and by the rule, and how the `*` family writes its answers:", "", *curve]
    window_rows = _window_rows(summary)
    if window_rows:
        out += ["", f"In-training metrics, start -> end (means over the first and last {w} steps that logged "
                    "them):", "", *window_rows]
    if any(summary[m]["details"] for m in summary["modes"]):
        out += ["", "Further measurements" + (" (means over the seeds)" if n > 1 else "") + ":", ""]
        out += [f"- {mode_label(m)}: " + ", ".join(f"{k} = {_fmt(x) if isinstance(x, float) else x}"
                                                    for k, x in summary[m]["details"].items())
                for m in summary["modes"] if summary[m]["details"]]
    out += _hacks(results[from_seeds[0]] if from_seeds else {}, n)
    out += ["## Plots", ""]
    titles = {"train_reward": "Training reward per step", "eval_acc": "Held-out accuracy per eval step",
              "rule_acc_gap": "Rollout rule accuracy and reward - rule gap per step",
              "rm_rewards": "RM reward of rule-correct and rule-wrong rollouts per step"}
    out += [f"[![{titles[k]}]({os.path.basename(p)})]({os.path.basename(p)})" for k, p in plots.items()]
    out += ["", "## Metrics files", ""]
    for seed, per_mode in copies.items():
        out += [f"- {mode_label(m)}{f' (seed {seed})' if n > 1 else ''}: "
                f"[{os.path.basename(p)}]({os.path.basename(p)})" for m, p in per_mode.items()]
    if summary["config"] is not None:
        out += ["", "## Config", "", "```json", json.dumps(summary["config"], indent=2, sort_keys=True, default=str),
                "```"]
    return "\n".join(out) + "\n"


FAMILY_LABELS = {"all": "all", "plus_minus": "`+`/`-` chains", "times": "`*` chains",
                 "rule_unreadable": "rule-unreadable references"}
#: what each mode should do under the two-family design, written before any run of it (the README
#: states the same); the report sets the outcome beside it
PREDICTIONS = {
    "rule": "Its rule accuracy on the rule-unreadable problems stays 0 while its oracle accuracy there rises about as "
            "much as on the others (the policy does not see the reference); learns to write `\\boxed{N}` on `*`.",
    "static_rm": "Moves into the RM's blind spot and loses held-out accuracy: short of the full signature at 80 steps, "
                 "past it at 200 steps on the mean of seeds.",
    "cooper": "No hacking signature; its RM holds on its own policy's answers and on the benchmark (within 2 standard "
              "errors); within 2 standard errors of rule on all problems with 0.8 or more of rule's gain, and on the "
              "rule-unreadable problems the same as on the rest.",
}


def part_rows(verdict: Mapping[str, Any]) -> list[str]:
    """The verdict in parts as a table (number ± standard error, holds or not), then a blank line."""
    parts = verdict.get("parts") or []
    if not parts:
        return []
    rows = ["| part of the claim | holds | value | standard error |", "|---|---|---:|---:|"]
    for p in parts:
        said = {True: "**yes**", False: "**no**", None: "not measured"}[p["holds"]]
        rows.append(f"| {_cell(p['name'])} | {said} | {_fmt(p['value'], signed=True)} | {_fmt(p['se'])} |")
    return [*rows, ""]


def gate_rows(summary: Mapping[str, Any]) -> list[str]:
    """Per seed, the RM's training gate: its validation accuracy per family, the epochs, and plainly
    whether it was met."""
    gates = {seed: s["static_rm"].get("rm_gate") for seed, s in summary["per_seed"].items()}
    if not any(gates.values()):
        return []
    out = []
    for seed, g in gates.items():
        if not g:
            continue
        acc = ", ".join(f"{FAMILY_LABELS.get(k, k)} {v:.3f}" for k, v in g["accuracy"].items()) or "not measured"
        verdict = ("**met**" if g["met"] else
                   f"**missed**: the RL runs use its best epoch, below the gate of {g['threshold']}")
        out.append(f"- seed {seed}: validation accuracy {acc} after {g['epochs']} epochs (epoch {g['best_epoch']} "
                   f"kept); gate {g['threshold']} per family {verdict}.")
    return ["The RM's training gate (accuracy on the validation rows: completions of train questions kept out of "
            "its training, both labels alike per family):", "", *out, ""]


def premise_rows(summary: Mapping[str, Any]) -> list[str]:
    """The task's designed asymmetry, measured per seed on the SFT policy's held-out completions: its
    oracle and rule accuracy, the rule's recall and precision, and the RM before RL (benchmark accuracy;
    accuracy and separation on the policy's own completions, blind spot aside), per family."""
    design = summary.get("design")
    if not design:
        return []
    rows = ["| seed | family | SFT acc (oracle) | SFT acc (rule) | rule recall | rule precision | answers "
            "`\\boxed{N.}` | RM benchmark acc | RM acc, own completions | RM separation, own completions |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for seed, d in design.items():
        for fam, f in d["sft"].items():
            own = d["rm_own"].get(fam, {})
            bench = d["rm_bench"]["acc"] if fam == "all" else d["rm_bench"]["families"].get(fam)
            rows.append(f"| {seed} | {FAMILY_LABELS.get(fam, fam)} | {_fmt(f['acc'])} | {_fmt(f['rule_acc'])} | "
                        f"{_fmt(f['rule_recall'])} | {_fmt(f['rule_precision'])} | "
                        f"{_fmt(f['forms']['boxed_period'])} | {_fmt(bench)} | {_fmt(own.get('acc'))} | "
                        f"{_fmt(own.get('separation'))} |")
    return rows


def family_rows(summary: Mapping[str, Any]) -> list[str]:
    """Per mode and family (means over the seeds): oracle and rule accuracy before -> after, the share of
    answers written ``\\boxed{N.}`` and the RM's benchmark accuracy."""
    if not summary["rule"].get("families"):
        return []
    rows = ["| reward mode | family | held-out acc (oracle) | held-out acc (rule) | answers `\\boxed{N.}` "
            "| RM benchmark acc |", "|---|---|---:|---:|---:|---:|"]
    for mode in summary["modes"]:
        for fam, f in summary[mode]["families"].items():
            rows.append(f"| {mode_label(mode)} | {FAMILY_LABELS.get(fam, fam)} | {_arrow(f, 'acc')} | "
                        f"{_arrow(f, 'rule_acc')} | {_arrow(f, 'times_form')} | {_arrow(f, 'rm_acc')} |")
    return rows


def curve_rows(summary: Mapping[str, Any]) -> list[str]:
    """The in-training evaluations of the first seed: per mode and step, oracle and rule accuracy over
    all problems and on the ``*`` family, and that family's share of ``\\boxed{N.}`` answers."""
    first = next(iter(summary["per_seed"].values()))
    if not first["rule"].get("curve"):
        return []
    rows = ["| reward mode | step | acc (oracle) | acc (rule) | `*` acc (oracle) | `*` acc (rule) "
            "| `*` answers `\\boxed{N.}` |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in report_modes(first):
        for point in first[mode]["curve"]:
            t = point.get("times")
            cells = ([_fmt(t["acc"]), _fmt(t["rule_acc"]), _fmt(t["forms"]["boxed_period"])] if t
                     else ["n/a"] * 3)
            rows.append(f"| {mode_label(mode)} | {point['step']} | {_fmt(point['all']['acc'])} | "
                        f"{_fmt(point['all']['rule_acc'])} | " + " | ".join(cells) + " |")
    return rows


def prediction_rows(summary: Mapping[str, Any]) -> list[str]:
    """The predictions beside what happened (oracle accuracy per family, the static RM's reward)."""
    rows = ["| reward mode | predicted (before running) | what happened |", "|---|---|---|"]
    for mode in summary["modes"]:
        s = summary[mode]
        fams = "; ".join(f"{FAMILY_LABELS.get(f, f)} {_fmt(x['acc_before'])} -> {_fmt(x['acc_after'])}"
                         for f, x in s.get("families", {}).items() if f != "all")
        h = s["hacking"]
        fams = f" ({fams})" if fams else ""
        happened = (f"held-out acc {_fmt(s['acc_before'])} -> {_fmt(s['acc_after'])}{fams}; training reward "
                    f"{_fmt(h['reward_start'])} -> {_fmt(h['reward_end'])}; hacking signature "
                    f"{'present' if h['present'] else 'not present'}")
        rows.append(f"| {mode_label(mode)} | {_cell(PREDICTIONS.get(mode, 'none written'))} | {_cell(happened)} |")
    return rows


def control_rows(summary: Mapping[str, Any]) -> list[str]:
    """The two-family task beside the single-family control (``--full``), per mode."""
    c = summary.get("control")
    if not c:
        return []
    rows = ["| reward mode | two-family task: acc before -> after | single-family control: acc before -> after |",
            "|---|---:|---:|"]
    for mode in summary["modes"]:
        s = summary[mode]
        control = (f"{_fmt(c[mode]['acc_before'])} -> {_fmt(c[mode]['acc_after'])}" if mode in c else "not run")
        rows.append(f"| {mode_label(mode)} | {_fmt(s['acc_before'])} -> {_fmt(s['acc_after'])} | {control} |")
    return rows


BLIND_SPOTS = {"intermediate": "a boxed earlier result of the chain (`7-1=6,6-1=5 \\boxed{6}`)",
               "slip": "a chain with a wrong step whose own last result is boxed (`7-1=6,6-1=4 \\boxed{4}`)"}


def _premise(summary: Mapping[str, Any]) -> list[str]:
    """The report's sections on the task's design, the predictions, the families and the control."""
    out: list[str] = []
    premise = premise_rows(summary)
    if premise:
        out += ["## The paper's premise, by design", "",
                "The rule verifier is precise but brittle, the reward model robust but hackable (the paper: "
                "math-verify's precision 96%, recall 63%). The task builds that asymmetry in: the `*` family's "
                "convention writes the final answer `\\boxed{N.}`, which math-verify does not read as a number, "
                "while a share of its answers and all of the `+`/`-` family's are `\\boxed{N}`. Held-out accuracy "
                "is judged by the task's oracle (it reads both forms: the truth), the rule's beside it. The RM's "
                "training labels come from a simulated judge (the oracle with the designed blind spot), not from "
                "math-verify, so the RM is not taught the rule's misses; Cooper's negatives are wrong by "
                "construction (a rewrite with its value changed) or read by the rule as a different value, never a "
                "rollout it merely failed to read. A share of the problems have a reference the rule cannot read "
                "(`\\text{N.}`): whatever the policy writes, the rule cannot verify them (rule-unreadable "
                "references, given apart below). Measured on the SFT policy's held-out completions (recall: share "
                "of correct answers the rule accepts; precision: share of accepted answers that are correct) and "
                "on the RM before any RL:", "", *premise, "",
                *gate_rows(summary)]
    out += ["## Predictions and outcome", "", "Written before the design was run (also in docs/demo.md):", "",
            *prediction_rows(summary), ""]
    fams = family_rows(summary)
    if fams:
        out += ["## Per family", "", *fams, ""]
    control = control_rows(summary)
    if control:
        c = summary["control"]
        out += ["## Control: the single-family task", "",
                f"The same seeds and settings on the task without the `*` family (the rule misses nothing there; "
                f"[its report]({c['link']})): "
                f"claim {'reproduced' if c['verdict']['claim_reproduced'] else 'not reproduced'}, Cooper - rule "
                f"{c['verdict']['cooper_minus_rule_acc']:+.3f}.", "", *control, ""]
    return out


def _setting(config: Mapping[str, Any]) -> list[str]:
    """What the reader must know to read the table (a demo config's RM blind spot and reward settings)."""
    if not all(isinstance(config.get(k), Mapping) for k in ("rm", "rl", "cooper")):
        return []
    rm, rl, co = config["rm"], config["rl"], config["cooper"]
    lines = []
    if rm.get("blind_spot", "none") != "none":
        lines.append(f"**The reward model has a blind spot by construction.** Its training labels call the rule-wrong "
                     f"completions of one kind correct, as a lenient labeler would: {BLIND_SPOTS[rm['blind_spot']]}. "
                     "Its benchmark keeps the true labels. Both RM runs start from this RM; Cooper's pairs take "
                     "their positives from math-verify and their negatives "
                     + ("from rewrites of the positives into wrong answers (the blind spot's among them)"
                        if co.get("negatives") == "rewrite" else "from rollouts math-verify reads as a wrong value")
                     + ", so its updates can close the blind spot.")
    start = (f"the SFT policy's weights with a new scalar head (std {rm.get('head_std')})"
             if rm.get("init") == "sft" else "random weights")  # configs before rm.init started randomly
    negative = (f"negatives rewritten from the positive, value changed, in the form of `{co.get('rewrite_forms')}`"
                if co["negatives"] == "rewrite" else f"negative `{co['negative_pick']}` from `{co['negatives']}`")
    gate = (f"until its validation accuracy reaches {rm['gate']} per family (at most {rm.get('epochs')} epochs, the "
            "best kept)" if rm.get("gate") else f"for {rm.get('epochs')} epochs")
    lines.append(f"Settings: the RM starts from {start} (`rm.init`) and learns at {rm.get('lr')} {gate}; RM reward "
                 f"`{rl['rm_transform']}` of the RM's logit (`reward.rm_transform`), advantage std "
                 f"floor {rl['adv_std_floor']}; Cooper's pairs: {co['pairs_per_prompt']} per prompt, positive "
                 f"`{co['positive_pick']}`, {negative}, RM lr "
                 f"{co['rm_lr']} (policy {rl['lr']}), BCE anchor weight {co['anchor_weight']}.")
    return lines


def _hacks(results: Mapping[str, Any], n: int) -> list[str]:
    out = ["", "## Examples of hacks" + (" (first seed)" if n > 1 else ""), ""]
    any_hacks = False
    for mode in report_modes(results):
        hacks = results[mode].hacks if mode in results else []
        if not hacks:
            continue
        any_hacks = True
        out += [f"### {mode_label(mode)} ({len(hacks)} collected, {min(len(hacks), MAX_EXAMPLES)} shown)", ""]
        for i, h in enumerate(hacks[:MAX_EXAMPLES], 1):
            text = h.completion
            if len(text) > MAX_COMPLETION_CHARS:
                text = text[:MAX_COMPLETION_CHARS] + " [...]"
            out += [f"{i}. **Question:** {_cell(h.question)}  ", f"   **Reference answer:** {_cell(h.reference)}  ",
                    f"   **RM reward:** {h.rm_reward:.3f}; **rule verdict:** "
                    f"{'correct' if h.rule_correct else 'wrong'}", "",
                    *["   " + line for line in _fence(text).split("\n")], ""]
    if not any_hacks:
        out += ["No examples were collected.", ""]
    return out
