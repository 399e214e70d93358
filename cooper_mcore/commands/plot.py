"""``cooper plot``: a run's main curves (reward, accuracy, KL, RM accuracy, timing) from its
``metrics.jsonl`` to a PNG (:func:`cooper_mcore.plots.plot_run`)."""

from __future__ import annotations

import argparse
import os

from cooper_mcore.commands import check_output_file
from cooper_mcore.metrics import METRICS_FILE, read_metrics
from cooper_mcore.plots import plot_run

#: the PNG's name in the run folder when ``--out`` is not given
PLOT_FILE = "metrics.png"


def plot(args: argparse.Namespace) -> None:
    folder = args.run if os.path.isdir(args.run) else os.path.dirname(os.path.abspath(args.run))
    out = args.out or os.path.join(folder, PLOT_FILE)
    source = os.path.join(args.run, METRICS_FILE) if os.path.isdir(args.run) else args.run
    check_output_file(out)
    panels = plot_run(read_metrics(source), out, title=args.title or os.path.basename(os.path.abspath(folder)),
                      source=source)
    print(f"{out}: {', '.join(panels)}", flush=True)  # what was drawn, where
