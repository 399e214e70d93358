"""The ``cooper`` command (also ``python -m cooper_mcore``).

Subcommands are thin: they parse arguments and call one library function.

    cooper convert hf-to-mcore --hf-dir D --out D [--model-type causal_lm|reward]
    cooper convert mcore-to-hf --ckpt D --out D
    cooper verify --in F.jsonl --out G.jsonl [--timeout S] [--workers N]
    cooper tiny-assets --out DIR
    cooper train --config examples/tiny_cpu.yaml [--out DIR] [--resume auto] [key=value ...]
    cooper demo [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

logger = logging.getLogger("cooper_mcore")


def _convert(args: argparse.Namespace) -> None:
    from cooper_mcore.convert.checkpoint import hf_to_mcore, mcore_to_hf

    if args.direction == "hf-to-mcore":
        hf_to_mcore(args.hf_dir, args.out, args.model_type)
    else:
        mcore_to_hf(args.ckpt, args.out, max_shard_bytes=int(args.max_shard_gib * 2**30))
    logger.info("done: %s", args.out)


def _verify(args: argparse.Namespace) -> None:
    from cooper_mcore.reward.verifier import verify_jsonl

    summary = verify_jsonl(args.inp, args.out, timeout_s=args.timeout, num_workers=args.workers,
                           gold_key=args.gold_key, pred_key=args.pred_key)
    print(json.dumps(summary), flush=True)  # the summary line


def _train(args: argparse.Namespace) -> None:
    from cooper_mcore.config import load_config
    from cooper_mcore.train.cooper import train

    cfg = load_config(args.config, args.overrides)
    if args.out:
        cfg.out = args.out
    if args.resume:
        cfg.checkpoint.resume = args.resume
    train(cfg)


def _tiny_assets(args: argparse.Namespace) -> None:
    from cooper_mcore.demo.assets import build_tiny_assets

    for name, path in build_tiny_assets(args.out).items():
        print(f"{name}: {path}")


def _demo(args: argparse.Namespace) -> None:
    from cooper_mcore.demo import run_demo

    run_demo(args.out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cooper", description="Cooper RL on Megatron-core")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="convert checkpoints between HF and Megatron formats")
    csub = conv.add_subparsers(dest="direction", required=True)
    h2m = csub.add_parser("hf-to-mcore", help="HF safetensors folder -> Megatron dist checkpoint")
    h2m.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    h2m.add_argument("--out", required=True, help="output checkpoint folder (must not exist)")
    h2m.add_argument("--model-type", choices=["causal_lm", "reward"], default=None,
                     help="default: from the config's architecture")
    m2h = csub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors folder")
    m2h.add_argument("--ckpt", required=True, help="checkpoint folder written by hf-to-mcore/training")
    m2h.add_argument("--out", required=True, help="output HF folder (must not exist)")
    m2h.add_argument("--max-shard-gib", type=float, default=5.0, help="safetensors shard size")
    conv.set_defaults(func=_convert)

    ver = sub.add_parser("verify", help="check predictions against gold answers with math-verify")
    ver.add_argument("--in", dest="inp", required=True, help="JSONL with 'gold' and 'pred' on each line")
    ver.add_argument("--out", required=True, help="JSONL: each input line plus 'correct' (true/false/null) "
                     "and 'seconds'")
    ver.add_argument("--timeout", type=float, default=5.0, help="hard per-item timeout (s)")
    ver.add_argument("--workers", type=int, default=2, help="verifier processes")
    ver.add_argument("--gold-key", default="gold")
    ver.add_argument("--pred-key", default="pred")
    ver.set_defaults(func=_verify)

    tr = sub.add_parser("train", help="Cooper RL (reward modes: rule, static_rm, cooper); run under torchrun")
    tr.add_argument("--config", default=None, help="YAML preset (examples/*.yaml)")
    tr.add_argument("--out", default=None, help="run folder (config.yaml, metrics.jsonl, checkpoints/)")
    tr.add_argument("--resume", default=None, help="'auto', 'none' or a checkpoint folder")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01 reward.mode=rule")
    tr.set_defaults(func=_train)

    ta = sub.add_parser("tiny-assets", help="write tiny CPU assets (prompts, tokenizer, tiny policy and RM)")
    ta.add_argument("--out", default="runs/tiny_assets")
    ta.set_defaults(func=_tiny_assets)

    demo = sub.add_parser("demo", help="the embedded default job (tiny, CPU)")
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    if not args.verbose:
        logging.getLogger("megatron").setLevel(logging.WARNING)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as e:
        logger.error("%s", e.args[0] if e.args else e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
