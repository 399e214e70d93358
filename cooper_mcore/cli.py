"""The ``cooper`` command (also ``python -m cooper_mcore``).

Subcommands are thin: they parse arguments and call one library function.

    cooper convert hf-to-mcore --hf-dir D --out D [--model-type causal_lm|reward] [--head-std S]
    cooper convert mcore-to-hf --ckpt D --out D
    cooper verify --in F.jsonl --out G.jsonl [--timeout S] [--workers N]
    cooper tiny-assets --out DIR
    cooper eval --model CKPT_OR_HF --data F.jsonl [--k 8]
    cooper train-rm --ckpt RM --train F.jsonl --out DIR [--eval VB.jsonl]
    cooper eval-rm --ckpt RM --data VB.jsonl
    cooper annotate --in F.jsonl --out G.jsonl --judge-url URL --judge-model M
    cooper train --config examples/tiny_cpu.yaml [--out DIR] [--resume auto] [key=value ...]
    cooper config --show [--config X] [key=value ...]
    cooper demo [--full] [--out DIR] [key=value ...]
    cooper plan --config X --gpus-per-node N --gpu-memory-gib M [--nodes K] [--json] [key=value ...]
    cooper rehearse --config X [--out DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
import warnings

from cooper_mcore.config import format_settings, load_config
from cooper_mcore.convert.checkpoint import hf_to_mcore, mcore_to_hf
from cooper_mcore.demo import load_demo_config, run_demo
from cooper_mcore.demo.assets import build_tiny_assets
from cooper_mcore.demo.pipeline import describe
from cooper_mcore.jobs.evaluate import evaluate_policy
from cooper_mcore.jobs.verify_rm import eval_rm, train_rm
from cooper_mcore.models.arch import ArchSpec, load_hf_config
from cooper_mcore.parallel import ParallelConfig
from cooper_mcore.plan import AssistantSpec, PlanOptions, plan
from cooper_mcore.plan_report import format_plan, load_shapes, plan_to_dict
from cooper_mcore.redaction import install_log_filter
from cooper_mcore.rehearsal.run import Limits, rehearse_preset
from cooper_mcore.reward.annotate import annotate
from cooper_mcore.reward.negatives import AssistantUnavailable
from cooper_mcore.reward.openai_client import OpenAIChatClient
from cooper_mcore.reward.verifier import RuleVerifier, verify_jsonl
from cooper_mcore.rl.loop import TrainingStopped, train

logger = logging.getLogger("cooper_mcore")
#: errors that are the user's to fix: one clear line, no traceback
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, TrainingStopped, AssistantUnavailable)


def _convert(args: argparse.Namespace) -> None:
    if args.direction == "hf-to-mcore":
        hf_to_mcore(args.hf_dir, args.out, args.model_type, head_std=args.head_std)
    else:
        mcore_to_hf(args.ckpt, args.out, max_shard_bytes=int(args.max_shard_gib * 2**30))
    logger.info("done: %s", args.out)


def _verify(args: argparse.Namespace) -> None:
    summary = verify_jsonl(args.inp, args.out, timeout_s=args.timeout, num_workers=args.workers,
                           gold_key=args.gold_key, pred_key=args.pred_key)
    print(json.dumps(summary), flush=True)  # the summary line


def _train(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    install_log_filter([cfg.rm.api_key_env])
    if args.out:
        cfg.out = args.out
    if args.resume:
        cfg.checkpoint.resume = args.resume
    train(cfg)


def _eval(args: argparse.Namespace) -> None:
    result = evaluate_policy(args.model, args.data, k=args.k, temperature=args.temperature, top_p=args.top_p,
                             max_new_tokens=args.max_new_tokens, template=args.template,
                             use_chat_template=args.chat_template, limit=args.limit, seed=args.seed)
    print(json.dumps(result), flush=True)


def _train_rm(args: argparse.Namespace) -> None:
    summary = train_rm(args.ckpt, args.train, args.out, eval_path=args.eval, epochs=args.epochs, lr=args.lr,
                       weight_decay=args.weight_decay, micro_batch_size=args.micro_batch_size,
                       global_batch_size=args.global_batch_size, eval_every=args.eval_every,
                       save_every=args.save_every, seed=args.seed, parallel=ParallelConfig(tp=args.tp, pp=args.pp),
                       max_length=args.max_length, skip_malformed=args.skip_malformed)
    print(json.dumps(summary, default=str), flush=True)


def _eval_rm(args: argparse.Namespace) -> None:
    result = eval_rm(args.ckpt, args.data, parallel=ParallelConfig(tp=args.tp, pp=args.pp),
                     micro_batch_size=args.micro_batch_size, threshold=args.threshold, data_format=args.format,
                     predictions_path=args.predictions)
    print(json.dumps(result, default=str), flush=True)


def _annotate(args: argparse.Namespace) -> None:
    install_log_filter([args.api_key_env])
    client = OpenAIChatClient(args.judge_url, args.judge_model, api_key_env=args.api_key_env,
                              max_retries=args.judge_retries, timeout_s=args.judge_timeout)
    with RuleVerifier(timeout_s=args.verifier_timeout, num_workers=args.workers) as verifier:
        stats = annotate(args.inp, args.out, client, verifier, skip_malformed=args.skip_malformed,
                         judgements_path=args.judgements, on_judge_failure=args.on_judge_failure)
    print(json.dumps(stats, default=str), flush=True)


def _tiny_assets(args: argparse.Namespace) -> None:
    for name, path in build_tiny_assets(args.out).items():
        print(f"{name}: {path}")


def _demo(args: argparse.Namespace) -> None:
    cfg = load_demo_config("full" if args.full else args.preset, args.overrides)
    if args.out:
        cfg.out = args.out
    logger.info("%s", describe(cfg))
    run_demo(cfg)


def _plan(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    policy, rm, notes = load_shapes(cfg, args.policy_config, args.rm_config)
    assistant: AssistantSpec | str = "none" if args.no_assistant else "auto"
    if not args.no_assistant and (args.assistant_config or args.assistant_tp or args.assistant_mem_fraction):
        path = args.assistant_config
        arch = policy
        if path:  # an HF config file, or the model folder that holds its config.json
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    arch = ArchSpec.from_hf_config(json.load(f))
            else:
                arch = ArchSpec.from_hf_config(load_hf_config(path))
        assistant = AssistantSpec(arch, tp=args.assistant_tp or cfg.parallel.tp,
                                  mem_fraction=args.assistant_mem_fraction)
    result = plan(cfg, policy, rm, PlanOptions(
        gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory_gib, nodes=args.nodes,
        prompt_tokens=args.prompt_tokens, overhead_gib=args.overhead_gib, recompute=args.recompute,
        assistant=assistant))
    if args.json:
        print(json.dumps(plan_to_dict(result, cfg, notes), indent=2), flush=True)
    else:
        print(format_plan(result, cfg, notes), flush=True)  # the report table


def _rehearse(args: argparse.Namespace) -> int:
    report = rehearse_preset(args.config, args.overrides, out=args.out, policy_config=args.policy_config,
                             rm_config=args.rm_config,
                             limits=Limits(startup_s=args.startup_timeout, step_s=args.step_timeout))
    print(report.format(), flush=True)  # the report, its verdict line last
    return 0 if report.ok else 1


def _config(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    print(format_settings(cfg), flush=True)  # the listing


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
    h2m.add_argument("--head-std", type=float, default=None,
                     help="std of a new reward head (reward from a causal LM); default the config's "
                          "initializer_range; 0: a zero head")
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

    co = sub.add_parser("config", help="list every `cooper train` setting with its value and doc")
    co.add_argument("--show", action="store_true", help="print every key=value with its one-line doc (the default)")
    co.add_argument("--config", default=None, help="YAML preset whose values to show (default: the defaults)")
    co.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.kl_coef=0.01")
    co.set_defaults(func=_config)

    ev = sub.add_parser("eval", help="held-out avg@k accuracy of a policy (HF folder or Megatron checkpoint)")
    ev.add_argument("--model", required=True,
                    help="HF folder, converted checkpoint, or <run>/checkpoints/step_N/policy")
    ev.add_argument("--data", required=True, help="JSONL/Parquet with question and answer")
    ev.add_argument("--k", type=int, default=8)
    ev.add_argument("--temperature", type=float, default=0.7)
    ev.add_argument("--top-p", type=float, default=0.95)
    ev.add_argument("--max-new-tokens", type=int, default=512)
    ev.add_argument("--template", default="{question}")
    ev.add_argument("--chat-template", action="store_true", help="use the tokenizer's chat template")
    ev.add_argument("--limit", type=int, default=0)
    ev.add_argument("--seed", type=int, default=0)
    ev.set_defaults(func=_eval)

    trm = sub.add_parser("train-rm", help="train VerifyRM with BCE on labeled (question, reference, completion)")
    trm.add_argument("--ckpt", required=True,
                     help="reward-model checkpoint to start from (hf-to-mcore --model-type reward)")
    trm.add_argument("--train", required=True, help="JSONL/Parquet: question, reference, completion, label")
    trm.add_argument("--out", required=True)
    trm.add_argument("--eval", default=None, help="VerifyBench-format or labeled eval data")
    trm.add_argument("--epochs", type=int, default=3)
    trm.add_argument("--lr", type=float, default=2e-5)
    trm.add_argument("--weight-decay", type=float, default=0.01)
    trm.add_argument("--micro-batch-size", type=int, default=4)
    trm.add_argument("--global-batch-size", type=int, default=32)
    trm.add_argument("--eval-every", type=int, default=0)
    trm.add_argument("--save-every", type=int, default=0)
    trm.add_argument("--max-length", type=int, default=None)
    trm.add_argument("--seed", type=int, default=1234)
    trm.add_argument("--tp", type=int, default=1)
    trm.add_argument("--pp", type=int, default=1)
    trm.add_argument("--skip-malformed", action="store_true")
    trm.set_defaults(func=_train_rm)

    erm = sub.add_parser("eval-rm", help="VerifyRM accuracy (threshold 0.5), per answer type")
    erm.add_argument("--ckpt", required=True)
    erm.add_argument("--data", required=True, help="VerifyBench-format or labeled JSONL")
    erm.add_argument("--format", default="auto", choices=["auto", "labeled", "verifybench"])
    erm.add_argument("--micro-batch-size", type=int, default=8)
    erm.add_argument("--threshold", type=float, default=0.5)
    erm.add_argument("--predictions", default=None, help="write per-item scores here")
    erm.add_argument("--tp", type=int, default=1)
    erm.add_argument("--pp", type=int, default=1)
    erm.set_defaults(func=_eval_rm)

    an = sub.add_parser("annotate", help="hybrid labels: rule verifier and LLM judge, keep agreements")
    an.add_argument("--in", dest="inp", required=True, help="JSONL/Parquet: question, reference, completion")
    an.add_argument("--out", required=True)
    an.add_argument("--judge-url", required=True, help="OpenAI-compatible endpoint of the judge")
    an.add_argument("--judge-model", required=True)
    an.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    an.add_argument("--judgements", default=None, help="also write every raw judgement here")
    an.add_argument("--judge-retries", type=int, default=3, help="retries per judge request (exponential backoff)")
    an.add_argument("--judge-timeout", type=float, default=60.0, help="seconds per judge request attempt")
    an.add_argument("--on-judge-failure", choices=["mask", "stop"], default="mask",
                    help="a judge request that fails after its retries: drop that row and count it (mask), "
                         "or stop with an error naming the endpoint (stop)")
    an.add_argument("--verifier-timeout", type=float, default=5.0)
    an.add_argument("--workers", type=int, default=2)
    an.add_argument("--skip-malformed", action="store_true")
    an.set_defaults(func=_annotate)

    ta = sub.add_parser("tiny-assets", help="write tiny CPU assets (prompts, tokenizer, tiny policy and RM)")
    ta.add_argument("--out", default="runs/tiny_assets")
    ta.set_defaults(func=_tiny_assets)

    demo = sub.add_parser("demo", help="the embedded default job: rule vs static RM vs Cooper on a tiny CPU setup")
    demo.add_argument("--out", default="", help="output folder (default runs/demo, runs/demo_full with --full)")
    demo.add_argument("--full", action="store_true", help="the longer, bigger preset (within an hour on 2 cores)")
    demo.add_argument("--preset", choices=["smoke"], default=None, help="smoke: every stage at the smallest size")
    demo.add_argument("overrides", nargs="*", help="dotted settings, e.g. rl.steps=60 (cooper_mcore/demo/config.py)")
    demo.set_defaults(func=_demo)

    pl = sub.add_parser("plan", help="predict per-GPU memory per phase and the offload settings a run needs")
    pl.add_argument("--config", default=None, help="YAML preset (examples/*.yaml)")
    pl.add_argument("--gpus-per-node", type=int, required=True)
    pl.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU, e.g. 80")
    pl.add_argument("--nodes", type=int, default=1)
    pl.add_argument("--policy-config", default=None, help="the policy's HF config.json (default: model.policy_hf)")
    pl.add_argument("--rm-config", default=None, help="the reward model's HF config.json (default: model.rm_ckpt)")
    pl.add_argument("--prompt-tokens", type=int, default=512, help="the longest prompt in tokens")
    pl.add_argument("--overhead-gib", type=float, default=2.0,
                    help="per-GPU allowance for NCCL buffers, CUDA graphs and fragmentation (CUDA contexts are "
                         "counted separately, per process)")
    pl.add_argument("--no-assistant", action="store_true", help="count no colocated assistant server")
    pl.add_argument("--assistant-config", default=None,
                    help="the colocated assistant's HF config.json (default: the policy's shape)")
    pl.add_argument("--assistant-tp", type=int, default=None, help="GPUs per assistant replica (default: parallel.tp)")
    pl.add_argument("--assistant-mem-fraction", type=float, default=None,
                    help="the assistant's --mem-fraction-static (default: derived from its size, as the launcher)")
    pl.add_argument("--recompute", action="store_true", help="plan with full activation recomputation")
    pl.add_argument("--json", action="store_true", help="print JSON (top-level boolean 'fits')")
    pl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2 train.micro_batch_size=4")
    pl.set_defaults(func=_plan)

    rh = sub.add_parser("rehearse", help="run a preset's job on CPU with a tiny model of its family: its layout and "
                                         "features, evaluation, checkpoints, a stop signal and a resume, in minutes")
    rh.add_argument("--config", required=True, help="the preset (examples/*.yaml)")
    rh.add_argument("--out", default="", help="rehearsal folder (default runs/rehearse/<preset name>; tiny assets "
                                              "are cached beside it)")
    rh.add_argument("--policy-config", default=None, help="the policy's HF config.json (default: model.policy_hf, "
                                                          "else model_configs/ beside the preset)")
    rh.add_argument("--rm-config", default=None, help="the reward model's HF config.json (default: the policy's "
                                                      "backbone with a scalar head)")
    rh.add_argument("--step-timeout", type=float, default=Limits.step_s,
                    help="seconds one step may take before the run counts as hung (default %(default)s)")
    rh.add_argument("--startup-timeout", type=float, default=Limits.startup_s,
                    help="seconds from launch to the first step (default %(default)s)")
    rh.add_argument("overrides", nargs="*", help="dotted overrides applied to the preset, e.g. parallel.tp=2")
    rh.set_defaults(func=_rehearse)
    return p


def _quiet_known_warnings() -> None:
    """Hide warnings that megatron-core 0.16 and torch raise on every run and a user cannot act on
    (deprecated collectives inside megatron, its optimizer probing ``.grad`` of non-leaf tensors);
    ``--verbose`` shows them."""
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)")
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    if not args.verbose:
        logging.getLogger("megatron").setLevel(logging.WARNING)
        _quiet_known_warnings()
    install_log_filter()  # no API key from the environment in any log line
    if threading.current_thread() is threading.main_thread():  # signal handlers are set there only
        # `kill -USR2 <pid>` prints every thread's stack: where a hung rank waits (the rehearsal asks for it)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
        rc = args.func(args)
    except USER_ERRORS as e:
        logger.error("%s", e.args[0] if e.args else e)
        return getattr(e, "exit_code", 2)  # train: 75 preempted (SIGTERM/SIGUSR1), 3 non-finite stop; else 2
    except Exception:
        logger.exception("unexpected error (a bug, or an environment problem the message names); please report "
                         "it with this traceback")
        return 1
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
