"""`cooper rehearse --real-shape`: one process at the preset's model shape, built with random weights
on the device (nothing converted), its micro-batches sized by `cooper plan` for this device, and
every phase's time next to the planner's prediction. On CPU the shape is made small with
--policy-config; on a GPU the same path runs the preset's own shape."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.conftest import ROOT
from tests.rehearsal.conftest import rehearse

pytestmark = [pytest.mark.multiproc, pytest.mark.rehearsal]
SMALL_QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 2048, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "tie_word_embeddings": True, "hidden_act": "silu"}


def test_the_paper_preset_at_a_small_shape_is_sized_by_the_planner_and_measured(rehearsal_root, tmp_path):
    config = tmp_path / "small_qwen.json"
    config.write_text(json.dumps(SMALL_QWEN))
    text, report = rehearse(rehearsal_root, "real-shape", str(ROOT / "examples" / "qwen2.5-1.5b_8xh100.yaml"),
                            "--real-shape", "--policy-config", str(config))
    subs = {s["setting"]: s for s in report["substitutions"]}
    assert subs["model.init"]["rehearsal"] == "random" and subs["rollout.engine"]["rehearsal"] == "hf"
    budget = subs["train.max_tokens_per_micro_batch"]  # the preset packs by a token budget: the planner sizes it
    assert budget["preset"] == "4096" and "the largest cooper plan fits in" in budget["why"]
    phases = {m["phase"]: m for m in report["phases"]}
    for phase in ("rollout", "rm_score", "logprobs", "policy_update", "rm_update", "weight_sync"):
        assert phases[phase]["seconds"] is not None and phases[phase]["planned_gib"] > 0, phase
    assert re.search(r"Cooper's extras .* = \d+\.\d% of the step, \d+\.\d% of the step without the rollout", text)
    run = os.path.join(str(rehearsal_root), "real-shape")
    saved = open(os.path.join(run, "rehearsal.yaml")).read()
    assert "init: random" in saved and "policy_config.json" in saved
    assets = os.path.join(str(rehearsal_root), "assets", "real-v2048")
    assert sorted(os.listdir(assets)) == ["eval.jsonl", "tokenizer", "tokenizer_v2048", "train.jsonl"]  # no model
