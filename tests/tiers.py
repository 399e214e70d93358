"""Run the test tiers one after another and print what each took: ``make test`` and ``.ci/run`` call this.

    python tests/tiers.py [TIER ...] [--out runs/ci] [--python PY]   run tiers (default: the core ones)
    python tests/tiers.py --table [--out runs/ci]                     print the table of what ran

Each tier is one pytest run over its folder (with its own options, e.g. parallel workers) that
writes ``<out>/<tier>.xml`` (JUnit) and ``<out>/<tier>.json`` (tests, failures, seconds). Every
tier runs even when an earlier one failed, so one run shows every failure; the exit status is 1
when any failed. The table lists the tiers found in ``<out>``, CI's install steps included
(``.ci/run`` records them with ``--record``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Tier:
    """One tier: the folder(s) pytest runs and the options it runs them with."""

    name: str
    paths: tuple[str, ...]
    options: tuple[str, ...] = ()
    doc: str = ""


#: The core tiers of ``make test``, in the order they run; ``sglang`` is ``make test-sglang``'s.
TIERS = {t.name: t for t in (
    Tier("unit", ("tests/unit",), ("-n", "2", "--dist", "loadfile"),
         "pure functions, one-process trainer pieces, configs, CLI (two pytest workers)"),
    Tier("badinput", ("tests/badinput",), (),
         "every bad input a user met, through the CLI: one clear line, nothing lost (one process: a second "
         "worker's imports cost more than it saves)"),
    Tier("multiproc", ("tests/multiproc",), ("-n", "2", "--dist", "loadfile"),
         "torchrun + gloo: TP/PP/DP/EP against one process, faults, launch (two pytest workers)"),
    Tier("packaging", ("tests/packaging",), (), "the wheel built from a clean checkout, installed and run"),
    Tier("rehearsal", ("tests/rehearsal",), ("-n", "2", "--dist", "load"),
         "cooper rehearse of every preset and the run matrix (two pytest workers)"),
    Tier("gpu", ("tests/gpu",), (), "CUDA only: skipped without a GPU"),
    Tier("sglang", ("tests/sglang",), ("-m", "sglang", "-n", "2", "--dist", "loadfile"),
         "the real SGLang 0.5.23 on its CPU backend (two pytest workers: the rehearsal beside the rest)"),
)}
CORE = ("unit", "badinput", "multiproc", "packaging", "rehearsal", "gpu")


@dataclass
class TierResult:
    """What one tier did."""

    name: str
    seconds: float
    started: float = 0.0
    """When it started (seconds since the epoch): the table's order."""
    tests: int = 0
    failed: int = 0
    skipped: int = 0
    rc: int = 0
    notes: list[str] = field(default_factory=list)


def junit_counts(path: Path) -> tuple[int, int, int]:
    """(tests, failures + errors, skipped) of a JUnit file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    get = lambda s, k: int(s.get(k, 0))  # noqa: E731
    return (sum(get(s, "tests") for s in suites), sum(get(s, "failures") + get(s, "errors") for s in suites),
            sum(get(s, "skipped") for s in suites))


def run_tier(tier: Tier, out: Path, python: str, extra: list[str]) -> TierResult:
    """Run one tier's pytest; record its result in ``<out>/<tier>.json``."""
    xml = out / f"{tier.name}.xml"
    xml.unlink(missing_ok=True)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tier.options, *tier.paths,
           f"--junitxml={xml}", *extra]
    print(f"== tier {tier.name}: {' '.join(cmd[1:])}", flush=True)
    started, t0 = time.time(), time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT)
    result = TierResult(tier.name, round(time.monotonic() - t0, 1), started, rc=rc)
    if xml.exists():
        result.tests, result.failed, result.skipped = junit_counts(xml)
    elif rc:
        result.notes.append("no JUnit file: pytest did not run to its end")
    if rc == 5:  # pytest: no tests collected
        result.rc = 0
    record(out, result)
    return result


def record(out: Path, result: TierResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result.name}.json").write_text(json.dumps(asdict(result)) + "\n")


def table(out: Path) -> str:
    """The table of every tier recorded in ``out``, in the order they started, with the wall time from the
    first start to the last end (steps that overlap, such as the SGLang install, count once)."""
    rows = sorted((json.loads(p.read_text()) for p in out.glob("*.json")), key=lambda r: r.get("started", 0))
    lines = [f"{'tier':<16} {'tests':>6} {'failed':>6} {'skipped':>7} {'seconds':>8}", "-" * 48]
    for r in rows:
        lines.append(f"{r['name']:<16} {r['tests']:>6} {r['failed']:>6} {r['skipped']:>7} {r['seconds']:>8.0f}"
                     + (f"  ({'; '.join(r['notes'])})" if r.get("notes") else ""))
    wall = max((r["started"] + r["seconds"] for r in rows), default=0) - min((r["started"] for r in rows), default=0)
    lines += ["-" * 48, f"{'total (wall)':<16} {sum(r['tests'] for r in rows):>6} {sum(r['failed'] for r in rows):>6} "
              f"{sum(r['skipped'] for r in rows):>7} {wall:>8.0f}"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tiers", nargs="*", help=f"tiers to run (default: {' '.join(CORE)}); choose from {list(TIERS)}")
    p.add_argument("--out", default=str(ROOT / "runs" / "ci"), help="folder of the tiers' JUnit and JSON files")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose pytest runs the tiers")
    p.add_argument("--table", action="store_true", help="print the table of the tiers recorded in --out; run nothing")
    p.add_argument("--record", nargs=2, metavar=("NAME", "SECONDS"), help="record a step that is not a test tier "
                   "(an install) with its seconds")
    args, extra = p.parse_known_args()
    out = Path(args.out)
    if args.table:
        print(table(out), flush=True)
        return 0
    if args.record:
        record(out, TierResult(args.record[0], float(args.record[1]), time.time() - float(args.record[1])))
        return 0
    unknown = [t for t in args.tiers if t not in TIERS]
    if unknown:
        p.error(f"unknown tier(s) {unknown}; choose from {list(TIERS)}")
    results = [run_tier(TIERS[t], out, args.python, extra) for t in (args.tiers or CORE)]
    print(table(out), flush=True)
    return 1 if any(r.rc for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
