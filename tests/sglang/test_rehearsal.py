"""`cooper rehearse` with the real SGLang engine on its CPU backend: where SGLang runs, a rehearsal
keeps the preset's engine (here tiny_cpu.yaml set to SGLang, two data-parallel ranks, one engine
each), and the run evaluates, checkpoints, stops on SIGUSR1 and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.sglang.conftest import ROOT

pytestmark = pytest.mark.sglang


def test_rehearsal_keeps_the_sglang_engine(tmp_path):
    out = tmp_path / "tiny_sglang"
    r = subprocess.run([sys.executable, "-m", "cooper_mcore", "rehearse", "--config",
                        str(ROOT / "examples" / "tiny_cpu.yaml"), "--out", str(out), "rollout.engine=sglang",
                        "rollout.sglang_base_port=31000"],  # beside test_train.py's engines at 30000
                       capture_output=True, text=True, timeout=1500, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert "engine sglang" in report["features"]
    assert not any(s["setting"] == "rollout.engine" for s in report["substitutions"])
    assert report["ok"] and {c["name"] for c in report["checks"]} >= {"stop signal", "resume", "evaluation"}
