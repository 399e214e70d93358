"""The README's quick start, run as written: the lines of the ```bash block that follows
``<!-- quick-start -->``, in order, each must exit 0. The documentation is code: when it drifts
from what works, this fails.

The commands run in a fresh folder that holds a link to the repository's ``examples/`` (the
quick start runs in the repository root, and writes only under ``runs/``); ``cooper`` becomes
``python -m cooper_mcore`` and ``torchrun`` ``python -m torch.distributed.run`` of this Python.
Nothing else is changed.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- quick-start -->"
PROGRAMS = {"cooper": [sys.executable, "-m", "cooper_mcore"],
            "torchrun": [sys.executable, "-m", "torch.distributed.run"]}


def quickstart_commands(readme: str) -> list[list[str]]:
    """The argv of each command of the quick-start block (comments dropped, ``\\`` lines joined)."""
    assert readme.count(MARKER) == 1, f"README.md needs exactly one {MARKER} marker"
    after = readme.split(MARKER, 1)[1].lstrip("\n")
    assert after.startswith("```bash\n"), f"a ```bash block must follow {MARKER}"
    block = after[len("```bash\n"):].split("\n```", 1)[0]
    return [argv for line in block.replace("\\\n", " ").splitlines() if (argv := shlex.split(line, comments=True))]


def test_the_quickstart_parses():
    commands = quickstart_commands((ROOT / "README.md").read_text())
    assert commands and all(argv[0] in PROGRAMS for argv in commands), commands


def test_the_readmes_quickstart_runs_as_written(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for argv in quickstart_commands((ROOT / "README.md").read_text()):
        t0 = time.monotonic()
        r = subprocess.run(PROGRAMS[argv[0]] + argv[1:], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        shown = shlex.join(argv)
        assert r.returncode == 0, (f"`{shown}` exited {r.returncode} after {time.monotonic() - t0:.0f} s:\n"
                                   f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
