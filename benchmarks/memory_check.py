"""The memory planner held against a simulated step, for every shipped preset (docs/planner.md's table).

Each preset is simulated at its smallest stated cluster (its ``# launch:`` line) by ``cooper plan
--simulate`` in a process of its own (one rank per pipeline stage of the real layout, a whole
Cooper step on fake tensors: :mod:`cooper_mcore.planner.simulate`), with the models the presets'
tests name: the policy's shipped config and VerifyRM's backbone (Qwen3-4B beside the MoE policy).
Printed: per phase and stage, what the simulation sees beside the plan (GiB per GPU) and their ratio,
the planner's terms it cannot see, and each simulation's seconds and peak host memory.

``--train-step`` also simulates ``benchmarks/train_step.py``'s GPU step (Qwen2.5-1.5B shape, one GPU,
4 micro-batches of 2 x 4096 tokens) beside the peak an H200 measured for it (docs/measurements.md):
the simulation's live bytes against a GPU allocator's.

    python benchmarks/memory_check.py                       # every preset (minutes; ~1 GiB of memory)
    python benchmarks/memory_check.py --preset llama3.2-1b_8xh100 --train-step
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from lm_step import megatron_lm_step  # benchmarks/lm_step.py (scripts run from their folder)
from shapes import SHAPES

from cooper_mcore.cli import main as cli
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.parallel import ParallelConfig
from cooper_mcore.planner.fake_device import simulated_device, simulated_world
from cooper_mcore.planner.memory_tracker import MemoryTracker

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = EXAMPLES / "model_configs"
#: the policies' shipped configs, by model.policy_hf's name (as tests/unit/test_presets.py names them)
POLICY_CONFIGS = {"Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b-instruct", "Llama-3.2-1B-Instruct": "llama-3.2-1b-instruct",
                  "Qwen2.5-7B-Instruct": "qwen2.5-7b-instruct", "Qwen3-30B-A3B": "qwen3-30b-a3b"}
#: the reward model each preset trains: VerifyRM (Qwen2.5-Math-1.5B's backbone) unless named here
RM_CONFIGS = {"Qwen3-30B-A3B": "qwen3-4b"}
#: benchmarks/train_step.py's megatron step on one H200, 2026-11-27 (docs/measurements.md): GiB
TRAIN_STEP_MEASURED_GIB = 60.23


def launch(preset: Path) -> tuple[int, int, float]:
    """(smallest node count, GPUs per node, GiB per GPU) of a preset's ``# launch:`` line."""
    m = re.search(r"^# launch: nodes=([0-9,]+) gpus_per_node=(\d+) gpu_memory_gib=([0-9.]+)\b",
                  preset.read_text(), flags=re.M)
    if not m:
        raise ValueError(f"{preset.name} states no cluster (# launch: line)")
    return min(int(n) for n in m.group(1).split(",")), int(m.group(2)), float(m.group(3))


def plan_args(preset: Path) -> list[str]:
    """``cooper plan --simulate --json`` arguments for a preset at its smallest cluster."""
    nodes, per_node, gib = launch(preset)
    policy = re.search(r"^\s*policy_hf:\s*(\S+)", preset.read_text(), flags=re.M).group(1).rstrip("/").split("/")[-1]
    return ["plan", "--config", str(preset), "--nodes", str(nodes), "--gpus-per-node", str(per_node),
            "--gpu-memory-gib", str(gib), "--policy-config", str(CONFIGS / f"{POLICY_CONFIGS[policy]}.json"),
            "--rm-config", str(CONFIGS / f"{RM_CONFIGS.get(policy, 'qwen2.5-1.5b-instruct')}.json"),
            "--simulate", "--json"]


def run_one(args: list[str]) -> None:
    """In this process: ``cooper plan`` with ``args``; prints its JSON with this process's peak memory."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli(args)
    doc = json.loads(out.getvalue()) if rc == 0 else {"error": rc}
    doc["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(doc))


def simulate_preset(preset: Path) -> dict:
    """One preset's plan and simulation, in a process of its own."""
    start = time.perf_counter()
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(plan_args(preset))],
                       capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    if r.returncode:
        raise RuntimeError(f"{preset.name}: exit {r.returncode}\n{r.stderr[-3000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    doc["wall_s"] = time.perf_counter() - start
    return doc


def _kind(phase: dict, kind: str) -> tuple[float, float]:
    k = next((k for k in phase["kinds"] if k["kind"] == kind), None)
    return (k["simulated_gib"] or 0.0, k["planned_gib"]) if k else (0.0, 0.0)


def table(name: str, doc: dict) -> list[str]:
    """Markdown rows of one preset: per phase and stage the state, activations, logits and buffers
    (simulated / planned), the seen sum and its ratio, and the unseen terms the plan keeps."""
    sim = doc["simulation"]
    lines = [f"**{name}** ({doc['cluster']['nodes']} node(s) x {doc['cluster']['gpus_per_node']} GPUs, "
             f"layout {doc['layout']['tp']}x{doc['layout']['pp']}x{doc['layout']['dp']}"
             f"{' ep=' + str(doc['layout']['ep']) if doc['layout']['ep'] > 1 else ''}; ranks {sim['ranks']}; "
             f"{sim['seconds']:.0f} s, {doc['max_rss_gib']:.2f} GiB of host memory)", "",
             "| phase | stage | state | activations | logits | buffers | seen: simulated | plan | ratio | "
             "not simulated (plan) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    states = [f"{m}_{c}" for m in ("policy", "rm") for c in ("params", "grads", "optimizer")]
    for ph in sim["phases"]:
        state = [_kind(ph, k) for k in states]
        sim_state, plan_state = sum(s for s, _ in state), sum(p for _, p in state)
        cells = [f"{s:.2f} / {p:.2f}" for s, p in (_kind(ph, k) for k in ("activations", "logits", "buffers"))]
        lines.append(f"| {ph['phase']} | {ph['stage']} | {sim_state:.2f} / {plan_state:.2f} | " + " | ".join(cells)
                     + f" | {ph['simulated_gib']:.2f} | {ph['planned_gib']:.2f} | {ph['ratio']:.2f} | "
                       f"{ph['unseen_planned_gib']:.2f} |")
    lines += ["", f"host memory per GPU: simulated {sim['host_peak_gib']:.2f}, plan {sim['host_planned_gib']:.2f} GiB; "
                  f"{'every phase within' if sim['within'] else 'NOT every phase within'} "
                  f"{sim['tolerance']:.0%}", ""]
    return lines


def train_step_peak() -> float:
    """The simulated peak (GiB) of benchmarks/train_step.py's megatron step at its GPU defaults."""
    shape = dict(SHAPES["qwen2.5-1.5b"])
    hf = transformers.Qwen2Config(**shape)
    hf.architectures = ["Qwen2ForCausalLM"]
    arch = ArchSpec.from_hf_config(hf.to_dict())
    tracker = MemoryTracker({arch.vocab_size})
    with simulated_world(ParallelConfig(), 1, 0), simulated_device(tracker) as device:
        with device.building_state():
            model = build_model(arch, ParallelConfig(), dtype=torch.bfloat16)
            step, keep = megatron_lm_step(model, [torch.randint(0, arch.vocab_size, (2, 4096)) for _ in range(4)])
        tracker.interval_peak()
        for _ in range(2):  # as measured: the peak over steps after the first
            step()
        return tracker.interval_peak() / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description="the memory planner against a simulated step, every shipped preset")
    p.add_argument("--preset", action="append", help="a preset's name (examples/<name>.yaml); default: all with "
                                                     "a # launch: line")
    p.add_argument("--train-step", action="store_true", help="also simulate benchmarks/train_step.py's GPU step "
                                                             "beside its measured peak")
    p.add_argument("--json", default=None, help="also write every preset's plan and simulation here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one preset in this process
    args = p.parse_args()
    if args.one:
        run_one(json.loads(args.one))
        return
    presets = [EXAMPLES / f"{n}.yaml" for n in args.preset] if args.preset else sorted(
        f for f in EXAMPLES.glob("*.yaml") if "# launch:" in f.read_text())
    docs = {}
    for preset in presets:
        docs[preset.stem] = simulate_preset(preset)
        print("\n".join(table(preset.stem, docs[preset.stem])), flush=True)
    if args.train_step:
        simulated = train_step_peak()
        print(f"benchmarks/train_step.py's step (Qwen2.5-1.5B shape, 1 GPU, 4 x 2 x 4096 tokens): simulated peak "
              f"{simulated:.2f} GiB; measured on an H200 {TRAIN_STEP_MEASURED_GIB:.2f} GiB "
              f"(ratio {simulated / TRAIN_STEP_MEASURED_GIB:.3f})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(docs, f, indent=2)


if __name__ == "__main__":
    main()
