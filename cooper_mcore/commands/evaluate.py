"""``cooper eval`` (a policy's held-out accuracy) and ``cooper eval-rm`` (a VerifyRM's)."""

from __future__ import annotations

import argparse
import json

from cooper_mcore.jobs.evaluate import evaluate_policy
from cooper_mcore.jobs.verify_rm import eval_rm as eval_rm_job
from cooper_mcore.parallel import ParallelConfig


def evaluate(args: argparse.Namespace) -> None:
    result = evaluate_policy(args.model, args.data, k=args.k, temperature=args.temperature, top_p=args.top_p,
                             max_new_tokens=args.max_new_tokens, template=args.template,
                             use_chat_template=args.chat_template, limit=args.limit, seed=args.seed)
    print(json.dumps(result), flush=True)


def eval_rm(args: argparse.Namespace) -> None:
    result = eval_rm_job(args.ckpt, args.data, parallel=ParallelConfig(tp=args.tp, pp=args.pp),
                         micro_batch_size=args.micro_batch_size, threshold=args.threshold, data_format=args.format,
                         predictions_path=args.predictions)
    print(json.dumps(result, default=str), flush=True)
