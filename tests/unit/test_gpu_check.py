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
    for step in ("rehearsal", "gpu_tests", "train_step_megatron-local", "train_step_transformers"):
        assert f"| {step} | pass |" in report, report
    # most informative per minute first: the GPU tests, the benchmarks, the real-shape rehearsal last
    # (its asset build alone took 3 of the 8 minutes on a lent H200)
    assert report.index("| gpu_tests |") < report.index("| train_step_") < report.index("| rehearsal |")
    assert "rehearsed at its real shape" in report and "| policy_update |" in report
    assert "| megatron-local |" in report and "| transformers |" in report  # the benchmark's table
    assert (tmp_path / "train_step_megatron-local.json").exists()


def test_the_sglang_gpu_selection_is_not_empty():
    """The selection gpu_check runs must select the SGLang GPU tests (marked ``gpu`` only: ``gpu and
    sglang`` selected nothing, pytest exited 5 and the step failed on every GPU machine)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from gpu_check import SGLANG_GPU_TESTS
    finally:
        sys.path.pop(0)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *SGLANG_GPU_TESTS], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:]
    collected = [line for line in r.stdout.splitlines() if "test_gpu.py::" in line]
    assert len(collected) >= 2, r.stdout[-2000:]


def test_a_step_past_the_budget_is_killed_with_its_children_and_the_rest_skipped(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    import time

    sleeper = [sys.executable, "-c", "import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]
    deadline = time.monotonic() + gpu_check.MARGIN_S + 2
    t0 = time.monotonic()
    slow = gpu_check.run_step(gpu_check.Step("slow", sleeper, 600), tmp_path, deadline)
    assert slow.rc == 124 and time.monotonic() - t0 < 30 and "timed out" in (tmp_path / "slow.log").read_text()
    late = gpu_check.run_step(gpu_check.Step("late", [sys.executable, "-c", "pass"], 600), tmp_path, deadline)
    assert late.rc is None and late.result == "skipped (budget)"
