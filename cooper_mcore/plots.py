"""Figures of ``metrics.jsonl`` curves (matplotlib's Agg canvas: no display needed): the series of a
metric key, a figure of stacked panels over the steps, a PNG written whole or not at all, and a
run's main curves (``cooper plot``). The demo report (:mod:`cooper_mcore.demo.report_render`)
draws its figures with the same pieces.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from cooper_mcore.atomic import atomic_path
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.metric_names import Phase, time_key

__all__ = ["RUN_PANELS", "Curve", "Panel", "plot_run", "save_figure", "series", "stacked_figure"]

#: inches: the figures' width, one panel's height, and the room for the title and the last x axis
WIDTH, PANEL_HEIGHT, MARGIN = 7.5, 2.6, 1.0
DPI = 100


def series(metrics: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` on the lines that logged a finite number for it."""
    steps: list[int] = []
    values: list[float] = []
    for i, m in enumerate(metrics):
        v = m.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(m.get(K.STEP, i + 1)))
            values.append(float(v))
    return steps, values


def stacked_figure(panels: int, panel_height: float = PANEL_HEIGHT) -> tuple[Figure, list[Axes]]:
    """A figure of ``panels`` panels one above the other, sharing the step axis (integer ticks, a light grid)."""
    fig = Figure(figsize=(WIDTH, MARGIN + panel_height * panels), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = []
    for i in range(panels):
        ax = fig.add_subplot(panels, 1, i + 1)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.append(ax)
    axes[-1].set_xlabel("step")
    return fig, axes


def save_figure(fig: Figure, path: str) -> None:
    """Write ``fig`` to the PNG ``path`` whole (a temporary file renamed over it: a failure leaves
    what was there)."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


class Curve(NamedTuple):
    """One line of a panel: a metric key, its legend label and its line style."""

    key: str
    label: str
    style: str = "-"


class Panel(NamedTuple):
    """One panel of :func:`plot_run`: its name (in the figure: its title), y label and curves."""

    name: str
    ylabel: str
    curves: tuple[Curve, ...]


_PHASES = (Phase.ROLLOUT, Phase.RM_SCORE, Phase.LOGPROBS, Phase.POLICY_UPDATE, Phase.RM_UPDATE, Phase.WEIGHT_SYNC,
           Phase.OFFLOAD, Phase.EVAL)
#: a run's main curves, one panel each (:func:`plot_run`); a panel none of whose keys the run logged is left out
RUN_PANELS = (
    Panel("reward", "reward", (Curve(K.REWARD_MEAN, "policy's reward"), Curve(K.RM_REWARD_CORRECT, "RM, rule-correct"),
                               Curve(K.RM_REWARD_WRONG, "RM, rule-wrong", "--"))),
    Panel("accuracy", "accuracy", (Curve(K.RULE_ACC, "rollouts (rule)"), Curve(K.EVAL_ACC, "held-out", "o-"),
                                   Curve(K.EVAL_RULE_ACC, "held-out (rule)", "o--"))),
    Panel("KL", "KL", (Curve(K.KL, "policy to reference"), Curve(K.LOGPROB_KL, "engine to trainer", "--"))),
    Panel("RM accuracy", "RM accuracy", (Curve(K.RM_PAIR_ACC, "pairs"), Curve(K.RM_THRESHOLD_ACC, "threshold", "--"))),
    Panel("timing", "seconds", (Curve(K.TIME_STEP, "step"), *(Curve(time_key(p), p, "--") for p in _PHASES))),
)


def plot_run(metrics: Sequence[Mapping[str, Any]], path: str, title: str = "",
             source: str = "the metrics") -> list[str]:
    """Draw a run's main curves (:data:`RUN_PANELS`: reward, accuracy, KL, RM accuracy, timing) from
    its ``metrics.jsonl`` lines to the PNG ``path``; return the names of the panels drawn. ``source``:
    where the lines were read (the error names it).

    Raises:
        ValueError: the lines hold none of the panels' keys (not a ``cooper train`` run's metrics).
    """
    panels = [p for p in RUN_PANELS if any(series(metrics, c.key)[0] for c in p.curves)]
    if not panels:
        raise ValueError(f"{source}: none of {', '.join(p.name for p in RUN_PANELS)} logged "
                         f"({len(metrics)} lines): not the metrics of a `cooper train` run")
    fig, axes = stacked_figure(len(panels))
    for i, (ax, panel) in enumerate(zip(axes, panels)):
        for curve in panel.curves:
            steps, values = series(metrics, curve.key)
            if steps:
                marker = "o" if curve.style.startswith("o") else None
                ax.plot(steps, values, linestyle=curve.style.lstrip("o"), marker=marker, label=curve.label)
        ax.set(title=f"{title}: {panel.name}" if title and i == 0 else panel.name, ylabel=panel.ylabel)
        ax.legend(fontsize="small")
    save_figure(fig, path)
    return [p.name for p in panels]
