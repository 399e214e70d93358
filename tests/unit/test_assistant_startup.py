"""A Cooper run with assistant negatives checks its assistant endpoint once, before step 1: a live one
lets the run start (a dead one stops it with one line naming the URL before anything is written: a
case of the bad-input tier, ``tests/badinput/training.py``); steps without a valid pair warn."""

from __future__ import annotations

import dataclasses
import logging

from cooper_mcore.cli import main as cli_main
from cooper_mcore.demo.assets import build_tiny_assets
from tests.chat_server import ChatServer
from tests.conftest import ROOT


def _args(assets, out, url):
    return ["train", "--config", str(ROOT / "examples" / "tiny_cpu.yaml"), "--out", str(out),
            f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"model.rm_ckpt={assets['rm_ckpt']}", f"data.train_path={assets['train']}",
            f"data.eval_path={assets['eval']}", "logging.wandb=false", "rm.negatives=assistant",
            f"rm.assistant_url={url}", "rm.assistant_model=tiny", "train.steps=1", "eval.every=0",
            "checkpoint.every=0", "rollout.max_new_tokens=4"]


def test_live_assistant_lets_the_run_start(tmp_path):
    assets = build_tiny_assets(str(tmp_path / "assets"), n_train=32, n_eval=4)
    server = ChatServer(canned="1+1=3 \\\\boxed{3}").start()
    try:
        assert cli_main(_args(assets, tmp_path / "run", server.url)) == 0
    finally:
        server.stop()
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_steps_without_a_valid_pair_warn_loudly(tmp_path, caplog):
    """A Cooper run in which no pair is valid for N steps in a row says so (a random
    policy solves nothing, so no prompt has a positive)."""
    from cooper_mcore.data.datasets import read_prompts, write_prompts

    assets = build_tiny_assets(str(tmp_path / "assets"), n_train=32, n_eval=4, sft_steps=0)
    # a random policy can still hit a small answer by luck (the rule reads its last number), so every
    # reference is made one it cannot write: 7 digits, one token each, in 4 new tokens
    prompts, _ = read_prompts(assets["train"])
    write_prompts([dataclasses.replace(p, answer="1000000") for p in prompts], assets["train"])
    args = [a for a in _args(assets, tmp_path / "run", "unused") if not a.startswith(("rm.negatives", "rm.assistant"))]
    with caplog.at_level(logging.WARNING):
        assert cli_main([*args, "rm.negatives=rewrite", "train.steps=2", "train.max_steps_without_pairs=2"]) == 0
    warned = [r.getMessage() for r in caplog.records if "without a single valid reward-model pair" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("2 steps in a row") and "pairs/no_positive" in warned[0]
