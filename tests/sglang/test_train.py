"""`cooper train` with the real SGLang engine (``rollout.engine: sglang``) on SGLang's CPU backend:
Cooper mode for a few steps, its metrics and checkpoints, and a resume.

The engine lives in the trainer's process (one per model-parallel group), releases its memory
between generations (on CPU SGLang only marks the tags: its CPU scheduler cannot release) and gets
the policy's weights pushed before every generation (:mod:`cooper_mcore.rl.colocate`).

What "resumed exactly" can mean here: the resumed run restores the policy, the reward model, both
optimizers, the schedules, the RNG and the data position from the checkpoint, so its state equals
the checkpoint's bit for bit and it draws the prompts the uninterrupted run drew. Its rollouts are
not the same samples: SGLang honours per-request seeds only with deterministic inference, which its
CPU attention backend lacks (see test_offline.py), so two runs sample differently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.sglang.conftest import ROOT

pytestmark = pytest.mark.sglang


def _train(assets: dict[str, str], out, *overrides: str) -> list[dict]:
    args = _train_args(assets, out, *overrides)
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert r.returncode == 0, r.stderr[-6000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _train_args(assets: dict[str, str], out, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "cooper_mcore", "train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
            "--out", str(out), f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"model.rm_ckpt={assets['rm_ckpt']}", f"data.train_path={assets['train']}",
            f"data.eval_path={assets['eval']}", "rollout.engine=sglang", "reward.mode=cooper",
            "rm.negatives=policy", "rollout.max_new_tokens=12", "rollout.group_size=4", "train.prompts_per_step=4",
            "train.micro_batch_size=4", "eval.every=2", "data.eval_limit=4", "checkpoint.every=1",
            "logging.wandb=false", *overrides]


def _state(ckpt) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing import load_plain_tensors

    from cooper_mcore.parallel import single_process_world

    with single_process_world():
        return {k: v for k, v in load_plain_tensors(str(ckpt)).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def train_assets(tmp_path_factory) -> dict[str, str]:
    from cooper_mcore.demo.assets import build_tiny_assets

    return build_tiny_assets(str(tmp_path_factory.mktemp("train-assets")), n_train=64, n_eval=8)


def test_cooper_train_with_sglang_checkpoints_and_resumes(train_assets, tmp_path):
    run = tmp_path / "run"
    first = _train(train_assets, run, "train.steps=2", "algo.tis_cap=2.0")
    assert [m["step"] for m in first] == [1, 2]
    for m in first:
        assert all(k in m for k in ("reward/mean", "rule/acc", "loss", "rm/loss", "time/rollout", "time/weight_sync"))
        assert m["skipped/nonfinite"] == 0.0 and m["response/length"] > 0
        # SGLang's return_logprob (temperature 1) against the trainer's old log-probabilities of the
        # pushed weights: fp32 rounding apart (test_offline.py measures < 1.1e-6 per token), so the
        # first-step guard passes and no truncated importance weight is capped
        assert m["rollout/logprob_diff_mean"] < 1e-4 and m["rollout/logprob_diff_max"] < 1e-3
        assert m["rollout/tis_capped_frac"] == 0.0 and abs(m["rollout/tis_weight_mean"] - 1.0) < 1e-3
    assert 0.0 <= first[-1]["eval/acc"] <= 1.0
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_1", "step_2"]
    saved = {part: _state(ckpts / "step_2" / part) for part in ("policy", "rm")}
    assert saved["policy"] and any(not torch.equal(v, _state(ckpts / "step_1" / "policy")[k])
                                   for k, v in saved["policy"].items())  # the policy trained

    # the same run (a resume must not change what it trains: algo.tis_cap as before), three steps long
    resumed = _train(train_assets, run, "train.steps=3", "algo.tis_cap=2.0", "checkpoint.resume=auto",
                     "checkpoint.keep=3")
    assert [m["step"] for m in resumed] == [1, 2, 3]  # appended after the two steps it resumed from
    trainer = json.loads((ckpts / "step_3" / "trainer.json").read_text())
    assert trainer["step"] == 3 and trainer["adam_steps"]["policy"] == 3.0
    first_trainer = json.loads((ckpts / "step_2" / "trainer.json").read_text())
    assert trainer["data"]["step"] > first_trainer["data"]["step"]  # the data stream went on
    for part in ("policy", "rm"):
        again = _state(ckpts / "step_2" / part)  # untouched by the resumed run
        assert all(torch.equal(again[k], v) for k, v in saved[part].items())


def test_cooper_train_with_an_sglang_server_apart(train_assets, tmp_path):
    """``rollout.placement: disaggregated`` with SGLang (docs/async.md): a launched server (its own process
    and session) generates a step ahead (staleness 1), its weights pushed over a gloo weight group through
    SGLang's init_weights_update_group / update_weights_from_distributed. Killed after the first step, the
    server is launched again and re-synced (``rollout.engine_restarts``) and the run goes on; the checkpoint
    keeps the rollouts generated ahead, and no server outlives the run."""
    run = tmp_path / "apart"
    args = _train_args(train_assets, run, "train.steps=4", "rollout.placement=disaggregated",
                       "rollout.max_staleness=1")
    log = tmp_path / "train.log"  # a file, not a pipe: nothing blocks on a full pipe while the test waits
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    servers = _servers_of(train_assets["policy_hf"])
    assert len(servers) == 1
    os.killpg(servers[0].pid, signal.SIGKILL)
    proc.wait(timeout=900)
    stderr = log.read_text()
    assert proc.returncode == 0, stderr[-6000:]
    assert "starting it again (restart 1 of rollout.engine_restarts=1)" in stderr
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["rollout/staleness_max"] for m in lines] == [0, 1, 1, 1]
    assert lines[0]["rollout/logprob_diff_mean"] < 1e-4  # step 1's rollouts: the pushed weights, not stale
    assert all(m["time/weight_push"] >= 0 and m["skipped/nonfinite"] == 0.0 for m in lines)
    assert 0.0 <= lines[1]["eval/acc"] <= 1.0
    kept = json.loads((run / "checkpoints" / "step_3" / "ranks" / "rank0.json").read_text())["pending"]
    assert len(kept) == 1 and {s["weight_version"] for g in kept[0] for s in g["samples"]} == {2}  # step 4's: policy 2
    assert not _servers_of(train_assets["policy_hf"])


def _servers_of(model_path: str) -> list:
    """Running SGLang servers of ``model_path``."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "sglang.launch_server" in cmd and model_path in cmd:
            found.append(p)
    return found
