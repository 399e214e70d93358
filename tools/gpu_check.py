"""``make gpu-check``: the checks a GPU machine gets, in one run, with one markdown report.

A GPU is lent for minutes, so the run is bounded (``--budget-s``, 8 minutes by default) and ordered
by what it tells, most first; ``<out>/report.md`` is rewritten after every step, so a run cut short
keeps what it measured. Each step runs in its own process group with a time limit (the rest of the
budget at most):

1. the ``gpu``-marked tests (``tests/gpu``, and ``tests/sglang/test_gpu.py`` when sglang imports):
   2 min 10 s on an H200 (2026-11-26), the most informative minutes;
2. ``benchmarks/train_step.py``: tokens/s, MFU and peak memory of a Qwen2.5-1.5B-shaped policy
   step (bf16, sequence 4096) with megatron-core and with plain transformers, each in a fresh
   process;
3. ``benchmarks/cooper_step.py`` (not with ``--quick``): one full Cooper step, time and peak memory
   per phase, with and without offload, next to ``cooper plan``;
4. the rehearsal of ``examples/qwen2.5-1.5b_8xh100.yaml`` at its real model shape on one GPU
   (``cooper rehearse --real-shape``: random weights, TP=1, the transformers engine where SGLang is
   absent, 3 steps): per-phase time and peak memory next to ``cooper plan``'s prediction. Last,
   because building its real-shape assets alone took 3 minutes of the budget on an H200's host
   (2026-11-26) and the run did not finish in the 6 minutes it had.

The report holds the device, driver, versions, every figure, and every failure with the end of its
log; raw logs and JSON lie beside it. Steps that fail are reported and the run goes on; a step the
budget has no time left for is reported as skipped. The exit code is 0 only when every step passed.

It needs torch and transformers (a GPU image has them) and these small wheels, which install
offline (``pip install --no-index --find-links DIR``; ``make gpu-wheels`` downloads them on a
machine with network): megatron-core 0.16.1, math-verify 0.9.0, latex2sympy2_extended 1.11.0,
antlr4-python3-runtime 4.13.2, omegaconf 2.4.0, plus pytest and psutil if missing. Without a GPU it
exits 1 with one line that says so.

    python tools/gpu_check.py [--out runs/gpu_check] [--quick] [--budget-s 480]
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("gpu_check")


@dataclass
class Step:
    """One check: its command, time limit and what it produced."""

    name: str
    cmd: list[str]
    timeout_s: int
    cwd: Path = ROOT
    rc: Optional[int] = None
    seconds: float = 0.0
    log: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def result(self) -> str:
        if self.rc is None:
            return "skipped (budget)"
        return "pass" if self.ok else f"FAIL (rc {self.rc})"


#: the real-SGLang tier's GPU tests (marked ``gpu`` only: ``make test-sglang`` must not select them)
SGLANG_GPU_TESTS = ["-m", "gpu", "tests/sglang/test_gpu.py"]
#: the preset rehearsed at its real shape first (the tiny one with --allow-cpu)
REHEARSED_PRESET = "examples/qwen2.5-1.5b_8xh100.yaml"
MARGIN_S = 5  # left for writing the report after the last step


def run_step(step: Step, out: Path, deadline: Optional[float] = None) -> Step:
    """Run ``step`` (output to ``<out>/<name>.log``) within its limit and the ``deadline``
    (``time.monotonic()``); a step past either is killed with everything it started. Never raises."""
    log_path = out / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
                   "PYTHONPATH")])))
    limit = step.timeout_s if deadline is None else min(step.timeout_s, deadline - time.monotonic() - MARGIN_S)
    if limit <= 0:
        step.rc, step.log = None, "[gpu_check] skipped: no time left in the budget"
        log_path.write_text(step.log)
        logger.info("%s: skipped (budget)", step.name)
        return step
    t0 = time.perf_counter()
    logger.info("%s: %s (limit %.0f s)", step.name, " ".join(step.cmd), limit)
    with open(log_path, "w") as log:
        # a process group of its own: a step past its limit is killed with its children (torchrun's ranks)
        proc = subprocess.Popen(step.cmd, cwd=step.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            step.rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            step.rc = 124
            log.write(f"\n[gpu_check] timed out after {limit:.0f} s\n")
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


def plan_comparison(measured: dict[str, Any], gpu_gib: float, out: Path) -> tuple[Step, list[str]]:
    """``cooper plan`` for the Cooper-step benchmark's own settings, next to its measured peaks."""
    rows = []
    steps = []
    for variant, res in measured.get("results", {}).items():
        step = run_step(Step(f"plan_{variant}", [sys.executable, "-m", "cooper_mcore", "plan", "--config",
                                                 str(ROOT / "examples" / "tiny_cpu.yaml"), "--gpus-per-node", "1",
                                                 "--gpu-memory-gib", f"{gpu_gib:.2f}", "--json",
                                                 *res.get("config_overrides", [])], 300), out)
        steps.append(step)
        doc = {}
        if step.ok:
            try:
                doc = json.loads(step.log[step.log.index("{"):step.log.rindex("}") + 1])
            except ValueError:
                doc = {}
        predicted = {p["phase"]: p["total_gib"] for p in doc.get("as_configured", {}).get("phases", [])}
        for phase, peak in res.get("peaks", {}).items():
            got = peak / 2**30
            want = predicted.get(phase)
            ratio = f"{got / want:.2f}" if want else "-"
            rows.append(f"| {variant} | {phase} | {got:.2f} | {want if want is not None else '-'} | {ratio} |")
    ok = Step("plan", [], 0, rc=0 if steps and all(s.ok for s in steps) else 1)
    return ok, rows


def rehearsal_rows(out: Path) -> list[str]:
    """The real-shape rehearsal's per-phase table, from its report.json."""
    doc = _json(out / "rehearsal" / "report.json")

    def cell(v: Optional[float]) -> str:
        return f"{v:.2f}" if v is not None else "-"

    rows = [f"| {m['phase']} | {cell(m['seconds'])} | {cell(m['peak_gib'])} | {cell(m['planned_gib'])} |"
            for m in doc.get("phases", [])]
    if not rows:
        return []
    return [f"{doc.get('verdict', '')}; {doc.get('layout', '')}; {doc.get('features', '')}", "",
            "| phase | seconds (step 3) | peak GiB (max_memory_allocated) | cooper plan GiB |", "|---|---|---|---|",
            *rows]


def report(out: Path, info: dict[str, str], steps: list[Step], plan_rows: list[str]) -> str:
    lines = [f"# gpu-check report ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "## Steps", "", "| step | result | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.result} | {s.seconds:.0f} |" for s in steps]
    rehearsal = rehearsal_rows(out)
    if rehearsal:
        lines += ["", f"## {REHEARSED_PRESET} rehearsed at its real shape", "", *rehearsal]
    for s in steps:
        if s.name.startswith(("train_step", "cooper_step")) and s.ok:
            table = [ln for ln in s.log.splitlines() if ln.startswith("|") or ln.startswith(("shape ", "one Cooper"))]
            lines += ["", f"## {s.name}", "", *table]
    if plan_rows:
        lines += ["", "## cooper plan vs measured (GiB per GPU, torch.cuda.max_memory_allocated per phase)", "",
                  "Measured is what torch allocated; the plan also counts CUDA contexts, NCCL and fragmentation.",
                  "", "| setting | phase | measured | planned | measured / planned |", "|---|---|---|---|---|",
                  *plan_rows]
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
    p.add_argument("--quick", action="store_true", help="the rehearsal, the tests and the train-step benchmark")
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
    plan_rows: list[str] = []

    def do(step: Step) -> Step:
        steps.append(run_step(step, out, deadline))
        report(out, info, steps, plan_rows)  # after every step: a run cut short keeps what it measured
        return steps[-1]

    for step in plan_steps(sys.executable, tiny, args.quick, out):
        done = do(step)
        if done.name == "cooper_step" and done.ok:
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if not tiny else 24.0
            plan_step, plan_rows = plan_comparison(_json(out / "cooper_step.json"), memory, out)
            steps.append(plan_step)
    for variant in ("megatron-te",):  # a variant whose benchmark found nothing to run here (no TE) is not a step
        name = f"train_step_{variant}"
        if any(s.name == name and s.ok for s in steps) and not _json(out / f"{name}.json").get("rows"):
            logger.info("%s: not available on this machine", variant)
            steps[:] = [s for s in steps if s.name != name]
    text = report(out, info, steps, plan_rows)
    print(text)
    print(f"report: {out / 'report.md'}")
    return 0 if all(s.ok for s in steps) else 1


def plan_steps(py: str, tiny: bool, quick: bool, out: Path) -> list[Step]:
    """The steps, most informative first (see the module doc)."""
    bench = ROOT / "benchmarks"
    preset = ROOT / ("examples/tiny_cpu.yaml" if tiny else REHEARSED_PRESET)
    steps = [Step("gpu_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"], 240)]
    try:
        import sglang  # noqa: F401  (optional)

        steps.append(Step("sglang_gpu_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                               *SGLANG_GPU_TESTS], 180))
    except ImportError:
        logger.info("sglang is not installed: its GPU tests are not run")
    shape = ["--tiny"] if tiny else []
    variants = ("megatron-local", "megatron-te", "transformers")
    for variant in variants:
        skip = ",".join(v for v in variants if v != variant)
        js = out / f"train_step_{variant}.json"
        steps.append(Step(f"train_step_{variant}", [py, "train_step.py", *shape, "--steps", "3", "--warmup", "1",
                                                    "--skip", skip, "--json", str(js)], 150, cwd=bench))
    if not quick:
        steps.append(Step("cooper_step", [py, "cooper_step.py", *shape, "--steps", "2", "--json",
                                          str(out / "cooper_step.json")], 300, cwd=bench))
    steps.append(Step("rehearsal", [py, "-m", "cooper_mcore", "rehearse", "--config", str(preset), "--real-shape",
                                    "--out", str(out / "rehearsal")], 360))
    return steps


if __name__ == "__main__":
    sys.exit(main())
