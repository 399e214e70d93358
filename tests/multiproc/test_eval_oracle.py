"""`cooper train` with the arithmetic oracle as the held-out checker: eval/acc is the oracle's,
eval/rule_acc the rule verifier's, and each evaluation's completions are saved with both verdicts
(one file per data-parallel replica)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.multiproc

ROW_KEYS = ["prompt_id", "question", "reference", "completion", "rule_correct", "correct"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from cooper_mcore.demo.assets import build_tiny_assets

    # no SFT: what is checked is where the verdicts go, not how good the policy is
    return build_tiny_assets(str(tmp_path_factory.mktemp("assets")), n_train=16, n_eval=8, sft_steps=0)


@pytest.mark.parametrize("nproc", [1, 2])
def test_train_evaluates_by_the_oracle_and_saves_the_samples(assets, tmp_path, nproc):
    out = tmp_path / "run"
    args = ["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--out", str(out),
            f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"data.train_path={assets['train']}", f"data.eval_path={assets['eval']}", "reward.mode=rule",
            "logging.wandb=false", "train.steps=2", "train.prompts_per_step=2", "rollout.group_size=2",
            "train.micro_batch_size=2", "rollout.max_new_tokens=8", "eval.every=1", "eval.max_new_tokens=8",
            "data.eval_limit=3", "eval.k=2", "checkpoint.every=0", "eval.verifier=arithmetic_oracle",
            "eval.save_samples=true"]
    cmd = [sys.executable, "-m", "cooper_mcore", *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "-m", "cooper_mcore", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    names = ["step_{}.jsonl"] if nproc == 1 else ["step_{}.dp0.jsonl", "step_{}.dp1.jsonl"]
    assert sorted(os.listdir(out / "eval_samples")) == sorted(n.format(s) for s in (1, 2) for n in names)
    for m in metrics:
        rows = [json.loads(line) for n in names for line in open(out / "eval_samples" / n.format(m["step"]))]
        assert len(rows) == 3 * 2 and all(list(r) == ROW_KEYS for r in rows)  # 3 prompts, k = 2, split over dp
        assert m["eval/acc"] == pytest.approx(sum(bool(r["correct"]) for r in rows) / len(rows))
        assert m["eval/rule_acc"] == pytest.approx(sum(bool(r["rule_correct"]) for r in rows) / len(rows))
