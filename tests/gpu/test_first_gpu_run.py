"""GPU tier: the first GPU run, end to end (skipped without CUDA).

A tiny policy and VerifyRM in bf16 train for two Cooper steps with `cooper train` on one GPU: the
optimizers are built with the process groups the CUDA path creates (NCCL, no gloo twins), the RM
scores travel through the device-side collectives, the transformers engine releases and resumes its
memory around generation, and a training checkpoint is written; a second run resumes from it on
the GPU and takes one more step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


def _bf16_assets(root) -> dict[str, str]:
    import transformers

    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.demo.assets import build_tiny_assets

    paths = build_tiny_assets(str(root / "fp32"), n_train=64, n_eval=8)
    for kind, auto in (("policy", transformers.AutoModelForCausalLM),
                       ("rm", transformers.AutoModelForSequenceClassification)):
        src, dst = paths[f"{kind}_hf"], str(root / f"{kind}_bf16_hf")
        auto.from_pretrained(src, dtype=torch.float32).to(torch.bfloat16).save_pretrained(dst)
        for name in os.listdir(src):
            if name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(src, name), dst)
        paths[f"{kind}_hf"] = dst
        paths[f"{kind}_ckpt"] = str(root / f"{kind}_bf16_mcore")
        hf_to_mcore(dst, paths[f"{kind}_ckpt"])
    return paths


def _train(paths, out, *overrides):
    args = [sys.executable, "-m", "cooper_mcore", "train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
            "--out", str(out), f"model.policy_ckpt={paths['policy_ckpt']}", f"model.policy_hf={paths['policy_hf']}",
            f"model.rm_ckpt={paths['rm_ckpt']}", "model.dtype=bfloat16", f"data.train_path={paths['train']}",
            f"data.eval_path={paths['eval']}", "logging.wandb=false", "rm.negatives=perturb",
            "rollout.max_new_tokens=16", "eval.every=2", "checkpoint.every=2", *overrides]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, WANDB_MODE="disabled"))
    assert r.returncode == 0, r.stderr[-6000:]
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_tiny_bf16_cooper_steps_checkpoint_and_resume_on_a_gpu(tmp_path):
    paths = _bf16_assets(tmp_path)
    first = _train(paths, tmp_path / "run", "train.steps=2")
    assert [m["step"] for m in first] == [1, 2]
    for m in first:
        assert all(math.isfinite(m[k]) for k in ("loss", "reward/mean", "grad_norm", "rm/loss")), m
        assert m["skipped/nonfinite"] == 0.0
    assert 0.0 <= first[-1]["eval/acc"] <= 1.0
    step2 = tmp_path / "run" / "checkpoints" / "step_2"
    assert (step2 / "manifest.json").exists() and (step2 / "rm").is_dir()
    resumed = _train(paths, tmp_path / "run", "train.steps=3", "checkpoint.resume=auto")
    assert resumed[-1]["step"] == 3 and math.isfinite(resumed[-1]["loss"])
