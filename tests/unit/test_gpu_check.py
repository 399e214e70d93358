"""`make gpu-check` (tools/gpu_check.py): one clear line and exit 1 without a GPU; on CPU with the
test-only --allow-cpu flag the same pipeline runs at the tiny shapes and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from cooper_mcore.metric_names import MetricKey
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
    for step in ("gpu_tests", "moe_step"):
        assert f"| {step} | pass |" in report, report
    assert report.index("| gpu_tests |") < report.index("| moe_step |")
    assert "| 1 | 1 | grouped (torch._grouped_mm) |" in report  # the tiny run times the grouped experts only
    assert "## Gates" not in report  # --quick runs no Cooper step, so no mismatch gate


def _plan(tmp_path, quick=False, budget_s=480.0):
    return [s for s in _gpu_check().plan_steps(sys.executable, tiny=False, quick=quick, out=tmp_path, budget_s=budget_s)
            if s.name != "sglang_gpu_tests"]


def test_the_steps_run_in_the_order_of_the_issue(tmp_path):
    """tests/gpu, the MoE step (grouped experts, Qwen3-30B-A3B's layer), the Cooper-step benchmark
    (both settings, the mismatch gate's figures), then the train-step benchmark if time is left."""
    steps = _plan(tmp_path)
    assert [s.name for s in steps] == ["gpu_tests", "moe_step", "cooper_step", "train_step_megatron-local",
                                       "train_step_megatron-te", "train_step_transformers"]
    moe, cooper = steps[1], steps[2]
    assert moe.cmd[-4:] == ["moe_step.py", "--gpu", "--settings", "1x1"]  # both expert modules, one GPU
    assert "--variant" not in cooper.cmd and cooper.output == tmp_path / "cooper_step.json"
    assert cooper.timeout_s == 480 and not cooper.optional  # the rest of the budget
    assert [s.optional for s in steps[3:]] == [True] * 3
    assert [s.name for s in _plan(tmp_path, quick=True)] == ["gpu_tests", "moe_step"]


#: seconds each step took on an H200 (docs/gpu_check/2026-11-27_h200_*: the 5 tests then in 143 s with
#: start-up, the MoE forward tests 21 s more; the tests not yet run there counted as 11 s together) or,
#: for steps not run there yet, a guess at least as long as their slice
H200_SECONDS = {"gpu_tests": 175, "moe_step": 150, "cooper_step": 600, "train_step_megatron-local": 30,
                "train_step_megatron-te": 19, "train_step_transformers": 46}


def _simulate(steps, budget_s, seconds):
    """``[(name, start, limit)]``: when each step starts and the limit it gets, each taking ``seconds``
    (cut at its limit), as run_step slices the budget."""
    gpu_check, now, out = _gpu_check(), 0.0, []
    for step in steps:
        limit = gpu_check.time_limit(step, budget_s - now - gpu_check.MARGIN_S)
        out.append((step.name, now, limit))
        if limit is not None:
            now += min(seconds[step.name], limit)
    return out


def test_the_budget_reaches_the_moe_step_and_the_cooper_step_at_h200_timings(tmp_path):
    runs = {name: (start, limit) for name, start, limit in _simulate(_plan(tmp_path), 480, H200_SECONDS)}
    assert runs["moe_step"] == (175, 150)  # reached with its whole slice
    assert runs["cooper_step"] == (325, 150)  # the rest: 480 - 325 - 5
    assert all(runs[f"train_step_{v}"][1] is None for v in ("megatron-local", "megatron-te", "transformers"))
    # the worst case: every step uses its whole slice; the Cooper step still starts with 85 s
    worst = {name: (start, limit) for name, start, limit in _simulate(_plan(tmp_path), 480, dict.fromkeys(
        H200_SECONDS, 10_000))}
    assert worst["moe_step"] == (240, 150) and worst["cooper_step"] == (390, 85)
    # an optional step starts only with its whole slice left; a required one takes what is left
    early = {name: limit for name, _, limit in _simulate(_plan(tmp_path), 480, dict(H200_SECONDS, moe_step=60,
                                                                                   cooper_step=100))}
    assert early["train_step_megatron-local"] == 120  # 140 s left at 335 s
    assert early["train_step_megatron-te"] is None and early["train_step_transformers"] is None  # 110 s left


def _cooper(tmp_path, rc, results):
    gpu_check = _gpu_check()
    step = gpu_check.Step("cooper_step", ["true"], 480, output=tmp_path / "cooper_step.json")
    step.rc = rc
    step.output.unlink(missing_ok=True)
    if results is not None:
        step.output.write_text(json.dumps({"results": results}))
    return step


def _engine(diff, kl):
    return {"engine": {"rollout/logprob_diff_mean": diff, "rollout/logprob_diff_max": 9.0, "rollout/logprob_kl": kl}}


def test_the_mismatch_gate_fails_above_either_bound_or_when_nothing_was_measured(tmp_path):
    gpu_check = _gpu_check()
    gate = gpu_check.mismatch_gate
    ok = gate(_cooper(tmp_path, 0, {"no-offload": _engine(0.02, 0.001), "offload": _engine(0.1, 0.01)}))
    assert ok.ok and "no-offload logprob_diff_mean 0.02" in ok.detail, ok  # the bounds themselves pass
    mean = gate(_cooper(tmp_path, 0, {"no-offload": _engine(0.02, 0.001), "offload": _engine(0.1001, 0.001)}))
    assert not mean.ok and mean.detail.startswith("offload rollout/logprob_diff_mean 0.1 > 0.1"), mean
    kl = gate(_cooper(tmp_path, 0, {"no-offload": _engine(0.05, 0.02)}))
    assert not kl.ok and "no-offload rollout/logprob_kl 0.02 > 0.01" in kl.detail, kl
    nan = gate(_cooper(tmp_path, 0, {"no-offload": _engine(float("nan"), 0.001)}))
    assert not nan.ok and "nan > 0.1" in nan.detail
    # killed in its second setting: the first one's figures are judged
    cut = gate(_cooper(tmp_path, 124, {"no-offload": _engine(0.03, 0.002)}))
    assert cut.ok, cut
    for step, why in ((_cooper(tmp_path, 124, None), "finished no setting"),
                      (_cooper(tmp_path, 0, {"no-offload": {"engine": {}}}), "finished no setting"),
                      (_cooper(tmp_path, None, None), "was not reached")):
        g = gate(step)
        assert not g.ok and g.detail.startswith("not measured") and why in g.detail, g
    assert set(gpu_check.MISMATCH_BOUNDS) == {MetricKey.LOGPROB_DIFF_MEAN, MetricKey.LOGPROB_KL}


def test_the_exit_code_follows_the_required_steps_and_the_gates(tmp_path):
    gpu_check = _gpu_check()
    Step, Gate = gpu_check.Step, gpu_check.Gate

    def step(rc, optional=False):
        s = Step("s", ["true"], 10, optional=optional)
        s.rc = rc
        return s

    passed, held, broken = step(0), Gate("g", True, ""), Gate("g", False, "")
    assert gpu_check.exit_code([passed, step(None, optional=True)], (held,)) == 0
    assert gpu_check.exit_code([passed, step(None)], (held,)) == 1  # a required step without time
    assert gpu_check.exit_code([passed, step(1, optional=True)], (held,)) == 1  # an optional step that failed
    assert gpu_check.exit_code([passed], (broken,)) == 1
    assert gpu_check.exit_code([passed], ()) == 0
    report = gpu_check.report(tmp_path, {}, [passed], (broken,))
    assert "| g | FAIL |" in report


def test_a_step_never_reads_the_json_of_an_earlier_run(tmp_path):
    gpu_check = _gpu_check()
    stale = tmp_path / "cooper_step.json"
    stale.write_text(json.dumps({"results": {"no-offload": _engine(0.01, 0.001)}}))
    step = gpu_check.run_step(gpu_check.Step("cooper_step", [sys.executable, "-c", "raise SystemExit(3)"], 60,
                                             output=stale), tmp_path)
    assert step.rc == 3 and not stale.exists()
    assert not gpu_check.mismatch_gate(step).ok


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
