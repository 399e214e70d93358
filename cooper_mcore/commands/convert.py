"""``cooper convert``: HF <-> Megatron checkpoints."""

from __future__ import annotations

import argparse
import logging

from cooper_mcore.convert.hf import hf_to_mcore, mcore_to_hf

logger = logging.getLogger("cooper_mcore")


def convert(args: argparse.Namespace) -> None:
    if args.direction == "hf-to-mcore":
        hf_to_mcore(args.hf_dir, args.out, args.model_type, head_std=args.head_std)
    else:
        mcore_to_hf(args.ckpt, args.out, max_shard_bytes=int(args.max_shard_gib * 2**30), tokenizer=args.tokenizer)
    logger.info("done: %s", args.out)
