"""Offload/onload with the distributed optimizer's DP-sharded states on 2 processes (gloo, CPU)."""

import pytest
import torch

from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> str:
    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("offload_dist")
    save_tiny_hf_model(str(root / "hf"), "qwen2", seed=5, dtype=torch.bfloat16, num_hidden_layers=2)
    hf_to_mcore(str(root / "hf"), str(root / "mcore"))
    return str(root / "mcore")


def test_offload_dp2_sharded_optimizer(bf16_ckpt):
    reports = last_json(torchrun("offload_worker.py", 2, "--ckpt", bf16_ckpt, timeout=300))
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        # The distributed optimizer holds about half of the Adam state on each rank.
        assert 0 < r["exp_avg_numel"] < 0.75 * r["model_numel"], r
        assert r["equal_before"] == []
        for c in r["cycles"]:
            assert c["still_held"] == [] and c["mismatches"] == [], c
            assert c["offload_bytes"] == c["onload_bytes"] > 0
        assert r["swap_equals_reference"] and r["policy_differs"] and r["policy_restored"], r
        assert r["equal_after"] == [] and r["moved"], r
