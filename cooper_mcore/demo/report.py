"""The CPU demo's report: rule vs static RM vs Cooper, in the form of the paper's table, over seeds.

The demo runs RL three times from the same start, with reward modes ``rule`` (math-verify 0/1),
``static_rm`` (a frozen reward model) and ``cooper`` (the reward model co-trained with the
policy), once per seed. :func:`write_report` turns the runs into a folder holding:

- ``summary.json``: per mode, the numbers below averaged over the seeds (``<mode>``), their
  spread (``<mode>.sd``) and every seed's own (``per_seed``); the derived ``verdict`` and the
  (redacted) ``config``.
- ``report.md``: the table (rows = reward mode, as in the paper), the per-seed rows, a verdict
  computed from the numbers, examples of hacks, links to the plots and to the metrics files
  (:mod:`cooper_mcore.demo.report_render`).
- ``train_reward.png``, ``eval_acc.png``, ``rule_acc_gap.png``, ``rm_rewards.png``: per-step
  curves of the three modes (every seed).
- ``metrics_<mode>.jsonl`` (one seed) or ``metrics_<mode>_seed<s>.jsonl``: byte-for-byte copies
  of the runs' ``metrics.jsonl``.

Input: per seed, one :class:`RunResult` per mode (written by the demo pipeline;
:func:`load_runs` reads one seed back from ``<root>/<mode>/result.json``)::

    RunResult(metrics_path="runs/demo/static_rm",         # metrics.jsonl or its run folder
              acc_before=0.50, acc_after=0.40,             # held-out accuracy, 0-1
              rm_acc_before=0.70, rm_acc_after=0.70,       # RM accuracy on a fixed held-out set of
                                                           # labeled completions; None for ``rule``
              hacks=[HackExample(question, reference, completion, rm_reward=0.97, rule_correct=False)],
              seconds=812.0)                               # optional wall time of the run

Definitions (all documented constants below):

- final training reward: mean of ``reward/mean`` over the last ``w`` of the n steps that logged
  it, ``w = min(REWARD_WINDOW, n // 2)`` (at least 1; ``REWARD_WINDOW`` = 5); the start reward is
  the same over the first ``w``.
- hacking signature (:func:`hacking_signature`): present iff the training reward rose by at
  least ``MIN_REWARD_RISE`` (0.25) from start to final *and* held-out accuracy fell by at least
  ``MIN_ACC_DROP`` (0.10) from before to after training.
- the verdict in parts (:mod:`cooper_mcore.demo.verdict`): the static RM is hacked (the signature),
  Cooper prevents it (no signature), Cooper's RM holds on its own policy's answers, Cooper against
  rule per problem group (a paired difference), Cooper's RM on the fixed benchmark; a change or a
  difference holds unless it is below ``-SE_BAND`` (2) standard errors over problems and seeds.
  The paper's claim is "reproduced" iff every part holds (else the others are listed). Over several
  seeds the parts are judged on the means, and the report says in how many seeds each holds on its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cooper_mcore.config.schema import RewardMode
from cooper_mcore.demo.report_render import (
    MODE_COLORS,
    MODES,
    PLOT_FILES,
    markdown,
    mode_label,
    plot,
    report_modes,
)
from cooper_mcore.demo.results import OwnAnswers, RMGate, from_plain, omitted_when_none, to_plain
from cooper_mcore.demo.verdict import SE_BAND, Part, verdict_parts
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.metrics import METRICS_FILE, read_metrics
from cooper_mcore.plots import series
from cooper_mcore.redaction import redact

__all__ = [
    "MIN_ACC_DROP", "MIN_REWARD_RISE", "MODE_COLORS", "MODES", "PLOT_FILES", "REWARD_WINDOW",
    "HackExample", "HackingSignature", "PairedDifference", "RunResult", "hacking_signature", "load_runs",
    "train_reward_final", "write_report",
]

logger = logging.getLogger(__name__)

RM_MODES = tuple(m.value for m in RewardMode if m.uses_rm)  # static_rm, cooper
REWARD_WINDOW = 5
MIN_REWARD_RISE = 0.25
MIN_ACC_DROP = 0.10
RESULT_FILE = "result.json"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
#: summary keys averaged over seeds whose spread (population std) is reported too
SPREAD_KEYS = ("acc_before", "acc_after", "acc_change", "train_reward_initial", "train_reward_final",
               "rm_acc_before", "rm_acc_after")
#: in-training metrics summarised at the start and end of a run (means over the reward windows)
WINDOW_KEYS = (K.RULE_ACC, K.RM_REWARD_CORRECT, K.RM_REWARD_WRONG, K.RM_PAIR_ACC, K.RM_THRESHOLD_ACC, K.PAIRS_VALID,
               K.KL)
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
        rm_acc_before: RM accuracy on a fixed held-out set of labeled completions before training
            (0-1); None for ``rule`` (no RM), or when not measured.
        rm_acc_after: the same RM evaluation after training (for ``static_rm`` the RM is frozen,
            so it equals ``rm_acc_before``).
        hacks: examples of hacks (high RM reward, rule-wrong); the report shows up to
            ``MAX_EXAMPLES`` per mode.
        seconds: wall seconds of the run, if the pipeline measured them.
        details: further numbers the pipeline measured (e.g. greedy accuracy), copied into
            ``summary.json`` under ``details`` (averaged over seeds) and listed in ``report.md``.
        rule_acc_before / rule_acc_after: the same held-out completions judged by the rule verifier
            (``acc_*`` are the task's oracle's: the truth); None when not measured.
        families: per problem family, ``acc_before``, ``acc_after``, ``rule_acc_before``,
            ``rule_acc_after``, ``times_form_before``/``after`` (share of answers written
            ``\\boxed{N.}``), ``rm_acc_before``/``after`` (the RM's benchmark accuracy on the family).
        curve: per in-training evaluation, ``step`` and per family (and ``all``) ``acc``, ``rule_acc``
            and ``forms`` (share of each final-answer form).
        problem_acc: per held-out problem (a fixed order), the trained policy's accuracy on it (for
            paired comparisons between modes).
        problem_acc_before: the same for the starting policy (for the paired change of a run).
        problem_groups: per problem group (each family, ``rule_unreadable``), the indices of its problems
            in ``problem_acc``.
        rm_bench_right_before / rm_bench_right_after: per benchmark item, whether the RM's verdict was
            right before and after the run (RM modes; for the paired change of its benchmark accuracy).
        rm_own_answers: the RM's separation on its policy's held-out answers, judged by the oracle: the
            starting RM on the starting policy's (``before``) and the final RM on the final policy's
            (``after``), each with its standard error (RM modes).
        rm_gate: the starting RM's training gate (RM modes).
    """

    metrics_path: str
    acc_before: float
    acc_after: float
    rm_acc_before: float | None = None
    rm_acc_after: float | None = None
    hacks: list[HackExample] = field(default_factory=list)
    seconds: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    rule_acc_before: float | None = None
    rule_acc_after: float | None = None
    families: dict[str, dict[str, float | None]] = field(default_factory=dict)
    curve: list[dict[str, Any]] = field(default_factory=list)
    problem_acc: list[float] = field(default_factory=list)
    problem_acc_before: list[float] = field(default_factory=list)
    problem_groups: dict[str, list[int]] = field(default_factory=dict)
    rm_bench_right_before: list[bool] = field(default_factory=list)
    rm_bench_right_after: list[bool] = field(default_factory=list)
    rm_own_answers: OwnAnswers | None = None
    rm_gate: RMGate | None = None

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
        for name, tp in (("rm_own_answers", OwnAnswers), ("rm_gate", RMGate)):
            if isinstance(kw.get(name), Mapping):
                kw[name] = from_plain(tp, kw[name])
        return cls(**kw)


@dataclass
class HackingSignature:
    """Whether a run shows the reward-hacking signature (:func:`hacking_signature`); ``summary.json``
    holds it as an object with these keys (``present_seeds`` only on the means over seeds)."""

    reward_start: float
    """Mean training reward over the first window."""
    reward_end: float
    """Mean training reward over the last window."""
    reward_rise: float
    """reward_end - reward_start."""
    acc_before: float
    """Held-out accuracy before training."""
    acc_after: float
    """Held-out accuracy after training."""
    acc_change: float
    """acc_after - acc_before."""
    gap_start: float | None
    """Mean reward_rule_gap over the first window (None: not logged)."""
    gap_end: float | None
    """Mean reward_rule_gap over the last window (None: not logged)."""
    window: int
    """Steps averaged at each end."""
    min_reward_rise: float
    """The reward rise the signature needs."""
    min_acc_drop: float
    """The accuracy drop the signature needs."""
    present: bool
    """Both thresholds met."""
    present_seeds: int | None = omitted_when_none()
    """Over several seeds: in how many it is present on its own."""


@dataclass
class PairedDifference:
    """Cooper minus rule on the same held-out problems (:func:`paired_difference`); ``summary.json``'s
    ``paired`` object."""

    mean: float
    """Mean over the problems of the per-problem accuracy difference (averaged over the seeds)."""
    se: float
    """Its standard error (sd / sqrt(problems); NaN for one problem)."""
    problems: int
    """Held-out problems."""
    seeds: int
    """Seeds averaged."""
    single_acc_se: float
    """The standard error of one accuracy on that many problems, for comparison."""


def load_runs(root: str) -> dict[str, RunResult]:
    """Read one seed's ``<root>/<mode>/result.json`` for every mode (metrics paths relative to that folder).

    Raises:
        ValueError: naming the mode whose ``result.json`` is missing or malformed.
    """
    runs: dict[str, RunResult] = {}
    found = sorted(os.listdir(root)) if os.path.isdir(root) else []
    others = [d for d in found if d not in MODES and os.path.isfile(os.path.join(root, d, RESULT_FILE))]
    for mode in (*MODES, *others):
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


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _rewards(metrics: Sequence[Mapping[str, Any]]) -> list[float]:
    values = series(metrics, K.REWARD_MEAN)[1]
    if not values:
        raise ValueError(f"metrics have no {K.REWARD_MEAN!r} values")
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
                      min_acc_drop: float = MIN_ACC_DROP) -> HackingSignature:
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
        min_reward_rise: reward rise needed (default ``MIN_REWARD_RISE`` = 0.25).
        min_acc_drop: held-out accuracy drop needed (default ``MIN_ACC_DROP`` = 0.10).

    Returns:
        The signature: the two ends' rewards and their rise, the accuracies and their change, the
        gap's ends (None without ``reward_rule_gap``), the ``w`` used, the thresholds and ``present``.

    Raises:
        ValueError: on no ``reward/mean`` values, an accuracy outside [0, 1] or a window < 1.
    """
    _window(1, window)
    before, after = _check_acc("acc_before", acc_before), _check_acc("acc_after", acc_after)
    assert before is not None and after is not None
    rewards = _rewards(metrics)
    window = _window(len(rewards), window)
    start, end = _mean(rewards[:window]), _mean(rewards[-window:])
    gaps = series(metrics, K.REWARD_RULE_GAP)[1]
    return _signature(start, end, before, after, window, min_reward_rise, min_acc_drop,
                      _mean(gaps[:window]) if gaps else None, _mean(gaps[-window:]) if gaps else None)


def _signature(start: float, end: float, before: float, after: float, window: int, min_reward_rise: float,
               min_acc_drop: float, gap_start: float | None, gap_end: float | None) -> HackingSignature:
    rise, change = end - start, after - before
    present = rise >= min_reward_rise - _EPS and change <= -min_acc_drop + _EPS
    return HackingSignature(reward_start=start, reward_end=end, reward_rise=rise, acc_before=before, acc_after=after,
                            acc_change=change, gap_start=gap_start, gap_end=gap_end, window=window,
                            min_reward_rise=min_reward_rise, min_acc_drop=min_acc_drop, present=bool(present))


def metrics_file(path: str) -> str:
    """A run's ``metrics.jsonl``, given it or its run folder."""
    return os.path.join(path, METRICS_FILE) if os.path.isdir(path) else path


def _validate(runs: Mapping[str, Any]) -> tuple[dict[str, RunResult], dict[str, list[dict[str, Any]]]]:
    """Check one seed's inputs and read its metrics, before anything is written."""
    if not isinstance(runs, Mapping):
        raise ValueError(f"runs must be a dict of mode -> RunResult, got {type(runs).__name__}")
    missing = [m for m in MODES if m not in runs]
    if missing:
        raise ValueError(f"missing reward mode(s) {missing}; the report needs {list(MODES)} (and may hold others)")
    bad = [m for m in runs if not (isinstance(m, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", m))]
    if bad:
        raise ValueError(f"bad reward mode name(s) {bad}: letters, digits, '_', '.' and '-' only (they name files)")
    results: dict[str, RunResult] = {}
    metrics: dict[str, list[dict[str, Any]]] = {}
    for mode in report_modes(runs):
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
            if mode in MODES and not RewardMode(mode).uses_rm and value is not None:
                raise ValueError(f"mode {mode!r} has no reward model, but {name}={value!r}")
            _check_acc(f"mode {mode!r}: {name}", value, allow_none=True)
        path = metrics_file(r.metrics_path)
        if not os.path.isfile(path):
            raise ValueError(f"mode {mode!r}: metrics file {path} does not exist")
        lines = read_metrics(path)
        if not lines:
            raise ValueError(f"mode {mode!r}: metrics file {path} is empty")
        if not series(lines, K.REWARD_MEAN)[1]:
            raise ValueError(f"mode {mode!r}: metrics file {path} has no {K.REWARD_MEAN!r} values")
        results[mode], metrics[mode] = r, lines
    return results, metrics


def _summarize(r: RunResult, lines: list[dict[str, Any]]) -> dict[str, Any]:
    sig = hacking_signature(lines, r.acc_before, r.acc_after)
    w = sig.window
    seconds = series(lines, K.TIME_STEP)[1]
    rule_acc = series(lines, K.RULE_ACC)[1]
    eval_steps, eval_acc = series(lines, K.EVAL_ACC)
    windows = {}
    for key in WINDOW_KEYS:  # the in-training metrics at the start and the end (as the reward)
        values = series(lines, key)[1]
        if values:
            k = min(w, max(1, len(values) // 2))
            windows[key] = {"start": _mean(values[:k]), "end": _mean(values[-k:])}
    return {"acc_before": r.acc_before, "acc_after": r.acc_after, "acc_change": r.acc_after - r.acc_before,
            "train_reward_initial": sig.reward_start, "train_reward_final": train_reward_final(lines),
            "rm_acc_before": r.rm_acc_before, "rm_acc_after": r.rm_acc_after,
            "rule_acc_before": r.rule_acc_before, "rule_acc_after": r.rule_acc_after, "families": r.families,
            "curve": r.curve,
            "rule_acc_final": _mean(rule_acc[-_window(len(rule_acc), REWARD_WINDOW):]) if rule_acc else None,
            "eval_acc_last": eval_acc[-1] if eval_acc else None, "eval_steps": eval_steps,
            "steps": max(int(m.get("step", i + 1)) for i, m in enumerate(lines)), "metrics_lines": len(lines),
            "train_seconds": sum(seconds) if seconds else None, "wall_seconds": r.seconds,
            "hacking": to_plain(sig), "n_hacks": len(r.hacks), "details": dict(r.details), "windows": windows,
            "rm_gate": to_plain(r.rm_gate), "rm_own_answers": to_plain(r.rm_own_answers)}


def _aggregate(values: Sequence[Any]) -> Any:
    """Seeds' values of one summary entry: equal values kept (a step count stays an int), numbers
    averaged, dicts per key, anything else as the list of the seeds' values."""
    if len(values) == 1 or all(v == values[0] for v in values):
        return values[0]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return _mean([float(v) for v in values])
    if all(isinstance(v, dict) for v in values):
        keys = [k for k in values[0] if all(k in v for v in values)]
        return {k: _aggregate([v[k] for v in values]) for k in keys}
    return list(values)


def aggregate_seeds(per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per mode, the seeds' summaries averaged (:func:`_aggregate`), the spread of :data:`SPREAD_KEYS`
    (``sd``: population std, 0 for one seed) and the hacking signature on the means (with
    ``present_seeds``, the number of seeds in which it is present on its own)."""
    out: dict[str, dict[str, Any]] = {}
    for mode in report_modes(next(iter(per_seed.values()))):
        rows = [per_seed[s][mode] for s in per_seed]
        agg = _aggregate(rows)
        agg = dict(agg) if len(rows) > 1 else {k: v for k, v in rows[0].items()}
        agg["sd"] = {k: (statistics.pstdev([r[k] for r in rows]) if rows[0][k] is not None else None)
                     for k in SPREAD_KEYS}
        h: list[HackingSignature] = [from_plain(HackingSignature, r["hacking"]) for r in rows]
        mean = _signature(
            _mean([x.reward_start for x in h]), _mean([x.reward_end for x in h]), agg["acc_before"],
            agg["acc_after"], h[0].window, h[0].min_reward_rise, h[0].min_acc_drop,
            _mean([x.gap_start for x in h]) if h[0].gap_start is not None else None,
            _mean([x.gap_end for x in h]) if h[0].gap_end is not None else None)
        agg["hacking"] = to_plain(dataclasses.replace(mean, present_seeds=sum(x.present for x in h)))
        if len(rows) > 1:  # one curve per seed: they stay in per_seed, not averaged point by point
            agg.pop("curve", None)
        out[mode] = agg
    return out


def _part_line(p: Part) -> str:
    """A part of the verdict as a line of the report."""
    said = {True: "holds", False: "does not hold", None: "not measured"}[p.holds]
    return f"{p.name}: {said}" + (f" ({p.detail})" if p.detail else "") + "."


def _verdict(s: Mapping[str, Mapping[str, Any]], results: Mapping[int, Mapping[str, RunResult]],
             per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]] | None = None,
             paired: PairedDifference | None = None) -> dict[str, Any]:
    """Verdict lines and flags from the per-mode summaries (the means over the seeds when
    ``per_seed`` holds more than one): each mode's hacking signature, Cooper against rule (with the
    paired per-problem difference, :func:`paired_difference`, when known), the RMs' benchmark
    accuracy, and the verdict in parts (:func:`cooper_mcore.demo.verdict.verdict_parts`), on the means
    and in how many seeds each part holds on its own. The claim is reproduced when every part holds."""
    n = len(per_seed) if per_seed else 1
    of = f" (mean of {n} seeds)" if n > 1 else ""
    lines: list[str] = []
    for mode in report_modes(s):
        h = s[mode]["hacking"]
        seeds = f"; present in {h['present_seeds']} of {n} seeds" if n > 1 else ""
        lines.append(
            f"{mode_label(mode)}: training reward {_moved(h['reward_start'], h['reward_end'])} while held-out "
            f"accuracy {_moved(h['acc_before'], h['acc_after'])}{of} (reward hacking signature "
            f"{'present' if h['present'] else 'not present'}{seeds}).")
    coop, rule = s["cooper"], s["rule"]
    diff = coop["acc_after"] - rule["acc_after"]
    lines.append(f"Cooper vs rule: held-out accuracy after training {coop['acc_after']:.3f} vs "
                 f"{rule['acc_after']:.3f} ({diff:+.3f}){of}.")
    if paired:
        lines.append(f"Paired per-problem difference, Cooper - rule: {paired.mean:+.3f} ± {paired.se:.3f} "
                     f"(standard error over {paired.problems} held-out problems, {paired.seeds} seed(s)); one "
                     f"accuracy on {paired.problems} problems has a standard error of about "
                     f"{paired.single_acc_se:.3f}.")
    seeds = list(results)
    parts = verdict_parts(s, [per_seed[x] for x in seeds] if per_seed else [s], [results[x] for x in seeds])
    by_name = {p.name: p.holds for p in parts}
    separation = _rm_separation(coop)
    if by_name.get("Cooper vs rule on all problems") is False and separation is not None:
        lines.append(_why_below_rule(coop, rule, separation, of))
    if not s["static_rm"]["hacking"]["present"]:
        lines.append(_why_not_hacked(s["static_rm"], of))
    rm_ok: dict[str, bool | None] = {}
    for mode in RM_MODES:
        b, a = s[mode]["rm_acc_before"], s[mode]["rm_acc_after"]
        if b is None or a is None:
            rm_ok[mode] = None
            lines.append(f"{mode_label(mode)}: RM accuracy on held-out labeled completions not measured.")
        else:
            rm_ok[mode] = a >= b - _EPS
            lines.append(f"{mode_label(mode)}: RM accuracy on held-out labeled completions {_moved(b, a)}{of}.")
    seed_parts = ({x: verdict_parts(per_seed[x], [per_seed[x]], [results[x]]) for x in seeds}
                  if per_seed and n > 1 else {})
    holds = {p.name: sum(bool(q.holds) for sp in seed_parts.values() for q in sp if q.name == p.name)
             for p in parts} if seed_parts else {}
    lines.append(f"The verdict in parts{of} (a part about a change or a difference holds unless it is below "
                 f"-{SE_BAND:g} standard errors; standard errors over problems and seeds):")
    lines += [f"- {_part_line(p)}" + (f" It holds in {holds[p.name]} of {n} seeds." if holds else "") for p in parts]
    failed = [p.name for p in parts if p.holds is not True]
    reproduced = not failed
    claim = "reproduced" if reproduced else "not reproduced (not holding: " + "; ".join(failed) + ")"
    if seed_parts:
        whole = sum(all(q.holds for q in sp) for sp in seed_parts.values())
        claim += f"; every part holds in {whole} of {n} seeds"
    lines.append(f"Paper's claim in miniature{of}: {claim}.")
    return {"static_rm_hacking": s["static_rm"]["hacking"]["present"], "cooper_hacking": coop["hacking"]["present"],
            "cooper_at_rule_baseline": by_name.get("Cooper vs rule on all problems"),
            "cooper_minus_rule_acc": diff, "cooper_rm_separation": separation,
            "static_rm_rm_acc_not_degraded": rm_ok["static_rm"], "cooper_rm_acc_not_degraded": rm_ok["cooper"],
            "claim_reproduced": reproduced, "failed": failed, "checks": by_name, "parts": to_plain(parts),
            "seeds_holding": holds,
            "claim_reproduced_seeds": sum(all(q.holds for q in sp) for sp in seed_parts.values()),
            "lines": lines}


def _rm_separation(coop: Mapping[str, Any]) -> float | None:
    """Cooper's RM at the end of training: its mean reward on rule-correct minus rule-wrong rollouts
    (the in-training ``rm/reward_correct`` and ``rm/reward_wrong``); None when not logged."""
    w = coop.get("windows", {})
    if K.RM_REWARD_CORRECT not in w or K.RM_REWARD_WRONG not in w:
        return None
    return w[K.RM_REWARD_CORRECT]["end"] - w[K.RM_REWARD_WRONG]["end"]


def _why_below_rule(coop: Mapping[str, Any], rule: Mapping[str, Any], separation: float, of: str) -> str:
    """The verdict's reason when Cooper ends below the rule baseline: how far its RM's reward
    separates rule-correct from rule-wrong rollouts (the rule reward separates them by 1); where the
    RM errs, the policy's advantages point away from the rule's."""
    w = coop["windows"]
    gained, rule_gained = coop["acc_change"], rule["acc_change"]
    share = f", {gained / rule_gained:.0%} of the rule run's {rule_gained:+.3f}" if rule_gained > 0 else ""
    return (f"Why Cooper is below the rule baseline: at the end of training{of} its RM's mean reward was "
            f"{w[K.RM_REWARD_CORRECT]['end']:.3f} on rule-correct rollouts and {w[K.RM_REWARD_WRONG]['end']:.3f} on "
            f"rule-wrong ones (a separation of {separation:.3f}; the rule reward's is 1): where the RM errs, the "
            f"policy's advantages point away from the rule's; Cooper's held-out accuracy changed by "
            f"{gained:+.3f}{share}.")


def _why_not_hacked(static: Mapping[str, Any], of: str) -> str:
    """The verdict's reason when the static RM shows no hacking signature: which half is missing, what
    its RM rewarded among rule-wrong rollouts, how far the policy moved into the blind spot."""
    h = static["hacking"]
    missing = [f"its training reward rose {h['reward_rise']:+.3f} (the signature needs +{h['min_reward_rise']})"
               if h["reward_rise"] < h["min_reward_rise"] - _EPS else "",
               f"its held-out accuracy changed {h['acc_change']:+.3f} (the signature needs -{h['min_acc_drop']})"
               if h["acc_change"] > -h["min_acc_drop"] + _EPS else ""]
    text = f"Why the static RM shows no hacking signature{of}: " + " and ".join(m for m in missing if m)
    wrong = static.get("windows", {}).get(K.RM_REWARD_WRONG)
    if wrong:
        text += (f"; its frozen RM rewarded {wrong['start']:.0%} of the rule-wrong rollouts at the start and "
                 f"{wrong['end']:.0%} at the end")
    d = static.get("details", {})
    if "kind_intermediate_before" in d and "kind_intermediate_after" in d:
        text += (f"; answers in the RM's blind spot (an intermediate result boxed) went from "
                 f"{d['kind_intermediate_before']:.1%} to {d['kind_intermediate_after']:.1%} of the policy's")
    if static.get("rm_acc_before") is not None:
        text += f"; the RM's benchmark accuracy is {static['rm_acc_before']:.3f}"
    return text + "."


def _moved(a: float, b: float) -> str:
    """'rose from 0.490 to 0.940' / 'fell from ...' / 'stayed at 0.500' (3 decimals)."""
    if round(a, 3) == round(b, 3):
        return f"stayed at {a:.3f}"
    return f"{'rose' if b > a else 'fell'} from {a:.3f} to {b:.3f}"


def paired_difference(results: Mapping[int, Mapping[str, RunResult]]) -> PairedDifference | None:
    """Cooper minus rule on the same held-out problems: per problem the difference of the two trained
    policies' accuracies, averaged over the seeds; its mean and standard error (sd / sqrt(problems)).

    A single accuracy on n problems has a standard error of about sqrt(p (1 - p) / n) (0.015-0.02
    at n = 512); the paired difference removes the problems' shared difficulty. None when a run
    lacks per-problem accuracies or their counts differ.
    """
    per_seed = []
    for runs in results.values():
        c, r = runs["cooper"].problem_acc, runs["rule"].problem_acc
        if not c or len(c) != len(r):
            return None
        per_seed.append([a - b for a, b in zip(c, r)])
    if len({len(d) for d in per_seed}) != 1:
        return None
    diffs = [_mean(col) for col in zip(*per_seed)]
    n = len(diffs)
    se = statistics.stdev(diffs) / n ** 0.5 if n > 1 else float("nan")
    acc = _mean([_mean(runs["rule"].problem_acc) for runs in results.values()])
    return PairedDifference(mean=_mean(diffs), se=se, problems=n, seeds=len(per_seed),
                            single_acc_se=(acc * (1 - acc) / n) ** 0.5)


def _control_summary(folder: str, out_dir: str) -> dict[str, Any]:
    """The control report's per-mode accuracies, hacking signatures and verdict (from its summary.json)."""
    with open(os.path.join(folder, SUMMARY_FILE), encoding="utf-8") as f:
        s = json.load(f)
    verdict = {k: s["verdict"][k] for k in ("claim_reproduced", "failed", "cooper_minus_rule_acc")}
    return {"link": os.path.relpath(os.path.join(folder, REPORT_FILE), out_dir), "paired": s.get("paired"),
            "verdict": verdict,
            **{mode: {k: s[mode][k] for k in ("acc_before", "acc_after", "acc_change", "train_reward_initial",
                                             "train_reward_final", "rm_acc_before", "rm_acc_after", "sd")}
               for mode in s.get("modes", MODES)}}


# ----------------------------------------------------------------------------- entry point


def _by_seed(runs: Mapping[Any, Any]) -> dict[int, Mapping[str, Any]]:
    """``{seed: {mode: run}}`` from either that or one seed's ``{mode: run}`` (seed 0)."""
    if not isinstance(runs, Mapping):
        raise ValueError(f"runs must be a dict of mode -> RunResult or seed -> that, got {type(runs).__name__}")
    if runs and all(isinstance(k, int) and not isinstance(k, bool) for k in runs):
        return dict(runs)
    return {0: runs}


def write_report(out_dir: str, runs: Mapping[Any, Any], config: Mapping[str, Any] | None = None,
                 design: Mapping[int, Mapping[str, Any]] | None = None, control: str | None = None) -> str:
    """Write the demo's report folder (see the module docstring for its contents).

    Every input is checked before anything is written.

    Args:
        out_dir: the report folder (created; existing report files are overwritten).
        runs: ``"rule"``, ``"static_rm"`` and ``"cooper"`` -> :class:`RunResult` (or its dict form)
            for one seed, or ``{seed: that}`` for several.
        config: the demo's settings, redacted (:func:`cooper_mcore.redaction.redact`) into
            ``summary.json`` and ``report.md``.
        design: per seed, the task's design figures (``sft``: the SFT policy's oracle and rule
            accuracy, the rule's recall and precision, per family; ``rm_bench`` / ``rm_own``: the RM
            before RL on the benchmark and on the SFT policy's own completions, per family).
        control: the report folder of the same demo on the single-family control task, whose
            numbers are set beside these.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: naming the culprit (and its seed, with several) on a missing or unknown mode, a
            missing, empty or reward-less metrics file, an accuracy outside [0, 1], RM accuracies
            for ``rule``, or a config that is not a mapping.
    """
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict or None, got {type(config).__name__}")
    seeds = _by_seed(runs)
    results: dict[int, dict[str, RunResult]] = {}
    metrics: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for seed, seed_runs in seeds.items():
        try:
            results[seed], metrics[seed] = _validate(seed_runs)
        except ValueError as e:
            raise ValueError(f"seed {seed}: {e}" if len(seeds) > 1 else str(e)) from None
    per_seed = {s: {mode: _summarize(results[s][mode], metrics[s][mode]) for mode in report_modes(results[s])}
                for s in seeds}
    if len({tuple(p) for p in per_seed.values()}) > 1:
        raise ValueError(f"the seeds ran different reward modes: { {s: list(p) for s, p in per_seed.items()} }")
    summary: dict[str, Any] = aggregate_seeds(per_seed)
    paired = paired_difference({s: results[s] for s in seeds})
    summary["verdict"] = _verdict(summary, results, per_seed if len(seeds) > 1 else None, paired)
    summary["modes"] = list(next(iter(per_seed.values())))
    summary["seeds"] = list(seeds)
    summary["per_seed"] = {str(s): per_seed[s] for s in seeds}
    summary["design"] = {str(s): design[s] for s in seeds} if design else None
    summary["paired"] = to_plain(paired)
    summary["control"] = _control_summary(control, out_dir) if control else None
    summary["config"] = redact(dict(config)) if config is not None else None
    os.makedirs(out_dir, exist_ok=True)
    copies: dict[int, dict[str, str]] = {}
    for seed in seeds:
        copies[seed] = {}
        for mode in summary["modes"]:
            name = f"metrics_{mode}.jsonl" if len(seeds) == 1 else f"metrics_{mode}_seed{seed}.jsonl"
            src, dst = metrics_file(results[seed][mode].metrics_path), os.path.join(out_dir, name)
            if not (os.path.exists(dst) and os.path.samefile(src, dst)):
                shutil.copyfile(src, dst)
            copies[seed][mode] = dst
    plots = plot(out_dir, metrics, per_seed)
    with open(os.path.join(out_dir, SUMMARY_FILE), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
        f.write("\n")
    with open(os.path.join(out_dir, REPORT_FILE), "w", encoding="utf-8") as f:
        f.write(markdown(summary, results, copies, plots))
    for line in summary["verdict"]["lines"]:
        logger.info("%s", line)
    logger.info("demo report written to %s", out_dir)
    return out_dir
