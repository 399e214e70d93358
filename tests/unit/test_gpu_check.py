"""`make gpu-check` (tools/gpu_check.py): one clear line and exit 1 without a GPU; on CPU with the
test-only --allow-cpu flag the same pipeline runs at the tiny shapes and writes its report."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

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
    assert report.index("| gpu_tests |") < report.index("| train_step_")
    assert "| megatron-local |" in report and "| transformers |" in report  # the benchmark's table
    assert (tmp_path / "train_step_megatron-local.json").exists()


def test_the_steps_run_in_the_order_of_the_issue(tmp_path):
    """tests/gpu, the train-step benchmark, the Cooper-step benchmark (it runs both variants), the MoE step."""
    gpu_check = _gpu_check()
    names = [s.name for s in gpu_check.plan_steps(sys.executable, tiny=False, quick=False, out=tmp_path)
             if s.name != "sglang_gpu_tests"]
    assert names == ["gpu_tests", "train_step_megatron-local", "train_step_megatron-te", "train_step_transformers",
                     "cooper_step", "moe_step"]
    cooper = next(s for s in gpu_check.plan_steps(sys.executable, False, False, tmp_path) if s.name == "cooper_step")
    assert "--variant" not in cooper.cmd  # one step, both variants (each in its own process)
    limits = sum(s.timeout_s for s in gpu_check.plan_steps(sys.executable, False, False, tmp_path)
                 if s.name != "sglang_gpu_tests")
    assert limits >= 480  # each step may take what the others leave of the 8 minutes
    quick = [s.name for s in gpu_check.plan_steps(sys.executable, False, True, tmp_path)]
    assert "cooper_step" not in quick and "moe_step" not in quick


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


def _gpu_check():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for its reaper counts as gone)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


def test_a_timed_out_torchrun_step_leaves_no_rank_running(tmp_path):
    """torchrun starts each rank in a session of its own: killing the step's process group (what
    gpu_check did) left a killed step's ranks running, holding their GPU memory for the next steps."""
    gpu_check = _gpu_check()
    worker = tmp_path / "sleeper.py"
    worker.write_text("import os, sys, time\n"
                      "path = os.path.join(sys.argv[1], 'rank%s.pid' % os.environ['RANK'])\n"
                      "open(path, 'w').write(str(os.getpid()))\n"
                      "time.sleep(600)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           str(tmp_path)]
    pgids: dict[str, int] = {}
    tree_kill = gpu_check.ProcessTree.kill

    def kill_and_record(tree):  # the agent's and the ranks' process groups, just before the kill
        pgids.update({f.name: os.getpgid(int(f.read_text())) for f in tmp_path.glob("rank*.pid")},
                     agent=os.getpgid(tree.proc.pid))
        return tree_kill(tree)

    gpu_check.ProcessTree.kill = kill_and_record
    try:
        step = gpu_check.run_step(gpu_check.Step("torchrun_sleeper", cmd, 25), tmp_path)
    finally:
        gpu_check.ProcessTree.kill = tree_kill
    ranks = [int(f.read_text()) for f in sorted(tmp_path.glob("rank*.pid"))]
    assert step.rc == 124 and len(ranks) == 2, (step.rc, ranks, step.log[-2000:])
    assert pgids["rank0.pid"] != pgids["agent"] != pgids["rank1.pid"]  # out of reach of the step's killpg
    assert all(_gone(r) for r in ranks), [psutil.Process(r).status() for r in ranks if psutil.pid_exists(r)]
    assert "timed out after 25 s; killed" in step.log, step.log[-500:]


def test_a_step_that_exits_leaving_a_process_behind_has_it_killed(tmp_path):
    gpu_check = _gpu_check()
    pid_file = tmp_path / "orphan.pid"
    leaver = [sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(600)'], start_new_session=True); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))"]
    step = gpu_check.run_step(gpu_check.Step("leaver", leaver, 60), tmp_path)
    assert step.rc == 0 and "left 1 process(es) running: killed" in step.log, step.log
    assert _gone(int(pid_file.read_text()))


def test_a_step_past_the_budget_is_killed_with_its_children_and_the_rest_skipped(tmp_path):
    gpu_check = _gpu_check()

    sleeper = [sys.executable, "-c", "import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]
    deadline = time.monotonic() + gpu_check.MARGIN_S + 2
    t0 = time.monotonic()
    slow = gpu_check.run_step(gpu_check.Step("slow", sleeper, 600), tmp_path, deadline)
    assert slow.rc == 124 and time.monotonic() - t0 < 30 and "timed out" in (tmp_path / "slow.log").read_text()
    late = gpu_check.run_step(gpu_check.Step("late", [sys.executable, "-c", "pass"], 600), tmp_path, deadline)
    assert late.rc is None and late.result == "skipped (budget)"
