"""examples/launch_multinode.sh for real: torchrun's c10d rendezvous, 2 processes (gloo on CPU), one
Cooper step of the tiny preset. The GPU cluster path differs only in NNODES/GPUS_PER_NODE/MASTER_ADDR."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launcher_trains_with_c10d_rendezvous(tmp_path):
    from cooper_mcore.demo.assets import build_tiny_assets

    paths = build_tiny_assets(str(tmp_path / "assets"), n_train=32, n_eval=8)
    out = tmp_path / "run"
    env = dict(os.environ, DRY_RUN="0", NNODES="1", GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RDZV_ID="test", PYTHON=sys.executable, OMP_NUM_THREADS="1",
               WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    for k in ("ASSISTANT_URL", "ASSISTANT_MODEL_PATH"):
        env.pop(k, None)
    overrides = [f"out={out}", f"model.policy_ckpt={paths['policy_ckpt']}", f"model.policy_hf={paths['policy_hf']}",
                 f"model.rm_ckpt={paths['rm_ckpt']}", f"data.train_path={paths['train']}", "train.steps=1",
                 "eval.every=0", "checkpoint.every=0", "logging.wandb=false", "rollout.max_new_tokens=8"]
    r = subprocess.run(["bash", str(ROOT / "examples" / "launch_multinode.sh"), "examples/tiny_cpu.yaml",
                        *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    assert rows[0]["ratio/mean"] == pytest.approx(1.0) and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
