"""``cooper tiny-assets`` (tiny CPU models and data) and ``cooper demo`` (the embedded default job)."""

from __future__ import annotations

import argparse
import logging

from cooper_mcore.commands import check_output_folder
from cooper_mcore.config.schema import format_settings
from cooper_mcore.demo import load_demo_config, run_demo
from cooper_mcore.demo.assets import build_tiny_assets
from cooper_mcore.demo.pipeline import describe

logger = logging.getLogger("cooper_mcore")


def tiny_assets(args: argparse.Namespace) -> None:
    check_output_folder(args.out)
    for name, path in build_tiny_assets(args.out, family=args.family, rm_family=args.rm_family).items():
        print(f"{name}: {path}")


def demo(args: argparse.Namespace) -> None:
    cfg = load_demo_config("full" if args.full else args.preset, args.overrides)
    if args.out:
        cfg.out = args.out
    if args.show:
        print(format_settings(cfg), flush=True)  # the listing, as cooper config --show
        return
    check_output_folder(cfg.out)
    logger.info("%s", describe(cfg))
    run_demo(cfg)
