"""``cooper sft`` (SFT of a policy) and ``cooper train-rm`` (VerifyRM training): a typed job config
(:class:`~cooper_mcore.config.schema.SFTConfig`, :class:`~cooper_mcore.config.schema.VerifyRMConfig`) from a YAML
preset and dotted overrides, as ``cooper train``'s; the path flags are shortcuts for their settings."""

from __future__ import annotations

import argparse
import json
import os

from cooper_mcore.checkpoint.tokenizer import load_checkpoint_tokenizer
from cooper_mcore.commands import check_output_folder
from cooper_mcore.config.schema import SFTConfig, VerifyRMConfig, load_config
from cooper_mcore.jobs.sft import math_sft_examples
from cooper_mcore.jobs.sft import sft as sft_job
from cooper_mcore.jobs.verify_rm import train_rm as train_rm_job


def sft(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides, cls=SFTConfig)
    cfg.ckpt = args.ckpt or cfg.ckpt
    cfg.out = args.out or cfg.out
    if not cfg.ckpt:
        raise ValueError("cooper sft needs a checkpoint to start from: --ckpt or ckpt=... (or the preset's ckpt)")
    check_output_folder(os.path.dirname(os.path.abspath(cfg.out)))
    d = cfg.data
    examples = math_sft_examples(load_checkpoint_tokenizer(cfg.ckpt), d.num_examples, seed=d.seed,
                                 template=d.template, mix_wrong=d.mix_wrong, style=d.style,
                                 use_chat_template=d.use_chat_template)
    history = sft_job(cfg, examples)
    print(json.dumps({"out": cfg.out, "steps": history["steps"], "loss_first": history["loss"][0],  # the summary
                      "loss_last": history["loss"][-1], "tokens": history["tokens"],
                      "seconds": history["seconds"]}), flush=True)


def train_rm(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides, cls=VerifyRMConfig)
    cfg.ckpt = args.ckpt or cfg.ckpt
    cfg.out = args.out or cfg.out
    cfg.data.train_path = args.train or cfg.data.train_path
    cfg.data.eval_path = args.eval or cfg.data.eval_path
    for name, value in (("--ckpt or ckpt=...", cfg.ckpt), ("--train or data.train_path=...", cfg.data.train_path)):
        if not value:
            raise ValueError(f"cooper train-rm needs {name} (or the preset's)")
    check_output_folder(cfg.out)
    summary = train_rm_job(cfg)
    print(json.dumps(summary, default=str), flush=True)  # the summary line
