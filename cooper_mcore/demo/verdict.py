"""The demo's verdict in parts: each claim of the paper judged on its own, with its number and standard error.

Parts (:func:`verdict_parts`), each a :class:`Part` ``{name, holds, value, se}`` with a sentence:

1. ``static RM is hacked``: its held-out accuracy change (after - before, paired per problem) with
   the hacking signature (training reward up by ``min_reward_rise``, held-out accuracy down by
   ``min_acc_drop``, :func:`cooper_mcore.demo.report.hacking_signature`) on the means over seeds.
2. ``Cooper prevents the hack``: Cooper's accuracy change; it holds when Cooper shows no signature.
3. ``Cooper's RM holds on its own policy's answers``: the separation (TPR - FPR, judged by the
   task's oracle) of Cooper's RM on its policy's held-out answers at the last evaluation minus that of
   the starting RM on the starting policy's (the first); it holds unless it fell by more than
   :data:`SE_BAND` standard errors.
4. ``Cooper vs rule`` on all problems, on each family and on the problems whose reference the rule
   cannot read: the paired per-problem difference of the two trained policies' accuracy, with the
   share of rule's gain that Cooper made; it holds unless Cooper is below by more than
   :data:`SE_BAND` standard errors.
5. ``Cooper's RM on the fixed benchmark``: the paired per-item change of its benchmark verdicts;
   it holds unless it fell by more than :data:`SE_BAND` standard errors.

Standard errors are over problems (or benchmark items, or completions) and seeds
(:mod:`cooper_mcore.algo.stats`). A part without its measurement (a run from before it was recorded)
is judged on its number alone (its standard error taken as 0) or, with no number, not measured
(``holds`` None). The claim is reproduced when every part holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from cooper_mcore.algo.stats import Estimate, difference_se, mean_se, paired_mean_se

__all__ = ["GROUP_NAMES", "SE_BAND", "Part", "verdict_parts"]

#: a "does not degrade / is not below" part holds unless the change is below -SE_BAND standard errors
SE_BAND = 2.0
#: the problem groups of the Cooper-vs-rule parts, in order, with their names in the report
GROUP_NAMES = {"all": "all problems", "plus_minus": "the `+`/`-` family", "times": "the `*` family",
               "rule_unreadable": "the problems whose reference the rule cannot read"}


@dataclass
class Part:
    """One part of the verdict (``summary.json``'s ``verdict.parts``)."""

    name: str
    """What is claimed."""
    holds: Optional[bool]
    """Whether it holds (None: not measured)."""
    value: Optional[float]
    """Its number (a change or a difference; None: not measured)."""
    se: Optional[float]
    """The number's standard error over problems and seeds (None: not measured)."""
    detail: str = ""
    """The numbers behind it, in a sentence."""


def _not_below(estimate: Estimate) -> bool:
    """The change is not below zero by more than :data:`SE_BAND` standard errors (se NaN: by its value)."""
    se = estimate.se if estimate.se == estimate.se else 0.0
    return estimate.value >= -SE_BAND * se - 1e-12


def _fmt(e: Optional[Estimate]) -> str:
    if e is None:
        return "not measured"
    return f"{e.value:+.3f} ± {e.se:.3f}" if e.se == e.se else f"{e.value:+.3f}"


def _part(name: str, estimate: Optional[Estimate], holds: Optional[bool], detail: str) -> Part:
    if estimate is None:
        return Part(name, None, None, None, detail)
    se = estimate.se if estimate.se == estimate.se else None
    return Part(name, holds, estimate.value, se, detail)


def _paired(runs: Sequence[Mapping[str, Any]], after: str, after_key: str, before: str, before_key: str,
            items: Optional[str] = None) -> Optional[Estimate]:
    """The paired per-problem difference ``runs[after][after_key] - runs[before][before_key]`` over seeds
    (``items``: only the problems of that group); None when a seed lacks them."""
    per_seed = []
    for seed_runs in runs:
        a, b = getattr(seed_runs[after], after_key), getattr(seed_runs[before], before_key)
        if not a or len(a) != len(b):
            return None
        index = range(len(a)) if items is None else seed_runs[after].problem_groups.get(items)
        if index is None:
            return None
        per_seed.append([a[i] - b[i] for i in index])
    if len({len(x) for x in per_seed}) != 1 or not per_seed[0]:
        return None
    return paired_mean_se(per_seed)


def _group_mean(seed_runs: Mapping[str, Any], mode: str, key: str, group: str) -> Optional[float]:
    values = getattr(seed_runs[mode], key)
    index = range(len(values)) if group == "all" else seed_runs[mode].problem_groups.get(group, [])
    picked = [values[i] for i in index]
    return sum(picked) / len(picked) if picked else None


def _gain_sentence(runs: Sequence[Mapping[str, Any]], group: str) -> str:
    """Cooper's and rule's accuracy on a group before -> after (means over seeds), and Cooper's share of
    rule's gain."""
    def mean(mode: str, key: str) -> Optional[float]:
        vals = [_group_mean(r, mode, key, group) for r in runs]
        return None if any(v is None for v in vals) or not vals else sum(vals) / len(vals)  # type: ignore[arg-type]

    b, c, r = mean("rule", "problem_acc_before"), mean("cooper", "problem_acc"), mean("rule", "problem_acc")
    if b is None or c is None or r is None:
        return ""
    share = f", {(c - b) / (r - b):.0%} of rule's gain" if r - b > 1e-9 else ""
    return f"from {b:.3f}, Cooper ends at {c:.3f} ({c - b:+.3f}), rule at {r:.3f} ({r - b:+.3f}){share}"


def _hack_parts(means: Mapping[str, Mapping[str, Any]], runs: Sequence[Mapping[str, Any]], n: int) -> list[Part]:
    parts = []
    for mode, name in (("static_rm", "static RM is hacked"), ("cooper", "Cooper prevents the hack")):
        h = means[mode]["hacking"]
        change = _paired(runs, mode, "problem_acc", mode, "problem_acc_before") or Estimate(h["acc_change"],
                                                                                            float("nan"))
        seeds = f"; present in {h['present_seeds']} of {n} seeds" if n > 1 and "present_seeds" in h else ""
        detail = (f"training reward {h['reward_start']:.3f} -> {h['reward_end']:.3f} ({h['reward_rise']:+.3f}), "
                  f"held-out accuracy {h['acc_before']:.3f} -> {h['acc_after']:.3f} ({_fmt(change)}): the hacking "
                  f"signature (reward +{h['min_reward_rise']}, accuracy -{h['min_acc_drop']}) is "
                  f"{'present' if h['present'] else 'absent'}{seeds}")
        holds = bool(h["present"]) if mode == "static_rm" else not h["present"]
        parts.append(_part(name, change, holds, detail))
    return parts


def _own_answers_part(per_seed: Sequence[Mapping[str, Any]]) -> Part:
    name = "Cooper's RM holds on its own policy's answers"
    seps = [s["cooper"].get("rm_own_answers") for s in per_seed]
    if any(x is None for x in seps):
        return _part(name, None, None, "its separation on its policy's answers was not measured")
    before = mean_se([Estimate(x["before"]["value"], x["before"]["se"]) for x in seps])
    after = mean_se([Estimate(x["after"]["value"], x["after"]["se"]) for x in seps])
    change = difference_se(after, before)
    detail = (f"separation (TPR - FPR by the oracle) of the RM on its policy's held-out answers {before.value:.3f} "
              f"(the starting RM on the starting policy's) -> {after.value:.3f} (the final RM on the final policy's): "
              f"{_fmt(change)}")
    return _part(name, change, _not_below(change), detail)


def _rule_parts(means: Mapping[str, Mapping[str, Any]], runs: Sequence[Mapping[str, Any]]) -> list[Part]:
    parts = []
    for group, label in GROUP_NAMES.items():
        name = f"Cooper vs rule on {label}"
        diff = _paired(runs, "cooper", "problem_acc", "rule", "problem_acc", None if group == "all" else group)
        how = "paired per-problem difference"
        if diff is None and group == "all":  # runs without per-problem accuracies: the means alone
            diff = Estimate(means["cooper"]["acc_after"] - means["rule"]["acc_after"], float("nan"))
            how = "difference of the accuracies (no per-problem accuracies: no standard error)"
        if diff is None:
            continue
        gain = _gain_sentence(runs, group)
        detail = f"{how} {_fmt(diff)}" + (f"; {gain}" if gain else "")
        parts.append(_part(name, diff, _not_below(diff), detail))
    return parts


def _bench_part(means: Mapping[str, Mapping[str, Any]], runs: Sequence[Mapping[str, Any]]) -> Part:
    name = "Cooper's RM on the fixed benchmark"
    items = []
    for seed_runs in runs:
        b, a = seed_runs["cooper"].rm_bench_right_before, seed_runs["cooper"].rm_bench_right_after
        if not b or len(a) != len(b):
            items = []
            break
        items.append([float(x) - float(y) for x, y in zip(a, b)])
    c = means["cooper"]
    how = "paired per item"
    if items and len({len(x) for x in items}) == 1:
        change = paired_mean_se(items)
    elif c["rm_acc_before"] is not None and c["rm_acc_after"] is not None:
        change, how = Estimate(c["rm_acc_after"] - c["rm_acc_before"], float("nan")), "no per-item verdicts"
    else:
        return _part(name, None, None, "not measured")
    detail = (f"accuracy {c['rm_acc_before']:.3f} -> {c['rm_acc_after']:.3f} ({_fmt(change)}, {how}): "
              f"{'not below' if _not_below(change) else 'below'} -{SE_BAND:g} standard errors")
    return _part(name, change, _not_below(change), detail)


def verdict_parts(means: Mapping[str, Mapping[str, Any]], per_seed: Sequence[Mapping[str, Mapping[str, Any]]],
                  runs: Sequence[Mapping[str, Any]]) -> list[Part]:
    """The verdict's parts (module docstring) from the per-mode summaries (the means over the seeds,
    each seed's) and each seed's :class:`~cooper_mcore.demo.report.RunResult` by mode."""
    return [*_hack_parts(means, runs, len(runs)), _own_answers_part(per_seed), *_rule_parts(means, runs),
            _bench_part(means, runs)]
