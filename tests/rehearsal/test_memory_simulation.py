"""``cooper plan --simulate`` on the smallest shipped preset at its real shapes: rank 0 of its 8-GPU
layout through a whole Cooper step on fake tensors (the trainer's own code: megatron DDP, the
distributed optimizer, offload, the weight push, the four passes), every phase within 15% of the
plan, the models' state byte for byte. The simulation is the independent reference: it counts what
the trainer allocates, not the planner's formulas. In process (one rank; the fake process group),
about 30 s of CPU; the other presets are benchmarks/memory_check.py's (docs/planner.md)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from cooper_mcore.config.schema import load_config
from cooper_mcore.planner.comparison import TOLERANCE, check_plan
from cooper_mcore.planner.memory_tracker import STATE_KINDS
from cooper_mcore.planner.plan import PHASES, PlanOptions
from cooper_mcore.planner.report import find_shapes
from tests.conftest import ROOT

pytestmark = [pytest.mark.rehearsal, pytest.mark.filterwarnings("ignore::UserWarning")]
CONFIGS = ROOT / "examples" / "model_configs"


def test_the_smallest_preset_simulated_is_within_the_plan_in_every_phase():
    cfg = load_config(str(ROOT / "examples" / "llama3.2-1b_8xh100.yaml"))
    # the preset's policy, and VerifyRM's backbone (Qwen2.5-Math-1.5B's shape), as its tests name them
    policy, rm, _ = find_shapes(cfg, str(CONFIGS / "llama-3.2-1b-instruct.json"),
                                str(CONFIGS / "qwen2.5-1.5b-instruct.json"))
    check = check_plan(cfg, policy, rm, PlanOptions(gpus_per_node=8, gpu_memory_gib=79.18))
    assert not dist.is_initialized()  # the fake world is gone
    assert {c.phase for c in check.checks} == set(PHASES) and [s.rank for s in check.sims] == [0]
    off = [f"{c.phase}: {c.ratio:.3f}" for c in check.checks if not c.within]
    assert not off, f"phases further than {TOLERANCE:.0%} from the plan: {off}\n{check.format()}"
    for c in check.checks:
        for k in c.kinds:
            if k.kind in STATE_KINDS:  # DDP's buffers and the optimizer's shards, as megatron allocated them
                assert abs(k.simulated - k.planned) <= 1e-4 * k.planned, (c.phase, k.kind, k.simulated, k.planned)
            assert "PLANNED but" not in k.note and "NOT PLANNED" not in k.note, (c.phase, k)
    assert check.host_engine == 0  # SGLang's memory is its own process's
    assert abs(check.host_peak - check.host_planned) <= 1e-4 * check.host_planned  # the reference's copies
    phases = {c.phase: c for c in check.checks}
    kinds = {k.kind: k for k in phases["policy_update"].kinds}
    assert kinds["activations"].simulated > 5 * 2**30 and kinds["logits"].simulated > 2**30  # the step ran
    # the engine memory the trainer had resumed: all of it for the rollout and, in the first step, the push
    assert check.sims[0].engine_resident["rollout"] == ["cuda_graph", "kv_cache", "weights"]
    assert check.sims[0].engine_resident["policy_update"] == []
