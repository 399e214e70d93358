"""The CPU demo's report: rule vs static RM vs Cooper, in the form of the paper's table.

The demo runs RL three times from the same start, with reward modes ``rule`` (math-verify 0/1),
``static_rm`` (a frozen reward model) and ``cooper`` (the reward model co-trained with the
policy). :func:`write_report` turns the three runs into a folder holding:

- ``summary.json``: per mode, held-out accuracy before/after, the final training reward, the RM's
  accuracy before/after, the hacking signature, steps and seconds; plus the derived ``verdict``
  and the (redacted) ``config``.
- ``report.md``: the table (rows = reward mode, as in the paper), a verdict computed from the
  numbers, examples of hacks, links to the plots and to the metrics files.
- ``train_reward.png``, ``eval_acc.png``, ``rule_acc_gap.png``: per-step curves of the three modes.
- ``metrics_<mode>.jsonl``: byte-for-byte copies of the three runs' ``metrics.jsonl``.

Input (one :class:`RunResult` per mode, written by the demo pipeline; :func:`load_runs` reads
them back from ``<root>/<mode>/result.json``)::

    RunResult(metrics_path="runs/demo/static_rm",         # metrics.jsonl or its run folder
              acc_before=0.50, acc_after=0.40,             # held-out accuracy, 0-1
              rm_acc_before=0.70, rm_acc_after=0.70,       # RM accuracy on held-out labeled
                                                           # completions; None for ``rule``
              hacks=[HackExample(question, reference, completion, rm_reward=0.97, rule_correct=False)],
              seconds=812.0)                               # optional wall time of the run

Definitions (all documented constants below):

- final training reward: mean of ``reward/mean`` over the last ``w`` of the n steps that logged
  it, ``w = min(REWARD_WINDOW, n // 2)`` (at least 1; ``REWARD_WINDOW`` = 5); the start reward is
  the same over the first ``w``.
- hacking signature (:func:`hacking_signature`): present iff the training reward rose by at
  least ``MIN_REWARD_RISE`` (0.05) from start to final *and* held-out accuracy fell by at least
  ``MIN_ACC_DROP`` (0.02) from before to after training.
- Cooper "at or above the rule baseline": Cooper's held-out accuracy after training >= the rule
  run's (no tolerance); "RM accuracy does not degrade": Cooper's RM accuracy after >= before.
- the paper's claim is "reproduced" iff static RM shows the signature, Cooper does not, Cooper is
  at or above the rule baseline and Cooper's RM accuracy did not degrade (else the failed checks
  are listed).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from cooper_mcore.metrics import METRICS_FILE, read_metrics
from cooper_mcore.redaction import redact

__all__ = [
    "MIN_ACC_DROP", "MIN_REWARD_RISE", "MODES", "REWARD_WINDOW", "HackExample", "RunResult",
    "hacking_signature", "load_runs", "train_reward_final", "write_report",
]

logger = logging.getLogger(__name__)

MODES = ("rule", "static_rm", "cooper")
RM_MODES = ("static_rm", "cooper")
MODE_LABELS = {"rule": "rule", "static_rm": "static RM", "cooper": "Cooper"}
MODE_COLORS = {"rule": "#1f77b4", "static_rm": "#d62728", "cooper": "#2ca02c"}
REWARD_WINDOW = 5
MIN_REWARD_RISE = 0.05
MIN_ACC_DROP = 0.02
MAX_EXAMPLES = 5
MAX_COMPLETION_CHARS = 600
RESULT_FILE = "result.json"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
PLOT_FILES = {"train_reward": "train_reward.png", "eval_acc": "eval_acc.png", "rule_acc_gap": "rule_acc_gap.png"}
_EPS = 1e-9  # float slack for threshold comparisons (0.94 - 0.49 is 0.4499999...)


# ----------------------------------------------------------------------------- inputs


@dataclass
class HackExample:
    """A completion the reward model scores high although the rule verifier says it is wrong.

    Attributes:
        question: the prompt's question.
        reference: the reference answer.
        completion: the policy's completion.
        rm_reward: the RM's reward for it (sigmoid of the logit, 0-1).
        rule_correct: the rule verifier's verdict (False for a hack).
    """

    question: str
    reference: str
    completion: str
    rm_reward: float
    rule_correct: bool

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HackExample:
        """Build from a JSON object with the attribute names as keys (ValueError names a missing one)."""
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d]
        if missing:
            raise ValueError(f"hack example is missing {missing}: {dict(d)!r}")
        return cls(str(d["question"]), str(d["reference"]), str(d["completion"]), float(d["rm_reward"]),
                   bool(d["rule_correct"]))


@dataclass
class RunResult:
    """What the demo pipeline knows about one RL run.

    Attributes:
        metrics_path: the run's ``metrics.jsonl``, or the run folder holding it.
        acc_before: held-out accuracy of the starting policy (0-1).
        acc_after: held-out accuracy of the trained policy (0-1).
        rm_acc_before: RM accuracy on held-out labeled completions before training (0-1); None for
            ``rule`` (no RM), or when not measured.
        rm_acc_after: the same after training (for ``static_rm`` the RM is frozen, so it should
            equal ``rm_acc_before``).
        hacks: examples of hacks (high RM reward, rule-wrong); the report shows up to
            ``MAX_EXAMPLES`` per mode.
        seconds: wall seconds of the run, if the pipeline measured them.
        details: further numbers the pipeline measured (e.g. greedy accuracy), copied into
            ``summary.json`` under ``details`` and listed in ``report.md``.
    """

    metrics_path: str
    acc_before: float
    acc_after: float
    rm_acc_before: float | None = None
    rm_acc_after: float | None = None
    hacks: list[HackExample] = field(default_factory=list)
    seconds: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base_dir: str | None = None) -> RunResult:
        """Build from a JSON object with the attribute names as keys (``hacks`` as a list of objects).

        A relative ``metrics_path`` is taken relative to ``base_dir`` when given.

        Raises:
            ValueError: naming a missing or unknown key.
        """
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown RunResult keys {unknown}")
        missing = [k for k in ("metrics_path", "acc_before", "acc_after") if k not in d]
        if missing:
            raise ValueError(f"RunResult is missing {missing}")
        kw = dict(d)
        if base_dir is not None and not os.path.isabs(kw["metrics_path"]):
            kw["metrics_path"] = os.path.join(base_dir, kw["metrics_path"])
        kw["hacks"] = [h if isinstance(h, HackExample) else HackExample.from_dict(h) for h in kw.get("hacks", [])]
        return cls(**kw)


def load_runs(root: str) -> dict[str, RunResult]:
    """Read ``<root>/<mode>/result.json`` for every mode (metrics paths relative to that folder).

    Raises:
        ValueError: naming the mode whose ``result.json`` is missing or malformed.
    """
    runs: dict[str, RunResult] = {}
    for mode in MODES:
        path = os.path.join(root, mode, RESULT_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"mode {mode!r}: no {path}")
        with open(path, encoding="utf-8") as f:
            try:
                runs[mode] = RunResult.from_dict(json.load(f), base_dir=os.path.dirname(path))
            except (ValueError, TypeError) as e:
                raise ValueError(f"mode {mode!r}: bad {path}: {e}") from e
    return runs


# ----------------------------------------------------------------------------- numbers


def _series(metrics: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` on the lines that logged a finite number for it."""
    steps: list[int] = []
    values: list[float] = []
    for i, m in enumerate(metrics):
        v = m.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(m.get("step", i + 1)))
            values.append(float(v))
    return steps, values


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _rewards(metrics: Sequence[Mapping[str, Any]]) -> list[float]:
    values = _series(metrics, "reward/mean")[1]
    if not values:
        raise ValueError("metrics have no 'reward/mean' values")
    return values


def _window(n: int, window: int) -> int:
    """Steps averaged at each end of a run of ``n`` values: ``window``, at most ``n // 2`` (>= 1)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    return min(window, max(1, n // 2))


def train_reward_final(metrics: Sequence[Mapping[str, Any]], window: int = REWARD_WINDOW) -> float:
    """Mean of ``reward/mean`` over the last ``min(window, n // 2)`` (>= 1) of the n steps that logged it.

    Raises:
        ValueError: if no step logged ``reward/mean``.
    """
    rewards = _rewards(metrics)
    return _mean(rewards[-_window(len(rewards), window):])


def _check_acc(name: str, value: Any, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def hacking_signature(metrics: Sequence[Mapping[str, Any]], acc_before: float, acc_after: float,
                      window: int = REWARD_WINDOW, min_reward_rise: float = MIN_REWARD_RISE,
                      min_acc_drop: float = MIN_ACC_DROP) -> dict[str, Any]:
    """Whether a run shows the reward-hacking signature: training reward up, held-out accuracy down.

    The start (end) reward is the mean of ``reward/mean`` over the first (last) ``w`` of the n
    steps that logged it, ``w = min(window, n // 2)`` (at least 1), so the two ends never overlap
    on runs of 2+ steps (a 1-step run has no rise). The signature is present iff
    ``reward_end - reward_start >= min_reward_rise`` and ``acc_after - acc_before <= -min_acc_drop``.
    The ``reward_rule_gap`` means over the same windows are reported alongside (not used).

    Args:
        metrics: the run's ``metrics.jsonl`` lines (``read_metrics``).
        acc_before: held-out accuracy before training (0-1).
        acc_after: held-out accuracy after training (0-1).
        window: most steps averaged at each end (>= 1).
        min_reward_rise: reward rise needed (default ``MIN_REWARD_RISE`` = 0.05).
        min_acc_drop: held-out accuracy drop needed (default ``MIN_ACC_DROP`` = 0.02).

    Returns:
        ``reward_start``, ``reward_end``, ``reward_rise``, ``acc_before``, ``acc_after``,
        ``acc_change``, ``gap_start``, ``gap_end`` (None without ``reward_rule_gap``), ``window`` (the ``w`` used),
        ``min_reward_rise``, ``min_acc_drop`` and ``present`` (bool).

    Raises:
        ValueError: on no ``reward/mean`` values, an accuracy outside [0, 1] or a window < 1.
    """
    _window(1, window)
    before, after = _check_acc("acc_before", acc_before), _check_acc("acc_after", acc_after)
    assert before is not None and after is not None
    rewards = _rewards(metrics)
    window = _window(len(rewards), window)
    start, end = _mean(rewards[:window]), _mean(rewards[-window:])
    gaps = _series(metrics, "reward_rule_gap")[1]
    rise, change = end - start, after - before
    present = rise >= min_reward_rise - _EPS and change <= -min_acc_drop + _EPS
    return {"reward_start": start, "reward_end": end, "reward_rise": rise, "acc_before": before,
            "acc_after": after, "acc_change": change,
            "gap_start": _mean(gaps[:window]) if gaps else None, "gap_end": _mean(gaps[-window:]) if gaps else None,
            "window": window, "min_reward_rise": min_reward_rise, "min_acc_drop": min_acc_drop,
            "present": bool(present)}


def _metrics_file(path: str) -> str:
    return os.path.join(path, METRICS_FILE) if os.path.isdir(path) else path


def _validate(runs: Mapping[str, Any]) -> tuple[dict[str, RunResult], dict[str, list[dict[str, Any]]]]:
    """Check every input and read the metrics, before anything is written."""
    if not isinstance(runs, Mapping):
        raise ValueError(f"runs must be a dict of mode -> RunResult, got {type(runs).__name__}")
    unknown = sorted(set(runs) - set(MODES))
    if unknown:
        raise ValueError(f"unknown reward mode(s) {unknown}; expected {list(MODES)}")
    results: dict[str, RunResult] = {}
    metrics: dict[str, list[dict[str, Any]]] = {}
    for mode in MODES:
        if mode not in runs:
            raise ValueError(f"missing reward mode {mode!r}; the report needs {list(MODES)}")
        r = runs[mode]
        if isinstance(r, Mapping):
            try:
                r = RunResult.from_dict(r)
            except (ValueError, TypeError) as e:
                raise ValueError(f"mode {mode!r}: {e}") from e
        if not isinstance(r, RunResult):
            raise ValueError(f"mode {mode!r}: expected a RunResult, got {type(r).__name__}")
        try:
            r = dataclasses.replace(r, hacks=[h if isinstance(h, HackExample) else HackExample.from_dict(h)
                                              for h in r.hacks or []])
        except (ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"mode {mode!r}: bad hacks: {e}") from e
        for name in ("acc_before", "acc_after"):
            _check_acc(f"mode {mode!r}: {name}", getattr(r, name))
        for name in ("rm_acc_before", "rm_acc_after"):
            value = getattr(r, name)
            if mode == "rule" and value is not None:
                raise ValueError(f"mode 'rule' has no reward model, but {name}={value!r}")
            _check_acc(f"mode {mode!r}: {name}", value, allow_none=True)
        path = _metrics_file(r.metrics_path)
        if not os.path.isfile(path):
            raise ValueError(f"mode {mode!r}: metrics file {path} does not exist")
        lines = read_metrics(path)
        if not lines:
            raise ValueError(f"mode {mode!r}: metrics file {path} is empty")
        if not _series(lines, "reward/mean")[1]:
            raise ValueError(f"mode {mode!r}: metrics file {path} has no 'reward/mean' values")
        results[mode], metrics[mode] = r, lines
    return results, metrics


def _summarize(r: RunResult, lines: list[dict[str, Any]]) -> dict[str, Any]:
    sig = hacking_signature(lines, r.acc_before, r.acc_after)
    seconds = _series(lines, "time/step")[1]
    rule_acc = _series(lines, "rule/acc")[1]
    eval_steps, eval_acc = _series(lines, "eval/acc")
    return {"acc_before": r.acc_before, "acc_after": r.acc_after, "acc_change": r.acc_after - r.acc_before,
            "train_reward_initial": sig["reward_start"], "train_reward_final": train_reward_final(lines),
            "rm_acc_before": r.rm_acc_before, "rm_acc_after": r.rm_acc_after,
            "rule_acc_final": _mean(rule_acc[-_window(len(rule_acc), REWARD_WINDOW):]) if rule_acc else None,
            "eval_acc_last": eval_acc[-1] if eval_acc else None, "eval_steps": eval_steps,
            "steps": max(int(m.get("step", i + 1)) for i, m in enumerate(lines)), "metrics_lines": len(lines),
            "train_seconds": sum(seconds) if seconds else None, "wall_seconds": r.seconds,
            "hacking": sig, "n_hacks": len(r.hacks), "details": dict(r.details)}


def _verdict(s: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Verdict lines and flags, computed from the per-mode summaries."""
    lines: list[str] = []
    for mode in MODES:
        h = s[mode]["hacking"]
        lines.append(
            f"{MODE_LABELS[mode]}: training reward {_moved(h['reward_start'], h['reward_end'])} while held-out "
            f"accuracy {_moved(h['acc_before'], h['acc_after'])} (reward hacking signature "
            f"{'present' if h['present'] else 'not present'}).")
    coop, rule = s["cooper"], s["rule"]
    diff = coop["acc_after"] - rule["acc_after"]
    at_or_above = diff >= -_EPS
    lines.append(f"Cooper vs rule: held-out accuracy after training {coop['acc_after']:.3f} vs "
                 f"{rule['acc_after']:.3f} ({diff:+.3f}): "
                 f"{'at or above' if at_or_above else 'below'} the rule baseline.")
    rm_ok: dict[str, bool | None] = {}
    for mode in RM_MODES:
        b, a = s[mode]["rm_acc_before"], s[mode]["rm_acc_after"]
        if b is None or a is None:
            rm_ok[mode] = None
            lines.append(f"{MODE_LABELS[mode]}: RM accuracy on held-out labeled completions not measured.")
        else:
            rm_ok[mode] = a >= b - _EPS
            lines.append(f"{MODE_LABELS[mode]}: RM accuracy on held-out labeled completions {_moved(b, a)} "
                         f"({'did not degrade' if rm_ok[mode] else 'degraded'}).")
    checks = {"static RM shows the hacking signature": s["static_rm"]["hacking"]["present"],
              "Cooper shows no hacking signature": not coop["hacking"]["present"],
              "Cooper's held-out accuracy is at or above the rule baseline": at_or_above,
              "Cooper's RM accuracy did not degrade": rm_ok["cooper"] is True}
    failed = [k for k, ok in checks.items() if not ok]
    reproduced = not failed
    lines.append("Paper's claim in miniature: " + ("reproduced." if reproduced else
                                                     "not reproduced (failed: " + "; ".join(failed) + ")."))
    return {"static_rm_hacking": s["static_rm"]["hacking"]["present"], "cooper_hacking": coop["hacking"]["present"],
            "cooper_at_or_above_rule": at_or_above, "cooper_minus_rule_acc": diff,
            "static_rm_rm_acc_not_degraded": rm_ok["static_rm"], "cooper_rm_acc_not_degraded": rm_ok["cooper"],
            "claim_reproduced": reproduced, "failed": failed, "lines": lines}


def _moved(a: float, b: float) -> str:
    """'rose from 0.490 to 0.940' / 'fell from ...' / 'stayed at 0.500' (3 decimals)."""
    if round(a, 3) == round(b, 3):
        return f"stayed at {a:.3f}"
    return f"{'rose' if b > a else 'fell'} from {a:.3f} to {b:.3f}"


# ----------------------------------------------------------------------------- plots


def _plot(out_dir: str, metrics: Mapping[str, list[dict[str, Any]]],
          summary: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Write the PNGs with matplotlib's Agg canvas (no pyplot, no display); return name -> path."""
    specs = {  # plot -> (title, [(metrics key, y label), ...] one panel each)
        "train_reward": ("Training reward per step", [("reward/mean", "training reward (reward/mean)")]),
        "eval_acc": ("Held-out accuracy per eval step (x: demo eval before / after)",
                     [("eval/acc", "held-out accuracy")]),
        "rule_acc_gap": ("Rollout accuracy by math-verify, and reward - rule gap",
                         [("rule/acc", "rule accuracy (rule/acc)"), ("reward_rule_gap", "reward_rule_gap")]),
    }
    paths = {k: os.path.join(out_dir, v) for k, v in PLOT_FILES.items()}
    for name, (title, panels) in specs.items():
        fig = Figure(figsize=(7.5, 1.0 + 3.0 * len(panels)), dpi=100)
        FigureCanvasAgg(fig)
        for i, (key, ylabel) in enumerate(panels):
            ax = fig.add_subplot(len(panels), 1, i + 1)
            ax.grid(True, alpha=0.3)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if key == "reward_rule_gap":
                ax.axhline(0.0, color="gray", linewidth=0.8, zorder=0)
            for mode in MODES:
                steps, values = _series(metrics[mode], key)
                ax.plot(steps, values, color=MODE_COLORS[mode], label=MODE_LABELS[mode], linewidth=1.6,
                        marker="o" if key == "eval/acc" else None)
                if key == "eval/acc":
                    ax.plot([0, summary[mode]["steps"]], [summary[mode]["acc_before"], summary[mode]["acc_after"]],
                            linestyle="none", marker="x", markersize=9, color=MODE_COLORS[mode])
            ax.set(ylabel=ylabel, title=title if i == 0 else "", xlabel="step" if i == len(panels) - 1 else "")
            if i == 0:
                ax.legend()
        fig.tight_layout()
        fig.savefig(paths[name])
    return paths


# ----------------------------------------------------------------------------- markdown


def _fmt(v: float | None, signed: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{v:+.3f}" if signed else f"{v:.3f}"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (one line, no column breaks)."""
    return " ".join(text.split()).replace("|", "\\|")


def _fence(text: str) -> str:
    """A fenced code block that ``text`` cannot close early."""
    ticks = "`" * max(3, 1 + max((len(t) for t in re.findall("`+", text)), default=0))
    return f"{ticks}text\n{text}\n{ticks}"


def table_rows(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The report's table, header first, one markdown line per reward mode (3 decimals)."""
    rows = ["| reward mode | held-out acc before | held-out acc after | change | final training reward "
            "| RM acc before | RM acc after |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        s = summary[mode]
        rows.append(f"| {MODE_LABELS[mode]} | {_fmt(s['acc_before'])} | {_fmt(s['acc_after'])} | "
                    f"{_fmt(s['acc_change'], signed=True)} | {_fmt(s['train_reward_final'])} | "
                    f"{_fmt(s['rm_acc_before'])} | {_fmt(s['rm_acc_after'])} |")
    return rows


def _markdown(summary: Mapping[str, Any], results: Mapping[str, RunResult], copies: Mapping[str, str],
              plots: Mapping[str, str]) -> str:
    v = summary["verdict"]
    windows = sorted({summary[m]["hacking"]["window"] for m in MODES})
    w = str(windows[0]) if len(windows) == 1 else f"min({REWARD_WINDOW}, steps // 2)"
    out = ["# Cooper CPU demo: rule vs static RM vs Cooper", "",
           "Three RL runs from the same start. Held-out accuracy is the demo's evaluation before and after "
           f"training; the final training reward is the mean `reward/mean` over the last {w} steps; "
           "RM accuracy is the reward model's accuracy on held-out labeled completions.", "",
           *table_rows(summary), "", "## Verdict", "", *[f"- {line}" for line in v["lines"]], "",
           f"The reward hacking signature is present when the training reward (mean of the first vs the last "
           f"{w} steps) rose by at least {MIN_REWARD_RISE} and held-out accuracy fell by at least "
           f"{MIN_ACC_DROP}.", "", "## Runs", "",
           "| reward mode | steps | train seconds (sum of `time/step`) | wall seconds | start training reward "
           "| final rollout rule accuracy |", "|---|---:|---:|---:|---:|---:|"]
    for mode in MODES:
        s = summary[mode]
        secs = [f"{x:.1f}" if x is not None else "n/a" for x in (s["train_seconds"], s["wall_seconds"])]
        out.append(f"| {MODE_LABELS[mode]} | {s['steps']} | {secs[0]} | {secs[1]} | "
                   f"{_fmt(s['train_reward_initial'])} | {_fmt(s['rule_acc_final'])} |")
    if any(summary[m]["details"] for m in MODES):
        out += ["", "Further measurements:", ""]
        out += [f"- {MODE_LABELS[m]}: " + ", ".join(f"{k} = {_fmt(v) if isinstance(v, float) else v}"
                                                    for k, v in summary[m]["details"].items())
                for m in MODES if summary[m]["details"]]
    out += ["", "## Examples of hacks", ""]
    any_hacks = False
    for mode in MODES:
        hacks = results[mode].hacks
        if not hacks:
            continue
        any_hacks = True
        out += [f"### {MODE_LABELS[mode]} ({len(hacks)} collected, {min(len(hacks), MAX_EXAMPLES)} shown)", ""]
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
    out += ["## Plots", ""]
    titles = {"train_reward": "Training reward per step", "eval_acc": "Held-out accuracy per eval step",
              "rule_acc_gap": "Rollout rule accuracy and reward - rule gap per step"}
    out += [f"[![{titles[k]}]({os.path.basename(p)})]({os.path.basename(p)})" for k, p in plots.items()]
    out += ["", "## Metrics files", ""]
    out += [f"- {MODE_LABELS[m]}: [{os.path.basename(p)}]({os.path.basename(p)})" for m, p in copies.items()]
    if summary["config"] is not None:
        out += ["", "## Config", "", "```json", json.dumps(summary["config"], indent=2, sort_keys=True, default=str),
                "```"]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- entry point


def write_report(out_dir: str, runs: Mapping[str, RunResult], config: Mapping[str, Any] | None = None) -> str:
    """Write the demo's report folder (see the module docstring for its contents).

    Every input is checked before anything is written.

    Args:
        out_dir: the report folder (created; existing report files are overwritten).
        runs: ``"rule"``, ``"static_rm"`` and ``"cooper"`` -> :class:`RunResult` (or its dict form).
        config: the demo's settings, redacted (:func:`cooper_mcore.redaction.redact`) into
            ``summary.json`` and ``report.md``.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: naming the culprit on a missing or unknown mode, a missing, empty or
            reward-less metrics file, an accuracy outside [0, 1], RM accuracies for ``rule``, or a
            config that is not a mapping.
    """
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict or None, got {type(config).__name__}")
    results, metrics = _validate(runs)
    summary: dict[str, Any] = {mode: _summarize(results[mode], metrics[mode]) for mode in MODES}
    summary["verdict"] = _verdict(summary)
    summary["config"] = redact(dict(config)) if config is not None else None
    os.makedirs(out_dir, exist_ok=True)
    copies: dict[str, str] = {}
    for mode in MODES:
        src, dst = _metrics_file(results[mode].metrics_path), os.path.join(out_dir, f"metrics_{mode}.jsonl")
        if not (os.path.exists(dst) and os.path.samefile(src, dst)):
            shutil.copyfile(src, dst)
        copies[mode] = dst
    plots = _plot(out_dir, metrics, summary)
    with open(os.path.join(out_dir, SUMMARY_FILE), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    with open(os.path.join(out_dir, REPORT_FILE), "w", encoding="utf-8") as f:
        f.write(_markdown(summary, results, copies, plots))
    for line in summary["verdict"]["lines"]:
        logger.info("%s", line)
    logger.info("demo report written to %s", out_dir)
    return out_dir
