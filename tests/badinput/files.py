"""The tools' inputs and outputs: an output that is a folder, a FIFO, a link to a device or goes through a
file; an input without rows or with a malformed one; metrics that are not a run's."""

from __future__ import annotations

import json
import os

from tests.badinput.case import Case, Env


def rows(text: str):
    """A setup: ``{tmp}/in.jsonl`` holds ``text``; ``{tmp}/results`` is a folder, ``{tmp}/notes.txt`` a file,
    ``{tmp}/fifo`` a FIFO and ``{tmp}/null`` a link to ``/dev/null``."""

    def setup(env: Env) -> dict[str, str]:
        (env.tmp / "in.jsonl").write_text(text)
        (env.tmp / "results").mkdir()
        (env.tmp / "notes.txt").write_text("x")
        os.mkfifo(env.tmp / "fifo")
        os.symlink("/dev/null", env.tmp / "null")
        return {}

    return setup


def metrics_of_no_run(env: Env) -> dict[str, str]:
    """A ``metrics.jsonl`` with none of the curves ``cooper plot`` draws (a reward model's training)."""
    (env.tmp / "metrics.jsonl").write_text(json.dumps({"step": 1, "rm_train/loss": 0.5}) + "\n")
    return {}


def a_file(env: Env) -> dict[str, str]:
    (env.tmp / "assets").write_text("x")
    return {}


ONE_ROW = rows('{"gold": "1", "pred": "1"}\n')
VERIFY = ("verify", "--in", "{tmp}/in.jsonl", "--out")

CASES = [
    Case("verify into a folder", (*VERIFY, "{tmp}/results"), ("{tmp}/results", "is a folder, where a file is expected"),
         ONE_ROW),
    Case("verify into a path through a file", (*VERIFY, "{tmp}/notes.txt/sub/v.jsonl"),
         ("{tmp}/notes.txt", "a file is in the way"), ONE_ROW),
    Case("verify into a FIFO", (*VERIFY, "{tmp}/fifo"), ("{tmp}/fifo exists and is not a regular file", "a FIFO"),
         ONE_ROW),
    Case("verify into a link to /dev/null", (*VERIFY, "{tmp}/null"),
         ("{tmp}/null exists and is not a regular file", "a character device"), ONE_ROW),
    Case("verify an empty input", (*VERIFY, "{tmp}/v.jsonl"), ("{tmp}/in.jsonl has no rows to verify",
                                                               "nothing was written"), rows("")),
    Case("verify an input of blank lines", (*VERIFY, "{tmp}/v.jsonl"), ("{tmp}/in.jsonl has no rows to verify",),
         rows("\n  \n")),
    Case("verify a malformed row", (*VERIFY, "{tmp}/v.jsonl"), ("{tmp}/in.jsonl:2: invalid JSON",),
         rows('{"gold": "1", "pred": "1"}\n{"gold": 1\n')),
    Case("tiny-assets into a file", ("tiny-assets", "--out", "{tmp}/assets"), ("{tmp}/assets", "a file is in the way"),
         a_file),
    Case("plot metrics of no run", ("plot", "{tmp}"),
         ("{tmp}/metrics.jsonl: none of reward, accuracy, KL, RM accuracy, timing logged (1 lines)",),
         metrics_of_no_run),
    Case("plot a folder without metrics", ("plot", "{tmp}/missing"), ("{tmp}/missing",)),
]

