"""``make gpu-check``: the checks a GPU machine gets, in one run, with one markdown report.

Runs, each in its own process with a time limit, on a machine with one or more CUDA GPUs and no
network access:

1. the ``gpu``-marked tests (``pytest -m gpu tests/gpu``, and the real-SGLang tier's GPU tests when
   sglang imports);
2. ``benchmarks/train_step.py``: tokens/s, MFU and peak memory of a Qwen2.5-1.5B-shaped policy
   step (bf16, sequence 4096) with megatron-core and with plain transformers, each in a fresh
   process;
3. ``benchmarks/cooper_step.py``: one full Cooper step (1.5B-shaped policy and RM, transformers
   engine), time and peak memory per phase, with and without offload;
4. ``cooper plan``'s prediction of the same Cooper step's per-phase peaks, next to the measured ones;

and writes ``<out>/report.md`` (device, driver, versions, every figure, every failure with the end
of its log) plus the raw logs and JSON beside it. Steps that fail are reported and the run goes on;
the exit code is 0 only when every step passed.

It needs torch and transformers (a GPU image has them) and these small wheels, which install
offline (``pip install --no-index --find-links DIR``; ``make gpu-wheels`` downloads them on a
machine with network): megatron-core 0.16.1, math-verify 0.9.0, latex2sympy2_extended 1.11.0,
antlr4-python3-runtime 4.13.2, omegaconf 2.4.0, plus pytest and psutil if missing. Without a GPU it
exits 1 with one line that says so.

    python tools/gpu_check.py [--out runs/gpu_check] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
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


def run_step(step: Step, out: Path) -> Step:
    """Run ``step`` (output to ``<out>/<name>.log``); never raises."""
    log_path = out / f"{step.name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               WANDB_MODE="disabled", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
                   "PYTHONPATH")])))
    t0 = time.perf_counter()
    logger.info("%s: %s", step.name, " ".join(step.cmd))
    try:
        r = subprocess.run(step.cmd, cwd=step.cwd, env=env, capture_output=True, text=True, timeout=step.timeout_s)
        step.rc, step.log = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        step.rc = 124
        step.log = f"{(e.stdout or b'').decode(errors='replace') if isinstance(e.stdout, bytes) else e.stdout or ''}" \
                   f"\n[gpu_check] timed out after {step.timeout_s} s"
    step.seconds = time.perf_counter() - t0
    log_path.write_text(step.log)
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
    for name in ("transformers", "megatron.core", "transformer_engine", "sglang", "math_verify"):
        try:
            mod = __import__(name, fromlist=["__version__"])
            out[name] = getattr(mod, "__version__", "?")
        except ImportError:
            out[name] = "not installed"
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


def report(out: Path, info: dict[str, str], steps: list[Step], plan_rows: list[str]) -> str:
    lines = [f"# gpu-check report ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info.items()]
    lines += ["", "## Steps", "", "| step | result | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {'pass' if s.ok else f'FAIL (rc {s.rc})'} | {s.seconds:.0f} |" for s in steps]
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
        if not s.ok:
            tail = "\n".join(s.log.strip().splitlines()[-40:])
            lines += ["", f"## {s.name} failed (last lines of {s.name}.log)", "", "```", tail, "```"]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="the GPU checks in one run, with one report")
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"), help="report folder")
    p.add_argument("--quick", action="store_true", help="the tests and the train-step benchmark only")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)  # tests: the tiny shapes on CPU
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    bench = ROOT / "benchmarks"
    steps = [run_step(Step("gpu_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                          "tests/gpu"], 900), out)]
    try:
        import sglang  # noqa: F401  (optional)

        steps.append(run_step(Step("sglang_gpu_tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                                                        "gpu and sglang", "tests/sglang"], 900), out))
    except ImportError:
        logger.info("sglang is not installed: its GPU tests are not run")
    shape = ["--tiny"] if tiny else []
    for variant in ("megatron-local", "megatron-te", "transformers"):
        skip = ",".join(v for v in ("megatron-local", "megatron-te", "transformers") if v != variant)
        js = out / f"train_step_{variant}.json"
        step = run_step(Step(f"train_step_{variant}", [py, "train_step.py", *shape, "--steps", "3", "--warmup", "1",
                                                        "--skip", skip, "--json", str(js)], 600, cwd=bench), out)
        if step.ok and not _json(js).get("rows"):  # the variant is not available here (TE)
            logger.info("%s: not available on this machine", variant)
            continue
        steps.append(step)
    plan_rows: list[str] = []
    if not args.quick:
        js = out / "cooper_step.json"
        step = run_step(Step("cooper_step", [py, "cooper_step.py", *shape, "--steps", "2", "--json", str(js)], 1200,
                             cwd=bench), out)
        steps.append(step)
        if step.ok:
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if not tiny else 24.0
            plan_step, plan_rows = plan_comparison(_json(js), memory, out)
            steps.append(plan_step)
    info = versions() if not tiny else {"device": "CPU (--allow-cpu: tiny shapes, a test of this script)"}
    text = report(out, info, steps, plan_rows)
    print(text)
    print(f"report: {out / 'report.md'}")
    return 0 if all(s.ok for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
