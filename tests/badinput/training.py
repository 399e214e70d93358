"""Runs that cannot train: data whose every reference the rule verifier cannot read (warned at the start,
stopped after ``train.max_steps_without_signal`` steps with the checkpoint kept), and an assistant endpoint
that does not answer (stopped before step 1)."""

from __future__ import annotations

import json
import socket

from cooper_mcore.data.mathgen import unreadable_reference
from tests.badinput.case import TINY_RUN, Case, Env

SHORT = ("train.steps=3", "eval.every=0", "checkpoint.every=0", "rollout.max_new_tokens=4")


def unreadable_references(env: Env) -> dict[str, str]:
    """``{tmp}/train.jsonl``: eight prompts whose references are all ``\\text{N.}``, which the rule cannot read."""
    (env.tmp / "train.jsonl").write_text("".join(
        json.dumps({"question": f"{i}+1=", "answer": unreadable_reference(i + 1)}) + "\n" for i in range(8)))
    return {}


def closed_port(env: Env) -> dict[str, str]:
    """``{url}``: an endpoint nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return {"url": f"http://127.0.0.1:{s.getsockname()[1]}"}


CASES = [
    Case("train on references the rule cannot read", ("train", *TINY_RUN, "--out", "{tmp}/run", *SHORT,
                                                      "data.train_path={tmp}/train.jsonl", "reward.mode=rule",
                                                      "train.max_steps_without_signal=2"),
         ("stopping: 2 steps in a row without a rule verdict on any rollout (100% of the last step's prompts have a "
          "reference the rule verifier cannot read): reward.mode=rule has no reward to train on; checkpoint "
          "{tmp}/run/checkpoints/step_2 kept; check the references of data.train_path {tmp}/train.jsonl",),
         unreadable_references, leaves=("run", "run/*"), kept=("run/checkpoints/step_2", "run/metrics.jsonl"),
         warns=("cannot read the reference", "8 of the first 8 prompts (100%) of data.train_path {tmp}/train.jsonl")),
    # the first SLURM example trained with every pair masked
    Case("train with an assistant that does not answer", ("train", *TINY_RUN, "--out", "{tmp}/run", *SHORT,
                                                          "rm.negatives=assistant", "rm.assistant_url={url}",
                                                          "rm.assistant_model=tiny"),
         ("{url}/v1/models does not answer", "rm.assistant_url"), closed_port),
]
