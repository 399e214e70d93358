"""``cooper verify`` (the rule verifier on a file) and ``cooper annotate`` (hybrid labels)."""

from __future__ import annotations

import argparse
import json

from cooper_mcore.commands import check_output_file
from cooper_mcore.jobs.annotate import annotate as annotate_file
from cooper_mcore.llm_client import OpenAIChatClient
from cooper_mcore.redaction import install_log_filter
from cooper_mcore.verify.rule import RuleVerifier, verify_jsonl


def verify(args: argparse.Namespace) -> None:
    check_output_file(args.out)
    summary = verify_jsonl(args.inp, args.out, timeout_s=args.timeout, num_workers=args.workers,
                           gold_key=args.gold_key, pred_key=args.pred_key)
    print(json.dumps(summary), flush=True)  # the summary line


def annotate(args: argparse.Namespace) -> None:
    check_output_file(args.out)
    install_log_filter([args.api_key_env])
    client = OpenAIChatClient(args.judge_url, args.judge_model, api_key_env=args.api_key_env,
                              max_retries=args.judge_retries, timeout_s=args.judge_timeout)
    with RuleVerifier(timeout_s=args.verifier_timeout, num_workers=args.workers) as verifier:
        stats = annotate_file(args.inp, args.out, client, verifier, skip_malformed=args.skip_malformed,
                              judgements_path=args.judgements, on_judge_failure=args.on_judge_failure)
    print(json.dumps(stats, default=str), flush=True)
