"""`cooper plot RUN`: a run's main curves from its metrics.jsonl to a PNG, one panel per curve group
that the run logged."""

from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

from cooper_mcore.cli import main as cli_main
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.metric_names import Phase, time_key
from cooper_mcore.plots import DPI, MARGIN, PANEL_HEIGHT, WIDTH


def _run(tmp_path, rm: bool):
    """A run folder whose metrics.jsonl has 4 steps (held-out accuracy at steps 2 and 4; the RM's keys with ``rm``)."""
    run = tmp_path / ("cooper" if rm else "rule")
    run.mkdir()
    lines = []
    for step in range(1, 5):
        m = {K.STEP: step, K.REWARD_MEAN: 0.1 * step, K.RULE_ACC: 0.2 * step, K.KL: 1e-3 * step,
             K.TIME_STEP: 2.0, time_key(Phase.ROLLOUT): 1.5, K.LOGPROB_KL: None}  # null: a non-finite value
        if rm:
            m.update({K.RM_PAIR_ACC: 0.5 + 0.1 * step, K.RM_THRESHOLD_ACC: 0.6, K.RM_REWARD_CORRECT: 0.7,
                      K.RM_REWARD_WRONG: 0.3})
        if step % 2 == 0:
            m[K.EVAL_ACC] = 0.25 * step
        lines.append(json.dumps(m))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def _panels_in(png) -> int:
    """How many panels the PNG holds, from its height (the figure is MARGIN + PANEL_HEIGHT per panel inches tall)."""
    height, width = imread(str(png)).shape[:2]
    assert width == round(WIDTH * DPI)
    panels = (height / DPI - MARGIN) / PANEL_HEIGHT
    assert panels == pytest.approx(round(panels), abs=0.01)
    return round(panels)


def test_a_cooper_runs_plot_has_every_panel(tmp_path, capsys):
    run = _run(tmp_path, rm=True)
    assert cli_main(["plot", str(run)]) == 0
    png = run / "metrics.png"
    assert capsys.readouterr().out.strip() == f"{png}: reward, accuracy, KL, RM accuracy, timing"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and _panels_in(png) == 5


def test_a_rule_runs_plot_leaves_out_the_reward_models_panel(tmp_path, capsys):
    run = _run(tmp_path, rm=False)
    out = tmp_path / "figs" / "rule.png"
    assert cli_main(["plot", str(run / "metrics.jsonl"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: reward, accuracy, KL, timing"
    assert _panels_in(out) == 4 and not (run / "metrics.png").exists()
