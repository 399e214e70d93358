"""``model.init: random`` at DP=2 (2 processes, gloo): both data-parallel replicas build the same
random policy and reward model (a replica that differed would train a different model from the
first step on: megatron's DDP does not broadcast parameters)."""

import json

import pytest

from cooper_mcore.models.tiny import tiny_hf_config
from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc


def test_every_data_parallel_replica_builds_the_same_random_weights(tmp_path):
    config = tmp_path / "policy.json"
    config.write_text(json.dumps(tiny_hf_config("qwen2_tied").to_dict()))
    rank0, rank1 = last_json(torchrun("random_init.py", 2, "--policy-config", str(config), timeout=400))
    assert rank0.keys() == rank1.keys() and any(k.startswith("rm.") for k in rank0)
    assert rank0 == rank1
    assert rank0["policy.embedding.word_embeddings.weight"] != rank0.get("rm.embedding.word_embeddings.weight")
