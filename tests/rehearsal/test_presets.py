"""Every shipped preset rehearses green: its layout, features and cadence run on CPU with a tiny
model of its family, with a stop signal and a bitwise resume (``cooper rehearse``). A preset added
to examples/ is rehearsed here without anyone writing a test for it."""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.conftest import ROOT
from tests.rehearsal.conftest import rehearse
from tests.rehearsal.test_run_matrix import KEEP

pytestmark = [pytest.mark.multiproc, pytest.mark.rehearsal]
PRESETS = sorted(glob.glob(str(ROOT / "examples" / "*.yaml")))


def test_every_preset_is_found():
    names = {os.path.basename(p) for p in PRESETS}
    assert {"tiny_cpu.yaml", "qwen2.5-1.5b_8xh100.yaml", "llama3.2-1b_8xh100.yaml",
            "qwen2.5-7b_multinode.yaml"} <= names
    assert any(n.startswith("qwen3-30b-a3b_") for n in names), "no mixture-of-experts (Qwen3-30B-A3B) preset"


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: os.path.splitext(os.path.basename(p))[0])
def test_preset_rehearses(preset, rehearsal_root):
    name = os.path.splitext(os.path.basename(preset))[0]
    # tiny_cpu's rehearsal (DP=2, the engine released) is also the run matrix's DP=2 case: with the engine kept too
    variant = ("--variant", KEEP) if name == "tiny_cpu" else ()
    stdout, report = rehearse(rehearsal_root, name, preset, *variant)
    assert report["ok"] and report["nproc"] <= 4
    names = {c["name"] for c in report["checks"]}
    assert {"collectives", "evaluation", "checkpoints", "stop signal", "resume"} <= names
    if variant:
        assert {f"stop signal [{KEEP}]", f"resume [{KEEP}]"} <= names and report["layout"].startswith("tp=1 pp=1 dp=2 ")
    assert "substituted:" in stdout and "layout:" in stdout
    if os.path.basename(preset).startswith("qwen3-30b-a3b_"):  # expert parallelism kept, shrunk to the ranks
        ep = re.search(r" ep=(\d+) etp=1 ", report["layout"])
        assert ep and int(ep.group(1)) > 1 and "model:    qwen3_moe" in stdout
