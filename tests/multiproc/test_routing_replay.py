"""Rollout routing replay: the trainer's routers use the recorded experts, token for token.

``workers/routing_replay.py`` replays routes that are a function of each token and layer in the
old-log-prob pass and a GRPO update (packed, full recomputation), and checks every router call's
routing map against them, at EP=1 (one process), EP=2 (two ranks, each its own rows) and TP=2 with
sequence parallelism (each rank routes its slice of the sequence; the second rank gets the routes only
through the rollouts' broadcast, as one tensor beside the pickled rest). Bit for bit: an expert set
either is the recorded one or is not.
"""

from __future__ import annotations

import json

import pytest

from cooper_mcore.convert.hf import hf_to_mcore
from cooper_mcore.models.tiny import save_tiny_hf_model
from tests.conftest import torchrun

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("replay")
    hf = save_tiny_hf_model(str(root / "hf"), "qwen3_moe", seed=7)  # 3 sparse layers and a dense one
    hf_to_mcore(hf, str(root / "mcore"))
    return str(root / "mcore")


@pytest.mark.parametrize("nproc,layout", [(1, ()), (2, ("--ep", "2")), (2, ("--tp", "2"))],
                         ids=["ep1", "ep2", "tp2-sp"])
def test_trainer_routing_is_the_recorded_routing(moe_policy, tmp_path, nproc, layout):
    torchrun("routing_replay.py", nproc, "--policy", moe_policy, "--out", str(tmp_path / "r"), *layout)
    for rank in range(nproc):
        with open(tmp_path / f"r.{rank}", encoding="utf-8") as f:
            r = json.load(f)
        assert r["mismatched"] == 0, r
        assert r["checked"] > 100 and r["padding"] > 0 and r["recomputed"] > 0, r  # every pass was seen
        assert r["grad_norm"] > 0, r
        assert r["pickled_routes"] == 0 and r.get("shared", False) == (layout == ("--tp", "2")), r
