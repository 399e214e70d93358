"""The memory planner's per-rank counts for a mixture-of-experts model against the megatron models
really built at TP x EP layouts (2 processes, gloo, CPU): parameter and expert counts exactly, DDP
buffers and distributed-optimizer shards (experts over expert_dp) within DDP's alignment padding."""

import json
import math

import pytest

from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.planner.sizes import stage_expert_numel, stage_numel, training_state
from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc


def test_planner_counts_equal_megatron_per_rank_with_experts():
    # 8 experts, top 2, layers 0-2 sparse and layer 3 dense
    arch = ArchSpec.from_hf_config(tiny_hf_config("qwen3_moe").to_dict())
    records = last_json(torchrun("plan_moe_worker.py", 2, "--layouts", "1x1,1x2,2x2",
                                 "--arch", json.dumps(arch.to_dict()), timeout=400))
    assert len(records) == 2 * 3
    assert {(r["tp"], r["ep"], r["dp"], r["expert_dp"]) for r in records} == {(1, 1, 2, 2), (1, 2, 2, 1),
                                                                               (2, 2, 1, 1)}
    for r in records:
        numel = stage_numel(arch, r["tp"], 1, 0, r["ep"])
        # megatron marks experts allreduce=False (expert buffer, optimizer over expert_dp) only at EP > 1
        experts = stage_expert_numel(arch, 1, 0, r["ep"]) if r["ep"] > 1 else 0
        assert (r["numel"], r["expert_numel"]) == (numel, experts), r
        planned = training_state(numel, 2, r["dp"], expert_numel=experts, expert_dp=r["expert_dp"])
        pad = r["tensors"] * 64 + 2 * math.lcm(r["dp"], 128)  # two DDP buffers (dense, experts), each aligned
        assert 0 <= r["param_bytes"] - planned["params"] <= 2 * pad, r
        assert 0 <= r["grad_bytes"] - planned["grads"] <= 4 * pad, r
        assert abs(r["optimizer_bytes"] - planned["optimizer"]) <= 0.03 * planned["optimizer"], r
