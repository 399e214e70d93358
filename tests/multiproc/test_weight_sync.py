"""Weight sync from a TP/PP Megatron policy into the HF engine (gloo on CPU)."""

import json

import pytest

from cooper_mcore.models.tiny import save_tiny_hf_model
from tests.conftest import last_json, torchrun

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("nproc,tp,pp,per_tp_rank", [(2, 2, 1, False), (2, 1, 2, False), (4, 2, 2, False),
                                                     (2, 2, 1, True), (4, 2, 2, True)],
                         ids=["tp2", "pp2", "tp2pp2", "tp2-per-rank", "tp2pp2-per-rank"])
def test_engine_matches_megatron_after_sync(tiny_models, tmp_path, nproc, tp, pp, per_tp_rank):
    """The engine's log-probs and greedy tokens equal Megatron's after a sync. Per TP rank: every TP
    rank of the first stage all-gathers the full tensors and makes its own payload (the engine checks
    that all ranks' payloads agree and loads the last rank's, which it could not if any were wrong)."""
    pairs = []
    for family in ("qwen2", "llama"):  # untied and tied embeddings
        _, ckpt = tiny_models[(family, "causal_lm")]
        other = save_tiny_hf_model(str(tmp_path / f"{family}-other"), family, seed=99)  # other weights
        pairs.append([family, ckpt, other])
    flags = ["--per-tp-rank"] if per_tp_rank else []
    out = last_json(torchrun("weight_sync.py", nproc, "--pairs", json.dumps(pairs), "--tp", str(tp), "--pp", str(pp),
                             *flags))
    for family, res in out.items():
        assert res["before_diff"] > 0.1, res  # the engine really started elsewhere
        assert res["after_diff"] < 2e-5, (family, res)
        assert res["greedy_equal"] and res["greedy_len"] >= 1, res
        assert res["version"] == 7 and res["buckets"] > 1, res
