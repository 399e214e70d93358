"""`cooper rehearse` without running it: every shipped preset's rehearsal plan keeps its layout and
features and shrinks the rest; the stand-in assistant answers as an assistant would; the report
reads torchrun's failure summary and a hung rank's stack dump."""

from __future__ import annotations

import glob
import os

import pytest

from cooper_mcore.config.schema import load_config
from cooper_mcore.llm_client import OpenAIChatClient
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.negatives.assistant import rewrite_messages
from cooper_mcore.rehearsal.assistant import OUTCOME_WEIGHTS, StandInAssistant, answer, outcome_of, wrong_rewrite
from cooper_mcore.rehearsal.preset import (
    MAX_WORLD,
    STEPS,
    plan_rehearsal,
    preset_shapes,
    real_shape,
    tiny_shape,
)
from cooper_mcore.rehearsal.run import _RANK_EXIT, _where
from cooper_mcore.verify.rule import check_pair
from tests.conftest import ROOT

PRESETS = sorted(glob.glob(str(ROOT / "examples" / "*.yaml")))
GPU_PRESETS = [p for p in PRESETS if "tiny" not in p]


def _plan(preset, *overrides):
    cfg = load_config(preset, list(overrides))
    try:
        policy, rm, _ = preset_shapes(cfg, preset)
    except ValueError:  # tiny_cpu.yaml before `cooper tiny-assets`
        policy, rm = ArchSpec.from_hf_config(tiny_hf_config("qwen2_tied").to_dict()), None
    return cfg, policy, plan_rehearsal(preset, cfg, policy, rm, sglang_available=False)


@pytest.mark.parametrize("preset", PRESETS, ids=os.path.basename)
def test_plan_keeps_the_presets_layout_and_features(preset):
    cfg, policy, plan = _plan(preset)
    r = plan.cfg
    assert (r.parallel.tp, r.parallel.pp, r.parallel.sequence_parallel) == (
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sequence_parallel)
    assert plan.nproc == r.parallel.tp * r.parallel.pp * (2 if r.parallel.tp * r.parallel.pp <= 2 else 1)
    assert plan.nproc <= MAX_WORLD
    for section in ("offload", "algo", "optim"):
        assert getattr(r, section) == getattr(cfg, section), section
    assert (r.reward.mode, r.reward.rm_transform, r.rm.negatives, r.model.dtype) == (
        cfg.reward.mode, cfg.reward.rm_transform, cfg.rm.negatives, cfg.model.dtype)
    assert (r.train.pack_sequences, r.train.mini_batches, bool(r.train.max_tokens_per_micro_batch)) == (
        cfg.train.pack_sequences, cfg.train.mini_batches, bool(cfg.train.max_tokens_per_micro_batch))
    # the cadence: every step evaluates, two checkpoints, the stop and the resume fit in STEPS
    assert (r.train.steps, r.eval.every, r.checkpoint.every) == (STEPS, 1, 2)
    assert r.train.prompts_per_step % (plan.nproc // (r.parallel.tp * r.parallel.pp)) == 0
    # every change is listed with its reason; the engine is named when SGLang stands aside
    changed = {s.setting for s in plan.substitutions}
    assert ("rollout.engine" in changed) == (cfg.rollout.engine == "sglang")
    assert all(s.why for s in plan.substitutions)
    assert plan.assistant == (cfg.rm.negatives == "assistant" and cfg.reward.mode.trains_rm)


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=os.path.basename)
def test_tiny_model_keeps_the_family_traits_and_splits(preset):
    cfg, policy, plan = _plan(preset)
    shape, tp, pp = plan.shape, plan.cfg.parallel.tp, plan.cfg.parallel.pp
    f = shape.fields
    assert shape.family == policy.family
    assert f["num_attention_heads"] // f["num_key_value_heads"] == policy.heads_per_group  # the GQA ratio
    assert f["tie_word_embeddings"] == policy.tie_word_embeddings
    assert f["num_attention_heads"] % tp == 0 and f["num_key_value_heads"] % tp == 0
    assert shape.num_layers % pp == 0 and shape.hidden_size == f["num_attention_heads"] * f["head_dim"]
    assert f["head_dim"] % 2 == 0


def test_the_7b_preset_is_found_beside_it_and_kept_at_tp2_pp2():
    _, policy, plan = _plan(str(ROOT / "examples" / "qwen2.5-7b_multinode.yaml"))
    assert (policy.num_attention_heads, policy.num_query_groups) == (28, 4)  # model_configs/qwen2.5-7b-instruct.json
    assert plan.layout().startswith("tp=2 pp=2 dp=1 sequence_parallel=true (world 4)")


def test_a_layout_over_four_processes_is_capped_and_said():
    _, _, plan = _plan(str(ROOT / "examples" / "qwen2.5-7b_multinode.yaml"), "parallel.pp=4")
    assert (plan.cfg.parallel.tp, plan.cfg.parallel.pp, plan.nproc) == (1, 4, 4)
    cap = [s for s in plan.substitutions if s.setting == "parallel.tp/pp"]
    assert cap and cap[0].preset == "2/4" and cap[0].rehearsal == "1/4"


@pytest.mark.parametrize("overrides,ep,etp,changed", [
    ((), 4, 1, {"parallel.ep"}), (("parallel.etp=2",), 2, 2, {"parallel.ep"}),
    (("parallel.tp=1",), 2, 1, {"parallel.ep"}),
    (("parallel.tp=1", "parallel.etp=4"), 1, 1, {"parallel.ep", "parallel.etp"})])
def test_the_moe_preset_keeps_expert_parallelism_within_its_processes(overrides, ep, etp, changed):
    """EP, then ETP, halved until the rehearsal's processes hold them (world divisible by etp * ep * pp);
    at EP=1 the expert TP is the TP size (any other drifts)."""
    _, policy, plan = _plan(str(ROOT / "examples" / "qwen3-30b-a3b_8xh200_multinode.yaml"), *overrides)
    p = plan.cfg.parallel
    assert policy.moe is not None and plan.shape.family == "qwen3_moe"  # model_configs/qwen3-30b-a3b.json
    assert plan.shape.fields["mlp_only_layers"] == []  # all sparse, as the real model (and SGLang serves)
    assert (p.ep, p.etp) == (ep, etp) and plan.nproc % (p.etp * p.ep * p.pp) == 0
    assert p.expert_drift_problem() is None
    assert (f" ep={ep} etp={etp} " in plan.layout()) == (ep > 1 or etp > 1)
    assert {s.setting for s in plan.substitutions if s.setting.startswith("parallel.e")} == changed


def test_real_shape_keeps_the_presets_experts():
    """``cooper rehearse --real-shape`` on an MoE preset builds the preset's experts, not the tiny ones."""
    cfg = load_config(str(ROOT / "examples" / "qwen3-30b-a3b_8xh200_multinode.yaml"), [])
    policy, rm, _ = preset_shapes(cfg, str(ROOT / "examples" / "qwen3-30b-a3b_8xh200_multinode.yaml"))
    f = real_shape(policy, rm).fields
    assert (f["num_experts"], f["num_experts_per_tok"], f["moe_intermediate_size"]) == (128, 8, 768)
    assert (f["norm_topk_prob"], f["decoder_sparse_step"], f["mlp_only_layers"]) == (True, 1, [])
    assert f["router_aux_loss_coef"] == policy.moe.router_aux_loss_coef
    hf = tiny_hf_config("qwen3_moe", **f)
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (128, 8, 768)
    dense = ArchSpec.from_hf_config(tiny_hf_config("qwen2").to_dict())
    assert "num_experts" not in real_shape(dense, None).fields


def test_qwen3_traits_survive_the_shrink():
    policy = ArchSpec.from_hf_config(tiny_hf_config("qwen3", num_attention_heads=32, num_key_value_heads=8,
                                                    head_dim=128).to_dict())
    shape = tiny_shape(policy, None, tp=2, pp=2)
    assert shape.family == "qwen3" and not shape.fields["tie_word_embeddings"]
    assert (shape.fields["num_attention_heads"], shape.fields["num_key_value_heads"]) == (8, 2)
    assert shape.num_layers == 4


SOLUTION = "5+7=12,12-3=9 \\boxed{9}"


def test_stand_in_outcomes_are_stable_and_mixed():
    texts = [f"Problem:\n{i}+1=\n\nCorrect response:\n{SOLUTION}" for i in range(400)]
    outcomes = [outcome_of(t) for t in texts]
    assert outcomes == [outcome_of(t) for t in texts]  # the same request, the same answer (resume)
    share = {o: outcomes.count(o) / len(outcomes) for o, _ in OUTCOME_WEIGHTS}
    total = sum(w for _, w in OUTCOME_WEIGHTS)
    for o, w in OUTCOME_WEIGHTS:  # 400 draws: a share within 0.08 of its weight (> 3 standard errors)
        assert abs(share[o] - w / total) < 0.08, share


def test_stand_in_answers_are_what_their_outcome_says():
    assert check_pair("9", wrong_rewrite(SOLUTION))[0] is False  # math-verify: wrong, gold first
    assert wrong_rewrite(SOLUTION).startswith("5+7=12,12-3=9")  # the chain kept, the final answer changed
    for i in range(60):
        user = rewrite_messages(f"{i}+2=", SOLUTION)[1]["content"]
        outcome, text = answer(user)
        verdict = check_pair("9", text)[0]
        expected = {"wrong": False, "slow": False, "still_correct": True}.get(outcome)
        if outcome == "unparseable":
            assert verdict is not True and not any(c.isdigit() for c in text)
        else:
            assert verdict is expected, (outcome, text)


def test_stand_in_server_speaks_the_openai_api():
    with StandInAssistant("Qwen2.5-7B-Instruct", slow_s=0.01) as server:
        client = OpenAIChatClient(server.url, "Qwen2.5-7B-Instruct", api_key_env=None, timeout_s=10)
        assert client.check_ready() == "models"
        chats = [rewrite_messages(f"{i}+2=", SOLUTION) for i in range(12)]
        texts = client.chat_batch(chats, temperature=0.7, max_tokens=64)
    assert all(isinstance(t, str) for t in texts)
    assert sum(server.counts.values()) == 12
    assert [answer(c[1]["content"])[1] for c in chats] == texts


TORCHRUN_SUMMARY = """[1]:
  time      : 2026-11-26_12:17:03
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 75 (pid: 14714)
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_12:17:03
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 14713)
"""

STACK_DUMP = '''Thread 0x00007f (most recent call first):
  File "/x/threading.py", line 320 in wait

Current thread 0x00007e (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 4188 in gather
  File "/x/cooper_mcore/rollout/weight_sync.py", line 59 in _gather_tp
  File "/x/cooper_mcore/rl/colocate.py", line 80 in generating

'''


def test_report_reads_rank_exit_codes_and_where_a_rank_waits():
    assert {int(r): int(c) for r, c in _RANK_EXIT.findall(TORCHRUN_SUMMARY)} == {1: 75, 0: -9}
    assert _where(STACK_DUMP) == "weight_sync.py:59 _gather_tp in gather"
    assert _where("no dump here") == "no stack dump"


def test_a_hung_launch_dumps_every_ranks_stack_and_dies(tmp_path):
    """What the per-step limit does: ask each rank (the launcher's children) for its stack, then end
    the launcher and everything it started."""
    import subprocess
    import sys
    import time

    import psutil

    from cooper_mcore.rehearsal.run import _stop

    ready = tmp_path / "ready"
    rank = ("import faulthandler, signal, sys, time; faulthandler.register(signal.SIGUSR2, file=sys.stderr, "
            f"all_threads=True); open({str(ready)!r}, 'w').close()\n"
            "def wait_in_collective():\n    time.sleep(120)\nwait_in_collective()")
    log = tmp_path / "rank0.log"
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                 f"subprocess.Popen([sys.executable, '-c', {rank!r}], stderr=open({str(log)!r}, 'w'))"
                                 ".wait()"])
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:  # the rank has registered its handler
        time.sleep(0.1)
    (child,) = psutil.Process(launcher.pid).children()
    _stop(launcher, dump=True)
    assert launcher.poll() is not None

    def dead() -> bool:  # gone, or a zombie whose parent (the launcher) died before it could reap it
        try:
            return child.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert dead()
    dump = log.read_text()
    assert "most recent call first" in dump and "wait_in_collective" in dump


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=os.path.basename)
def test_a_real_shape_plan_builds_random_weights_on_one_process(preset):
    cfg = load_config(preset)
    policy, rm, _ = preset_shapes(cfg, preset)
    plan = plan_rehearsal(preset, cfg, policy, rm, sglang_available=True, at_real_shape=True)
    r = plan.cfg
    assert plan.real_shape and plan.nproc == 1 and (r.parallel.tp, r.parallel.pp) == (1, 1)
    assert r.model.init == "random" and r.rollout.engine == "hf"  # SGLang would load model.policy_hf's weights
    changed = {s.setting: s for s in plan.substitutions}
    assert changed["model.init"].rehearsal == "random"
    assert (r.rollout.group_size, r.rollout.max_new_tokens) == (cfg.rollout.group_size, cfg.rollout.max_new_tokens)
    assert plan.shape.real and plan.shape.hidden_size == policy.hidden_size


def test_variants_parse_from_the_command_line_and_need_the_interrupted_runs(monkeypatch):
    """`--variant a=1,b=2` (repeatable) reaches the rehearsal as one list of settings per variant; a
    real-shape rehearsal, which makes no interrupted runs, refuses variants before any work."""
    from cooper_mcore.cli import build_parser
    from cooper_mcore.commands import rehearse as command
    from cooper_mcore.rehearsal.run import rehearse_preset

    seen = {}

    class Report:
        ok = True

        def format(self):
            return "rehearsal: PASS"

    monkeypatch.setattr(command, "rehearse_preset", lambda *a, **kw: seen.update(kw) or Report())
    both = "offload.policy_params=true,offload.rm_params=true"
    args = build_parser().parse_args(["rehearse", "--config", "tiny_cpu", "--variant", "offload.release_engine=false",
                                      "--variant", both, "parallel.tp=2"])
    assert command.rehearse(args) == 0
    assert seen["variants"] == [["offload.release_engine=false"], both.split(",")]
    assert args.overrides == ["parallel.tp=2"]
    with pytest.raises(ValueError, match="--variant needs the interrupted and resumed runs"):
        rehearse_preset("tiny_cpu", at_real_shape=True, variants=[["offload.release_engine=false"]])
