"""Faults on a tiny CPU Cooper run (tests.harness.fault_trials): SIGKILL at seeded moments (the
killed run's stale folder lock taken over by the restart), SIGTERM (checkpoint, exit 75) and a
corrupt newest checkpoint (the previous one is used), each followed by ``--resume auto`` and
compared bitwise with an uninterrupted run; non-finite losses
(skipped updates, then a checkpoint and exit 3)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, WORKERS

pytestmark = pytest.mark.multiproc
STEPS = 3
ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def trials(tmp_path_factory):
    """10 seeded SIGKILL trials, one SIGTERM and one corrupt-checkpoint trial (and the tiny assets
    the NaN test reuses)."""
    work = tmp_path_factory.mktemp("faults")
    r = subprocess.run([sys.executable, "-m", "tests.harness.fault_trials", "--work", str(work),
                        "--trials", "10", "--seed", "0", "--steps", str(STEPS)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT, env=ENV)
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    with open(work / "assets.json") as f:
        assets = json.load(f)
    return work, summary, assets


def _args(assets, out, *extra):
    from tests.harness.fault_trials import train_args

    return [*train_args(assets, str(out), STEPS), *extra]


def _metrics(out):
    return {m["step"]: m for m in map(json.loads, open(os.path.join(out, "metrics.jsonl")))}


def _by_kind(summary, kind):
    return [t for t in summary["trials"] if t["trial"]["kind"] == kind]


def test_sigkill_anywhere_then_resume_is_bitwise_identical(trials):
    _, s, _ = trials
    kills = _by_kind(s, "kill")
    points = {t["trial"]["point"] for t in kills}
    assert len(kills) == 10 and {"rollout", "policy_update", "rm_update"} <= points
    assert any(p.startswith("ckpt_") for p in points)
    assert all(t["killed"] for t in kills), [t["error"] for t in kills]  # every run really died of SIGKILL
    assert all(t["resumed"] and t["bitwise_equal"] for t in kills), [t["error"] for t in kills]
    # the killed run's folder lock stayed behind, and the restart took it over (the kernel had released it)
    assert all(t["lock_left"] for t in kills), [t["trial"] for t in kills if not t["lock_left"]]
    assert s["policy_moved"] and s["rm_moved"]  # both models were trained, so equality means something
    assert any(t["resumed_from_step"] for t in kills)  # some restarts did load a checkpoint


def test_sigterm_checkpoints_exits_75_and_resumes_bitwise(trials):
    work, s, _ = trials
    (i,) = [i for i, t in enumerate(s["trials"]) if t["trial"]["kind"] == "sigterm"]
    t = s["trials"][i]
    # exit 75 with a step-1 checkpoint although checkpoint.every=2; the restart loaded it
    assert t["killed"] and t["resumed"] and t["resumed_from_step"] == 1, t["error"]
    assert t["bitwise_equal"], t["error"]
    log = (work / f"trial{i}.faulty.log").read_text()
    assert "preempted (SIGTERM) after step 1: checkpoint" in log and "--resume auto" in log


def test_corrupt_newest_checkpoint_falls_back_and_resumes_bitwise(trials):
    _, s, _ = trials
    (t,) = _by_kind(s, "corrupt")
    assert t["killed"], t["error"]  # the flipped byte was reported with the checkpoint's path
    assert t["resumed"] and t["resumed_from_step"] == STEPS - 1 and t["bitwise_equal"], t["error"]
    assert s["faults"] == s["resumed"] == s["bitwise_equal"] == 12


def _model_tensors(path):
    from megatron.core.dist_checkpointing import load_plain_tensors

    from cooper_mcore.parallel import single_process_world

    with single_process_world():
        return {k: v for k, v in load_plain_tensors(str(path)).items()
                if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")}


def test_nonfinite_loss_skips_updates_then_stops_with_checkpoint(trials, tmp_path):
    _, _, assets = trials
    out = tmp_path / "nan"
    args = _args(assets, out, "train.steps=6", "train.max_nonfinite_steps=3", "checkpoint.every=1",
                 "checkpoint.keep=10")
    r = subprocess.run([sys.executable, str(WORKERS / "nan_train.py"), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(ENV, NAN_FROM_STEP="2"))
    assert r.returncode == 3, r.stderr[-3000:]
    assert "3 steps in a row had a non-finite loss or gradient norm" in r.stderr
    m = _metrics(out)
    assert sorted(m) == [1, 2, 3, 4]  # stopped after the third bad step in a row
    assert m[1]["skipped/nonfinite"] == 0 and all(m[s]["skipped/nonfinite"] == 1 for s in (2, 3, 4))
    with open(out / "checkpoints" / "step_4" / "trainer.json") as f:
        state = json.load(f)
    assert state["adam_steps"]["policy"] == 1.0 and state["nonfinite_streak"] == 3  # one real update
    ckpt = out / "checkpoints"
    first, last = _model_tensors(ckpt / "step_1" / "policy"), _model_tensors(ckpt / "step_4" / "policy")
    assert first.keys() == last.keys() and len(first) > 5
    assert all(torch.equal(first[k], last[k]) for k in first)  # no NaN reached the weights
    assert all(torch.isfinite(v).all() for v in last.values())
