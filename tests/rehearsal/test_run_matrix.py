"""The run matrix: multi-step trainer runs in every model-parallel shape, under
TORCH_DISTRIBUTED_DEBUG=DETAIL, with the engine releasing its memory and keeping it.

Each case is a rehearsal of examples/tiny_cpu.yaml at that layout: 4 steps, evaluation after every
step, checkpoints at steps 2 and 4, SIGUSR1 in step 3 (checkpoint, exit 75) and a resume that must
end on the uninterrupted run's metrics and weights bit for bit. The engine releases its memory in
the reference run. At TP=2 x PP=2 (both kinds of model-parallel group, whose leaders push the
weights) the interrupted and resumed runs are made twice, releasing and keeping it (`--variant
offload.release_engine=false`), and both must end on that one reference: keeping the engine changes
no number. At TP=2 they are made again with the engine in a process of its own
(`rollout.placement=disaggregated` at staleness 0, docs/async.md: its rollout thread, the weights
gathered over TP and pushed over the weight group, the rollouts shared with the TP group, the stop
signal ignored by the engine), which must end on the colocated reference bit for bit. PP=2 releases
the engine only. With TP or PP > 1 and a releasing engine,
the trainer used to hang on the step after its first evaluation (the group leader alone pushed the
weights again); the per-step limit names the ranks and the calls they wait in. The DP=2 case is the
tiny_cpu preset's own rehearsal, with the same variant (test_presets.py).

The mixture-of-experts cases run the same rehearsal at EP=2 (2 gloo ranks, each with 4 of the 8
experts) with a tiny Qwen3-MoE policy and a dense RM, and a dense policy with a Qwen3-MoE RM (the
shapes' families from the shipped model configs): routing's all-to-all under DETAIL, the expert
parameters' weight push into the transformers engine, their offload, checkpoints and the resume; the
MoE policy replays the engine's routing (``model.moe_routing_replay``).
"""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.rehearsal.conftest import rehearse

pytestmark = [pytest.mark.multiproc, pytest.mark.rehearsal]
LAYOUTS = {"tp2": ("parallel.tp=2",), "pp2": ("parallel.pp=2",), "tp2xpp2": ("parallel.tp=2", "parallel.pp=2")}
KEEP = "offload.release_engine=false"
APART = "rollout.placement=disaggregated"
#: each layout's variant: settings under which the stopped and resumed runs must end on the reference's numbers
VARIANTS = {"tp2xpp2": KEEP, "tp2": APART}
MODEL_CONFIGS = ROOT / "examples" / "model_configs"
MOE, DENSE = str(MODEL_CONFIGS / "qwen3-30b-a3b.json"), str(MODEL_CONFIGS / "qwen2.5-1.5b-instruct.json")
#: (policy config, RM config, overrides) of each mixture-of-experts case; the MoE model's params are offloaded
MOE_CASES = {"ep2-moe-policy": (MOE, DENSE, ("offload.policy_params=true", "offload.policy_optimizer=true",
                                             "model.moe_routing_replay=true")),
             "ep2-moe-rm": (DENSE, MOE, ("offload.rm_params=true", "offload.rm_optimizer=true",
                                         "offload.release_engine=false"))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_runs_evaluates_stops_and_resumes_releasing_or_keeping_the_engine(layout, rehearsal_root):
    setting = VARIANTS.get(layout)
    variant = ("--variant", setting) if setting else ()
    _, report = rehearse(rehearsal_root, f"matrix-{layout}", str(ROOT / "examples" / "tiny_cpu.yaml"),
                         *LAYOUTS[layout], "offload.release_engine=true", *variant)
    tp, pp = (2 if "tp2" in layout else 1), (2 if "pp2" in layout else 1)
    dp = 2 if tp * pp <= 2 else 1
    assert report["layout"].startswith(f"tp={tp} pp={pp} dp={dp} ")
    assert "release_engine true" in report["features"]
    wanted = {"stop signal", "resume"} | ({f"stop signal [{setting}]", f"resume [{setting}]"} if setting else set())
    assert wanted <= {c["name"] for c in report["checks"]}
    assert [c["name"] for c in report["checks"] if not c["ok"]] == []


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_layout_runs_evaluates_stops_and_resumes(case, rehearsal_root):
    policy, rm, overrides = MOE_CASES[case]
    stdout, report = rehearse(rehearsal_root, f"matrix-{case}", str(ROOT / "examples" / "tiny_cpu.yaml"),
                              "--policy-config", policy, "--rm-config", rm, "parallel.ep=2", *overrides)
    families = "qwen3_moe (rm qwen2)" if policy == MOE else "qwen2 (rm qwen3_moe)"
    assert f"model:    {families}" in stdout
    assert report["layout"].startswith("tp=1 pp=1 dp=2 ep=2 etp=1 ")
    assert [c["name"] for c in report["checks"] if not c["ok"]] == []
