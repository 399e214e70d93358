"""`make gpu-check` (tools/gpu_check.py): one clear line and exit 1 without a GPU; on CPU with the
test-only --allow-cpu flag the same pipeline runs at the tiny shapes and writes its report."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_without_a_gpu_one_line_and_exit_1():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a GPU node"]


def test_pipeline_and_report_at_tiny_shapes(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--allow-cpu", "--quick", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    for step in ("gpu_tests", "train_step_megatron-local", "train_step_transformers"):
        assert f"| {step} | pass |" in report, report
    assert "| megatron-local |" in report and "| transformers |" in report  # the benchmark's table
    assert (tmp_path / "train_step_megatron-local.json").exists()
