"""The rehearsal tier: whole runs of ``cooper rehearse`` (three torchrun launches each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, shared_dir


@pytest.fixture(scope="session")
def rehearsal_root(tmp_path_factory):
    """One folder for every rehearsal of the test run (every pytest worker's): their tiny assets are
    built once per shape (``cooper rehearse`` locks a shape's folder while it builds it)."""
    return shared_dir(tmp_path_factory, "rehearsals")


def rehearse(root, name: str, preset: str, *overrides: str, timeout: int = 900) -> tuple[str, dict]:
    """Run ``cooper rehearse`` as a user does; return its output and its report.json."""
    out = os.path.join(str(root), name)
    r = subprocess.run([sys.executable, "-m", "cooper_mcore", "rehearse", "--config", preset, "--out", out,
                        *overrides], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    verdict = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 0 and "PASS" in verdict, f"exit {r.returncode}\n{r.stdout[-8000:]}\n{r.stderr[-3000:]}"
    with open(os.path.join(out, "report.json")) as f:
        return r.stdout, json.load(f)
