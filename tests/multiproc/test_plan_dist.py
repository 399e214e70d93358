"""The memory planner's per-rank counts against the megatron models really built at TP x PP x DP
layouts (4 processes, gloo, CPU): parameter counts exactly, DDP buffers and distributed-optimizer
shards within DDP's alignment padding."""

import json
import math

import pytest

from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.planner.sizes import stage_numel, training_state
from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc


def test_planner_counts_equal_megatron_per_rank():
    from cooper_mcore.models.tiny import tiny_hf_config

    # tied embeddings (the last stage keeps its own copy at PP > 1); and a reward model with q/k norms
    # and head_dim * heads != hidden
    archs = [ArchSpec.from_hf_config(tiny_hf_config("qwen2_tied").to_dict()),
             ArchSpec.from_hf_config(tiny_hf_config("qwen3", "reward").to_dict())]
    records = last_json(torchrun("plan_worker.py", 4, "--layouts", "2x2,1x2",
                                 "--archs", json.dumps([a.to_dict() for a in archs]), timeout=400))
    by_key = {(a.family, a.model_type): a for a in archs}
    assert len(records) == 4 * 2 * len(archs)
    assert {(r["tp"], r["pp"], r["dp"]) for r in records} == {(2, 2, 1), (1, 2, 2)}
    for r in records:
        arch = by_key[(r["family"], r["model_type"])]
        numel = stage_numel(arch, r["tp"], r["pp"], r["pp_rank"])
        assert r["numel"] == numel, r
        planned = training_state(numel, 2, r["dp"])
        pad = r["tensors"] * 64 + math.lcm(r["dp"], 128)  # DDP's alignment of params and buffer end
        assert 0 <= r["param_bytes"] - planned["params"] <= 2 * pad, r
        assert 0 <= r["grad_bytes"] - planned["grads"] <= 4 * pad, r
        # padding inside a rank's shard has no optimizer state; step counters add 4 bytes a tensor
        assert abs(r["optimizer_bytes"] - planned["optimizer"]) <= 0.03 * planned["optimizer"], r
    # at DP=2 the two ranks of a stage hold about half of the Adam state each
    dp2 = [r for r in records if r["dp"] == 2 and r["family"] == "qwen2"]
    for stage in (0, 1):
        full = 12 * stage_numel(archs[0], 1, 2, stage)
        total = sum(r["optimizer_bytes"] for r in dp2 if r["pp_rank"] == stage)
        assert abs(total - full) <= 0.03 * full
