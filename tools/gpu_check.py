"""``make gpu-check``: the checks a GPU machine gets, in one run, with one markdown report.

A GPU is lent for minutes, so the run is bounded (``--budget-s``, 8 minutes by default) and ordered
by what it tells, most first; ``<out>/report.md`` is rewritten after every step, so a run cut short
keeps what it measured. Each step runs in its own process group with a time slice (the rest of the
budget at most); a step past it is killed with every process it started, torchrun's ranks included
(:class:`ProcessTree`: they run in sessions of their own), so none keeps GPU memory from the next:

1. the ``gpu``-marked tests (``tests/gpu``; 240 s), the most informative minutes: 12 tests; on an
   H200 (2026-11-27) the 5 of then took 2 min 3 s and the 2 MoE forward tests 21 s, the others are
   seconds each (about 175 s expected);
2. ``benchmarks/moe_step.py --gpu --settings 1x1`` (not with ``--quick``; 150 s): the first
   mixture-of-experts training steps on a GPU, at Qwen3-30B-A3B's layer shape, with the grouped
   experts (``torch._grouped_mm`` where it is known correct), then megatron's ``SequentialMLP``, each
   in its own process, the table printed after each;
3. ``benchmarks/cooper_step.py`` (not with ``--quick``; the rest of the budget): one full Cooper step
   at the Qwen2.5-1.5B shape with random weights built on the GPU, without and with offload, each in
   a fresh process, at the largest micro-batch ``cooper plan`` fits: per phase seconds, peak memory
   and the plan, and the bf16 rollout engine's log-probabilities against the trainer's;
4. ``tests/sglang/test_gpu.py`` when sglang imports (180 s; not on the lent machines' image);
5. budget permitting (each only when its whole 120 s slice is left; skipping them does not fail the
   run): ``benchmarks/train_step.py`` per variant, measured on an H100 and an H200 already.

**The mismatch gate.** The run fails when the engine's bf16 log-probabilities are further from the
trainer's than peers let their GPU CI pass (:data:`MISMATCH_BOUNDS`: mean ``|engine - trainer|`` per
response token at most 0.1 nats, as slime's CI asserts, and the k3 KL(engine || trainer) at most 0.01,
as prime-rl's checks): read from the Cooper-step benchmark's ``rollout/logprob_*`` of every setting it
finished; not measured (the benchmark failed before its first setting, or was not reached) fails too.

The report holds the device, driver, versions, every figure, the gate, and every failure with the
end of its log; raw logs and JSON lie beside it. Steps that fail are reported and the run goes on. The
exit code is 0 only when every step that had to run passed and the gate held (``--quick``: no gate).

It needs torch and transformers (a GPU image has them) and these small wheels, which install
offline (``pip install --no-index --find-links DIR``; ``make gpu-wheels`` downloads them on a
machine with network): megatron-core 0.16.1, math-verify 0.9.0, latex2sympy2_extended 1.11.0,
antlr4-python3-runtime 4.13.2, omegaconf 2.4.0, plus pytest and psutil if missing. Without a GPU it
exits 1 with one line that says so.

    python tools/gpu_check.py [--out runs/gpu_check] [--quick] [--budget-s 480]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("gpu_check")


@dataclass
class Step:
    """One check: its command, time limit and what it produced."""

    name: str
    cmd: list[str]
    timeout_s: float
    """Its time slice: the longest it may run (less when less of the budget is left)."""
    cwd: Path = ROOT
    optional: bool = False
    """Budget permitting: it runs only when its whole slice is left, and skipping it fails nothing."""
    output: Optional[Path] = None
    """The JSON it writes, removed before it starts: a stale one of an earlier run is never read."""
    rc: Optional[int] = None
    seconds: float = 0.0
    log: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def passed(self) -> bool:
        """Whether it leaves the run's exit code at 0: it passed, or it was optional and skipped."""
        return self.ok or (self.optional and self.rc is None)

    @property
    def result(self) -> str:
        if self.rc is None:
            return "skipped (budget)" + (", optional" if self.optional else "")
        return "pass" if self.ok else f"FAIL (rc {self.rc})"


def time_limit(step: Step, left_s: float) -> Optional[float]:
    """The seconds ``step`` may run with ``left_s`` of the budget left (after the report's margin), or
    None when it is not started: nothing left, or an optional step whose whole slice is not left."""
    if left_s <= 0 or (step.optional and left_s < step.timeout_s):
        return None
    return min(step.timeout_s, left_s)


#: the real-SGLang tier's GPU tests (marked ``gpu`` only: ``make test-sglang`` must not select them)
SGLANG_GPU_TESTS = ["-m", "gpu", "tests/sglang/test_gpu.py"]
MARGIN_S = 5  # left for writing the report after the last step


#: set in a step's environment to a token of its own: every process the step starts inherits it
STEP_ENV = "COOPER_GPU_CHECK_STEP"


class ProcessTree:
    """A step's process and every process it starts.

    torchrun starts each rank in a session (and process group) of its own, so killing the step's
    process group leaves the ranks running, holding their GPU memory through the steps after; and a
    process whose parent exited is re-parented, no longer a descendant. So the tree is sampled while
    the step runs, and at the end every process seen in it or carrying the step's token in its
    environment (:data:`STEP_ENV`) is killed by pid (psutil refuses a pid that was reused).
    """

    def __init__(self, proc: subprocess.Popen, token: str) -> None:
        self.proc = proc
        self.token = token
        self.seen: dict[int, psutil.Process] = {}
        self._sample()

    def _sample(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.Error:  # the step has exited: its descendants seen so far are remembered
            return
        for p in family:
            self.seen.setdefault(p.pid, p)

    def _marked(self) -> list[psutil.Process]:
        """This user's processes whose environment carries the step's token."""
        out = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):  # gone, or another user's
                if p.pid != os.getpid() and p.environ().get(STEP_ENV) == self.token:
                    out.append(p)
        return out

    def wait(self, timeout_s: float, poll_s: float = 0.5) -> Optional[int]:
        """The step's exit code, or None when it is still running after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while True:
            self._sample()
            try:
                return self.proc.wait(timeout=max(0.0, min(poll_s, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= end:
                    return None

    def kill(self) -> list[int]:
        """SIGKILL the step's process group and every process of the step still running; returns
        the pids killed that were running."""
        self._sample()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in self._marked():
            self.seen.setdefault(p.pid, p)
        killed = []
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):  # gone already, or its pid reused by another process
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
                    killed.append(p.pid)
        self.proc.wait()
        return killed


def run_step(step: Step, out: Path, deadline: Optional[float] = None) -> Step:
    """Run ``step`` (output to ``<out>/<name>.log``) within its limit and the ``deadline``
    (``time.monotonic()``); a step past either is killed with every process it started
    (:class:`ProcessTree`), and so is anything it leaves running when it exits. Never raises."""
    log_path = out / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
                   "PYTHONPATH")])))
    limit = time_limit(step, step.timeout_s if deadline is None else deadline - time.monotonic() - MARGIN_S)
    if limit is None:
        step.rc, step.log = None, "[gpu_check] skipped: no time left in the budget"
        log_path.write_text(step.log)
        logger.info("%s: skipped (budget)", step.name)
        return step
    if step.output is not None:
        step.output.unlink(missing_ok=True)
    t0 = time.perf_counter()
    logger.info("%s: %s (limit %.0f s)", step.name, " ".join(step.cmd), limit)
    token = f"{os.getpid()}-{step.name}-{time.time_ns()}"
    env[STEP_ENV] = token
    with open(log_path, "w") as log:
        proc = subprocess.Popen(step.cmd, cwd=step.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        tree = ProcessTree(proc, token)
        step.rc = tree.wait(limit)
        killed = tree.kill()  # after a clean exit too: a rank left behind keeps its GPU memory
        if step.rc is None:
            step.rc = 124
            log.write(f"\n[gpu_check] timed out after {limit:.0f} s; killed {len(killed)} process(es)\n")
        elif killed:
            log.write(f"\n[gpu_check] the step left {len(killed)} process(es) running: killed\n")
    step.seconds = time.perf_counter() - t0
    step.log = log_path.read_text(errors="replace")
    logger.info("%s: rc=%s in %.0f s", step.name, step.rc, step.seconds)
    return step


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def versions() -> dict[str, str]:
    """Device, driver and package versions."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name, dist in (("transformers", "transformers"), ("megatron.core", "megatron-core"),
                       ("transformer_engine", "transformer-engine"), ("sglang", "sglang"),
                       ("math_verify", "math-verify")):
        try:
            __import__(name)
            out[name] = importlib.metadata.version(dist)
        except ImportError:
            out[name] = "not installed"
        except importlib.metadata.PackageNotFoundError:  # importable but not installed as a distribution
            out[name] = "?"
    out["devices"] = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    out["memory_gib"] = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.2f}"
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        out["driver"] = "unknown"
    return out


#: the benchmarks whose printed tables go into the report
TABLE_STEPS = ("train_step", "cooper_step", "moe_step")


def _last_table(log: str) -> list[str]:
    """The last report a benchmark printed (the Cooper-step benchmark prints one after each setting)."""
    lines = log.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith(("shape ", "one Cooper"))]
    tail = lines[starts[-1]:] if starts else lines
    return [ln for ln in tail if ln.startswith(("|", "- ", "shape ", "one Cooper", "  "))]


#: the engine-against-trainer figures the Cooper-step benchmark reports per setting (the metrics
#: ``rollout/logprob_diff_mean`` and ``rollout/logprob_kl``, docs/metrics.md) and the bound above which
#: the run fails: mean |engine - trainer| log-probability per response token, nats (slime's CI asserts
#: its ``train_rollout_logprob_abs_diff`` <= 0.1); the k3 estimate of KL(engine || trainer) (prime-rl
#: keeps its mismatch KL under 0.01). docs/testing.md says why these.
MISMATCH_BOUNDS = {"rollout/logprob_diff_mean": 0.1, "rollout/logprob_kl": 0.01}
MISMATCH_GATE = "bf16 engine-trainer log-prob mismatch"


@dataclass
class Gate:
    """A condition on what the steps measured that the run's exit code follows."""

    name: str
    ok: bool
    detail: str


def mismatch_gate(cooper: Step) -> Gate:
    """:data:`MISMATCH_BOUNDS` held against every setting of the Cooper-step benchmark's JSON
    (``cooper.output``) that has the engine's figures; a run with none fails (not measured)."""
    results = _json(cooper.output).get("results", {}) if cooper.output is not None else {}
    measured = {variant: r.get("engine") or {} for variant, r in results.items()}
    measured = {variant: m for variant, m in measured.items() if all(k in m for k in MISMATCH_BOUNDS)}
    if not measured:
        why = ("the Cooper-step benchmark was not reached" if cooper.rc is None else
               f"the Cooper-step benchmark ({cooper.result}) finished no setting with the engine's log-probabilities")
        return Gate(MISMATCH_GATE, False, f"not measured: {why}")
    figures, over = [], []
    for variant, m in measured.items():
        for key, bound in MISMATCH_BOUNDS.items():
            value = float(m[key])
            figures.append(f"{variant} {key.split('/')[-1]} {value:.3g}")
            if not value <= bound:  # NaN too
                over.append(f"{variant} {key} {value:.3g} > {bound}")
    bounds = ", ".join(f"{k.split('/')[-1]} <= {b}" for k, b in MISMATCH_BOUNDS.items())
    return Gate(MISMATCH_GATE, not over, ("; ".join(over) if over else ", ".join(figures)) + f" (bounds: {bounds})")


def report(out: Path, info: dict[str, str], steps: list[Step], gates: tuple[Gate, ...] = ()) -> str:
    lines = [f"# gpu-check report ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "## Steps", "", "| step | result | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.result} | {s.seconds:.0f} |" for s in steps]
    if gates:
        lines += ["", "## Gates", "", "| gate | result | figures |", "|---|---|---|"]
        lines += [f"| {g.name} | {'pass' if g.ok else 'FAIL'} | {g.detail} |" for g in gates]
    for s in steps:
        if s.name.startswith(TABLE_STEPS) and s.rc is not None:
            table = _last_table(s.log)
            if table:
                lines += ["", f"## {s.name}" + ("" if s.ok else f" (its last report before {s.result})"), "", *table]
    for s in steps:
        if not s.ok and s.rc is not None:
            tail = "\n".join(s.log.strip().splitlines()[-40:])
            lines += ["", f"## {s.name} failed (last lines of {s.name}.log)", "", "```", tail, "```"]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="the GPU checks in one run, with one report")
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"), help="report folder")
    p.add_argument("--quick", action="store_true", help="the tests and the MoE step only (no mismatch gate)")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run (default 480)")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: the tiny shapes on CPU
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    deadline = time.monotonic() + args.budget_s
    try:
        import torch
    except ImportError as e:
        print(f"gpu-check: torch is not importable with {sys.executable} ({e}); use the GPU image's python",
              file=sys.stderr)
        return 1
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu-check: no CUDA GPU on this machine (torch.cuda.is_available() is False); run it on a GPU node",
              file=sys.stderr)
        return 1
    tiny = not torch.cuda.is_available()
    out = Path(args.out).resolve()  # steps run in other folders (benchmarks/)
    out.mkdir(parents=True, exist_ok=True)
    info = versions() if not tiny else {"device": "CPU (--allow-cpu: tiny shapes, a test of this script)"}
    steps: list[Step] = []
    for step in plan_steps(sys.executable, tiny, args.quick, out, args.budget_s):
        steps.append(run_step(step, out, deadline))
        report(out, info, steps)  # after every step: a run cut short keeps what it measured
    for variant in ("megatron-te",):  # a variant whose benchmark found nothing to run here (no TE) is not a step
        name = f"train_step_{variant}"
        if any(s.name == name and s.ok for s in steps) and not _json(out / f"{name}.json").get("rows"):
            logger.info("%s: not available on this machine", variant)
            steps[:] = [s for s in steps if s.name != name]
    gates = tuple(mismatch_gate(s) for s in steps if s.name == "cooper_step")
    text = report(out, info, steps, gates)
    print(text)
    print(f"report: {out / 'report.md'}")
    return exit_code(steps, gates)


def exit_code(steps: list[Step], gates: tuple[Gate, ...]) -> int:
    """0 when every step that had to run passed and every gate held, else 1."""
    return 0 if all(s.passed for s in steps) and all(g.ok for g in gates) else 1


#: each step's time slice, seconds (the H200 timings behind them: the module doc)
SLICES = {"gpu_tests": 240, "moe_step": 150, "sglang_gpu_tests": 180, "train_step": 120}


def plan_steps(py: str, tiny: bool, quick: bool, out: Path, budget_s: float = 480.0) -> list[Step]:
    """The steps in the order they run (see the module doc); ``tiny``: the CPU shapes (a test of this
    script); the Cooper-step benchmark's slice is what the budget leaves."""
    bench = ROOT / "benchmarks"
    steps = [Step("gpu_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"],
                  SLICES["gpu_tests"])]
    # the tiny shapes (a test of this script) time the grouped experts only, in one step
    moe = (["--settings", "1x1", "--steps", "1", "--warmup", "0", "--experts", "grouped"] if tiny
           else ["--gpu", "--settings", "1x1"])
    steps.append(Step("moe_step", [py, "moe_step.py", *moe], SLICES["moe_step"], cwd=bench))
    if not quick:
        js = out / "cooper_step.json"
        steps.append(Step("cooper_step", [py, "cooper_step.py", *(["--tiny"] if tiny else []), "--steps", "2",
                                          "--json", str(js)], budget_s, cwd=bench, output=js))
    try:
        import sglang  # noqa: F401  (optional)

        steps.append(Step("sglang_gpu_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SGLANG_GPU_TESTS],
                          SLICES["sglang_gpu_tests"]))
    except ImportError:
        logger.info("sglang is not installed: its GPU tests are not run")
    if quick:
        return steps
    variants = ("megatron-local", "megatron-te", "transformers")
    for variant in variants:
        skip = ",".join(v for v in variants if v != variant)
        js = out / f"train_step_{variant}.json"
        steps.append(Step(f"train_step_{variant}", [py, "train_step.py", *(["--tiny"] if tiny else []), "--steps",
                                                    "3", "--warmup", "1", "--skip", skip, "--json", str(js)],
                          SLICES["train_step"], cwd=bench, optional=True, output=js))
    return steps


if __name__ == "__main__":
    sys.exit(main())
