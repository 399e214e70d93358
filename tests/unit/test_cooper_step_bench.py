"""``benchmarks/cooper_step.py`` at its tiny CPU shape: each setting is sized by the planner and
says so, and its table has per-phase rows with seconds, peak, plan and ratio, Cooper's extras and
offload against no offload."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import psutil

from cooper_mcore.config.schema import load_config
from cooper_mcore.planner.plan import PlanOptions, largest_micro_batch
from cooper_mcore.planner.report import load_shapes
from tests.conftest import ROOT

NUMBER = r"\d+\.\d+"


def test_the_tiny_benchmark_reports_every_phase_beside_the_plan(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "cooper_step.py", "--tiny", "--steps", "1", "--workdir", str(tmp_path / "w"),
                        "--json", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT / "benchmarks")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout
    for variant in ("no-offload", "offload"):
        for phase in ("weight_sync", "rollout", "rm_score", "logprobs", "policy_update", "rm_update", "step"):
            cells = rf"\| ({NUMBER}) \| ({NUMBER}) \| ({NUMBER}) \| ({NUMBER}) \| {NUMBER} \| {NUMBER} \|"
            m = re.search(rf"\| {variant} \| {phase} {cells}", text)
            assert m, (variant, phase, text)
            peak, plan, ratio = (float(m.group(i)) for i in (2, 3, 4))
            assert abs(ratio - peak / plan) < 0.01
        assert re.search(rf"\| {variant} \| (offload|negatives) \| {NUMBER} \| {NUMBER} \| - \| - \|", text)
        assert re.search(rf"- {variant}: train.micro_batch_size=\d+ \(cooper plan: the largest that fits", text)
        assert re.search(rf"- {variant}: set-up {NUMBER} s \(build_run", text)
        assert re.search(rf"- {variant}: Cooper's extras .* = {NUMBER}% of the step, {NUMBER}% of the step without "
                         r"the rollout \(4 valid pairs\)", text)
    assert re.search(rf"- offload against no offload: step {NUMBER} s vs {NUMBER} s", text)

    doc = json.loads(out.read_text())
    for variant, res in doc["results"].items():
        cfg = load_config(str(ROOT / "examples" / "tiny_cpu.yaml"),
                          [o for o in res["overrides"] if not o.startswith("train.micro_batch_size=")])
        policy, rm, _ = load_shapes(cfg)
        opts = PlanOptions(gpus_per_node=1, gpu_memory_gib=psutil.virtual_memory().total / 2**30,
                           prompt_tokens=res["prompt_tokens"], assistant="none")
        assert res["sizing"]["value"] == largest_micro_batch(cfg, policy, rm, opts).value, variant
        assert f"train.micro_batch_size={res['sizing']['value']}" in res["overrides"]
        assert res["pairs_valid"] == 4 and res["setup_s"] < res["startup_s"]
