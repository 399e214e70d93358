"""Benchmark asynchronous rollouts against the synchronous order: tokens per second of whole tiny runs.

Each setting is one ``cooper train`` run of ``examples/tiny_cpu.yaml`` on the tiny assets (a short-SFT
policy on two-step arithmetic), in rule mode by default (``--mode``), in a fresh process:

* ``colocated``: today's order, the engine in the trainer's process (generate, then train);
* ``apart k=0``: the engine in a process of its own, each step waiting for the new policy (synchronous);
* ``apart k=1`` / ``k=2``: rollouts generated ahead, at most 1 or 2 policy versions old.

The trainer and the engine get ``--threads`` torch threads each (so on 2 cores each has one: the
disaggregated placement's GPUs apart, in miniature). Sampling at ``--temperature`` up to
``--max-new-tokens`` gives long-tailed response lengths (the table shows their mean and 90th
percentile over the run). Tokens per second: generated response tokens of the steps after the first,
over those steps' wall seconds (``time/step``). Also the trainer's wait for rollouts and the engine's
idle time (``time/trainer_wait``, ``time/engine_idle``), each summed over those steps.

    python benchmarks/async_step.py                 # 12 steps per setting, a few minutes on 2 cores
    python benchmarks/async_step.py --steps 6 --settings colocated,k1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from cooper_mcore.demo.assets import build_tiny_assets  # noqa: E402

logger = logging.getLogger("async_step")

SETTINGS = {
    "colocated": ("colocated", []),
    "k0": ("apart k=0", ["rollout.placement=disaggregated", "rollout.max_staleness=0"]),
    "k1": ("apart k=1", ["rollout.placement=disaggregated", "rollout.max_staleness=1"]),
    "k2": ("apart k=2", ["rollout.placement=disaggregated", "rollout.max_staleness=2"]),
}


def run_setting(assets: dict, out: str, extra: list[str], args: argparse.Namespace) -> list[dict]:
    """One run; its metrics lines."""
    overrides = [f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
                 f"model.rm_ckpt={assets['rm_ckpt']}", f"data.train_path={assets['train']}",
                 f"data.eval_path={assets['eval']}", "logging.wandb=false", f"reward.mode={args.mode}",
                 f"train.steps={args.steps}", "eval.every=0", "checkpoint.every=0",
                 f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
                 f"rollout.group_size={args.group_size}", f"train.prompts_per_step={args.prompts}",
                 f"train.micro_batch_size={args.prompts * args.group_size}",
                 f"rollout.engine_threads={args.threads}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "cooper_mcore", "train", "--config",
                        os.path.join(ROOT, "examples", "tiny_cpu.yaml"), "--out", out, *overrides],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"run {out} failed:\n{r.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summarize(lines: list[dict], rollouts_per_step: int) -> dict[str, float]:
    """Tokens/s and waits over the steps after the first."""
    later = lines[1:]
    tokens = sum(m["response/length"] * rollouts_per_step for m in later)
    seconds = sum(m["time/step"] for m in later)
    lengths = sorted(m["response/length"] for m in lines)
    return {"tokens_per_s": tokens / seconds, "step_s": seconds / len(later),
            "rollout_s": sum(m.get("time/rollout", 0.0) for m in later) / len(later),
            "train_s": sum(m.get("time/policy_update", 0.0) + m.get("time/logprobs", 0.0) for m in later) / len(later),
            "wait_s": sum(m.get("time/trainer_wait", 0.0) for m in later),
            "idle_s": sum(m.get("time/engine_idle", 0.0) for m in later),
            "staleness": max(m.get("rollout/staleness_max", 0.0) for m in lines),
            "len_mean": sum(lengths) / len(lengths), "len_p90": lengths[int(0.9 * (len(lengths) - 1))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--settings", default="colocated,k0,k1,k2")
    p.add_argument("--mode", default="rule", choices=["rule", "static_rm", "cooper"])
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = tempfile.mkdtemp(prefix="async_step_")
    assets = build_tiny_assets(os.path.join(work, "assets"), n_train=256, n_eval=8)
    rows = []
    for key in args.settings.split(","):
        name, extra = SETTINGS[key]
        logger.info("running %s ...", name)
        rows.append((name, summarize(run_setting(assets, os.path.join(work, key), extra, args),
                                     args.prompts * args.group_size)))
    base = rows[0][1]["tokens_per_s"]
    logger.info("\n%d steps, %s mode, %d prompts x %d rollouts, up to %d new tokens at temperature %.1f, %d thread(s) "
                "each", args.steps, args.mode, args.prompts, args.group_size, args.max_new_tokens, args.temperature,
                args.threads)
    logger.info("| setting | tokens/s | vs %s | step s | rollout s | train s | trainer wait s | engine idle s | "
                "max staleness | step mean length: mean / p90 |", rows[0][0])
    logger.info("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        logger.info("| %s | %.0f | %.2fx | %.2f | %.2f | %.2f | %.1f | %.1f | %d | %.0f / %.0f |", name,
                    r["tokens_per_s"], r["tokens_per_s"] / base, r["step_s"], r["rollout_s"], r["train_s"],
                    r["wait_s"], r["idle_s"], r["staleness"], r["len_mean"], r["len_p90"])


if __name__ == "__main__":
    main()
