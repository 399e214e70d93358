"""``cooper train``: the Cooper trainer (``cooper config``, which lists its settings, is
:mod:`cooper_mcore.config.show`)."""

from __future__ import annotations

import argparse

from cooper_mcore.commands import check_output_folder
from cooper_mcore.config.schema import load_config
from cooper_mcore.redaction import install_log_filter
from cooper_mcore.rl.loop import train as train_run


def train(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    install_log_filter([cfg.rm.api_key_env])
    if args.out:
        cfg.out = args.out
    if args.resume:
        cfg.checkpoint.resume = args.resume
    if args.overwrite:
        cfg.checkpoint.overwrite = True
    if args.allow_config_change:
        cfg.checkpoint.allow_config_change = True
    check_output_folder(cfg.out)
    train_run(cfg)

