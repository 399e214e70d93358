"""Tiny Qwen3-MoE checkpoints loaded at expert-parallel layouts (gloo on CPU): logits equal to
transformers' and the weight sync pushes exactly the HF checkpoint's tensors.

One torchrun launch per layout checks every model: a causal LM and a reward model with dense and
sparse layers (per-layer checkpoint keys) and an all-sparse causal LM (stacked keys).
"""

import json

import pytest

from cooper_mcore.convert.hf import hf_to_mcore
from cooper_mcore.models.tiny import save_tiny_hf_model
from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc

# fp32 on CPU, as the dense layouts' test (test_parallel.py): TP all-reduces, the alltoall dispatch and
# pipeline stages only reorder fp32 sums, ~1e-7 on logits of size ~1; the routing is the same as long
# as no two router logits of a token lie within that of each other (a flip would differ by ~1e-1).
TOL = 2e-5
# (processes, tp, pp, ep, etp): every rank a replica's first rank (ep2); EP inside the TP group
# (tp2-ep2); EP in every pipeline stage (pp2-ep2); each expert split over two ranks (tp2-ep2-etp2),
# pushed with the attributes Transformer Engine gives expert weights (fc2 marked split along dim 0)
LAYOUTS = [(2, 1, 1, 2, 1), (4, 2, 1, 2, 1), (4, 1, 2, 2, 1), (4, 2, 1, 2, 2)]
IDS = ["ep2", "tp2-ep2", "pp2-ep2", "tp2-ep2-etp2"]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> list[list[str]]:
    """``[name, hf_dir, ckpt]`` of the three tiny Qwen3-MoE models."""
    root = tmp_path_factory.mktemp("moe")
    pairs = []
    for i, (name, model_type, overrides) in enumerate([("mixed-causal_lm", "causal_lm", {}),
                                                       ("mixed-reward", "reward", {}),
                                                       ("sparse-causal_lm", "causal_lm", {"mlp_only_layers": []})]):
        hf_dir = save_tiny_hf_model(str(root / f"{name}-hf"), "qwen3_moe", model_type, seed=i, **overrides)
        hf_to_mcore(hf_dir, str(root / f"{name}-mcore"))
        pairs.append([name, hf_dir, str(root / f"{name}-mcore")])
    return pairs


@pytest.mark.parametrize("nproc,tp,pp,ep,etp", LAYOUTS, ids=IDS)
def test_moe_logits_and_weight_sync(moe_models, nproc, tp, pp, ep, etp):
    out = last_json(torchrun("moe.py", nproc, "--pairs", json.dumps(moe_models), "--tp", str(tp), "--pp", str(pp),
                             "--ep", str(ep), "--etp", str(etp), *(["--te-expert-attrs"] if etp > 1 else [])))
    assert sorted(out) == sorted(name for name, _, _ in moe_models)
    replicas = nproc // (tp * pp)  # each data-parallel replica's first rank pushes its own engine
    for name, res in out.items():
        assert res["logits"] < TOL, (name, res["logits"])
        shapes = set(map(tuple, res["local_experts"].values()))
        assert shapes == {(2 * 32 // etp, 64)}, (name, shapes)  # [gate; up] of moe_intermediate_size 32
        pattern = [1, 1, 1, 0] if "mixed" in name else [1, 1, 1, 1]  # rank 0: the first stage's layers
        assert len(res["local_experts"]) == 8 // ep * sum(pattern[:4 // pp]), name
        if name.endswith("reward"):
            continue
        assert len(res["sync_by_rank"]) == replicas, res["sync_by_rank"].keys()
        for rank, sync in res["sync_by_rank"].items():
            assert sync["missing"] == sync["extra"] == sync["unequal"] == sync["repeated"] == [], (name, rank, sync)
            assert sync["version"] == 3 and sync["buckets"] > 1, sync
