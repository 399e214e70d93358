"""Fault-injection trials: kill a tiny Cooper run at chosen moments, resume it, compare bitwise.

One uninterrupted reference run, then for every trial a fresh run of the same job:

* ``kill`` trials (seeded; ``--trials``): SIGKILL at a fault point
  (:mod:`cooper_mcore.train.faults`: a training phase of a step, with a seeded random delay into
  it, or a place inside a checkpoint write), then a restart with ``--resume auto``;
* one ``sigterm`` trial: SIGTERM during step 1 (a preemption; checkpoints every 2 steps, so the
  step-1 checkpoint can only come from the handler), which must exit 75, then the restart;
* one ``corrupt`` trial: the reference's checkpoints with one flipped byte in the newest; the
  restart must report it and resume from the one before.

A trial passes when the fault took effect, the restart exited 0, and the final checkpoint
restores exactly what the reference's restores: policy and RM weights, fp32 main parameters,
Adam moments and step counts, RNG states, data position (see :func:`_state`).

Every run is ``cooper_mcore.cli.main(["train", ...])`` in a child forked from this process,
which imports torch, megatron-core and transformers once and runs no torch code itself (so
forking is safe and a run starts in about a second instead of ten); each child gets its own
process group, killed with it (as a job's helpers die with it). The job is the smallest one
that exercises everything: tiny Qwen2 policy and RM (``cooper tiny-assets`` at hidden size 32,
one layer), 8 prompts x 4 samples per step, a checkpoint every step, single-digit questions so
that the untrained policy is sometimes right and the RM gets valid pairs.

    python -m tests.harness.fault_trials --work DIR [--trials 10] [--seed 0] [--steps 3]

prints one JSON line: ``faults`` (took effect), ``resumed``, ``bitwise_equal``, ``rm_moved``,
``policy_moved`` and the trials.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from cooper_mcore.job import EXIT_PREEMPTED
from cooper_mcore.run_lock import LOCK_FILE
from cooper_mcore.train.faults import FAULT_ENV, format_fault

logger = logging.getLogger(__name__)

PHASE_POINTS = ("rollout", "policy_update", "rm_update", "rm_score", "logprobs", "weight_sync")
CKPT_POINTS = ("ckpt_files", "ckpt_policy", "ckpt_rm", "ckpt_manifest", "ckpt_renamed")
_RESUMED_RE = re.compile(r"resumed from (\S+) \(step (\d+)\)")


@dataclass
class Trial:
    """One injected fault.

    ``kind`` "kill": the first run gets SIGKILL at ``point`` of ``step`` (1-based), ``delay_s``
    later. "sigterm": it gets SIGTERM there instead (a preemption; it must write a checkpoint and
    exit 75). "corrupt": no first run; the reference's newest checkpoint is copied with one
    flipped byte (``point`` names the file), and the run must fall back to the one before.
    """

    point: str
    step: int
    delay_s: float = 0.0
    kind: str = "kill"


@dataclass
class TrialResult:
    """What happened in one trial."""

    trial: Trial
    killed: bool = False  # the fault took effect (SIGKILL death; SIGTERM: exit 75; corrupt: detected)
    resumed: bool = False  # the restart with --resume auto exited 0
    resumed_from_step: Optional[int] = None  # None: no checkpoint yet, it started over
    lock_left: bool = False  # the killed run left its lock file (its record), which the restart took over
    bitwise_equal: bool = False
    seconds: float = 0.0
    error: str = ""


@dataclass
class Summary:
    """All trials, with the counts the benchmark reports."""

    faults: int = 0
    resumed: int = 0
    bitwise_equal: int = 0
    rm_moved: bool = False
    policy_moved: bool = False
    reference_seconds: float = 0.0
    trials: list[TrialResult] = field(default_factory=list)


def plan_trials(n: int, steps: int, seed: int) -> list[Trial]:
    """``n`` seeded trials: every phase and checkpoint point in turn (rollout, policy update, RM
    update and a checkpoint write first), at a random step; phases get a random delay of up to
    0.1 s, so the process dies somewhere inside the phase (or a little after)."""
    rng = random.Random(seed)
    points = list(PHASE_POINTS[:3]) + [CKPT_POINTS[0]]
    rest = [p for p in PHASE_POINTS + CKPT_POINTS if p not in points]
    rng.shuffle(rest)
    points += rest
    trials = []
    for i in range(n):
        point = points[i % len(points)]
        delay = round(rng.uniform(0.0, 0.1), 3) if point in PHASE_POINTS else 0.0
        trials.append(Trial(point, rng.randint(1, steps), delay))
    return trials


SIGTERM_TRIAL = Trial("rollout", 1, 0.0, "sigterm")  # handled at the end of step 1 (not a periodic one)
CORRUPT_TRIAL = Trial("policy/__0_0.distcp", 0, 0.0, "corrupt")


def train_args(assets: dict[str, str], out: str, steps: int) -> list[str]:
    """The ``cooper train`` arguments of the tiny job (no config file needed; later ``key=value``
    arguments override these)."""
    return ["train", "--out", out, "--resume", "auto",
            f"model.policy_ckpt={assets['policy_ckpt']}", f"model.policy_hf={assets['policy_hf']}",
            f"model.rm_ckpt={assets['rm_ckpt']}", "model.dtype=float32", f"data.train_path={assets['train']}",
            "rollout.engine=hf", "rollout.group_size=4", "rollout.temperature=1.0", "rollout.max_new_tokens=16",
            "reward.mode=cooper", "reward.verifier_workers=1", "algo.kl_coef=0.001", "optim.lr=1e-4",
            "rm.negatives=perturb", "rm.optim.lr=1e-4", f"train.steps={steps}", "train.prompts_per_step=8",
            "train.micro_batch_size=8", "train.seed=1234", "eval.every=0", "checkpoint.every=1",
            "checkpoint.keep=2", "logging.wandb=false"]


def run_forked(fn: Callable[[], int], log_path: str, env: Optional[dict[str, str]] = None) -> int:
    """Run ``fn`` in a forked child with stdout/stderr to ``log_path``; return its exit code
    (negative: killed by that signal, as ``subprocess``)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        rc = 1
        try:
            os.setpgid(0, 0)  # its own process group: everything it starts is killed with it below
            os.environ.update(env or {})
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            logging.root.handlers.clear()  # cooper's CLI configures its own
            rc = fn()
        except BaseException:  # noqa: BLE001 - report anything, then leave without unwinding
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    try:  # as when a job is killed: its helpers go too (megatron's checkpoint writers, verifier, ...)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitstatus_to_exitcode(status)


def _cli(args: list[str]) -> Callable[[], int]:
    def go() -> int:
        from cooper_mcore.cli import main

        return main(args)

    return go


def _build_assets(root: str) -> Callable[[], int]:
    def go() -> int:
        from cooper_mcore.demo.assets import build_tiny_assets

        paths = build_tiny_assets(os.path.join(root, "assets"), n_train=16, n_eval=4, hidden_size=32, num_layers=1)
        rows = [{"id": f"q{i}", "question": f"{i % 10}+0=", "answer": str(i % 10)} for i in range(64)]
        with open(paths["train"], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        with open(os.path.join(root, "assets.json"), "w") as f:
            json.dump(paths, f)
        return 0

    return go


def _state(path: str, assets: dict[str, str], steps: int) -> dict[str, Any]:
    """Everything a training checkpoint restores, as named tensors (in a one-process world).

    The checkpoint is loaded into freshly built models and optimizers, as the trainer loads it,
    and read back per parameter: model weights, fp32 main parameters, Adam's moments and step.
    (Comparing the stored files would compare megatron's bucket padding too: the
    ``dp_reshardable`` optimizer format stores uninitialised padding between parameters.)
    Also the RNG states and ``trainer.json`` (data position, step, Adam steps).
    """
    import torch

    from cooper_mcore.checkpoint.model import load_checkpoint_model, read_meta
    from cooper_mcore.checkpoint.training import load_training_checkpoint
    from cooper_mcore.config.schema import ParallelConfig
    from cooper_mcore.train.model_state import ModelState
    from cooper_mcore.train.offload import ModelOffloader
    from cooper_mcore.train.step import OptimConfig, build_scheduler, inner_optimizers, wrap_for_training

    models = []
    for name in ("policy", "rm"):
        ckpt = assets[f"{name}_ckpt"]
        module, arch = load_checkpoint_model(ckpt, ParallelConfig())
        ddp, opt = wrap_for_training(module, OptimConfig(), per_token_loss=True)
        _, hf_config, dtype = read_meta(ckpt)
        models.append(ModelState(name, module, arch, hf_config, dtype, ckpt, tokenizer=None,
                                 offloader=ModelOffloader(ddp, opt), ddp=ddp, optimizer=opt,
                                 scheduler=build_scheduler(opt, 1e-4, 0, steps, 0.01)))
    out: dict[str, Any] = {"trainer": load_training_checkpoint(path, models)}
    for m in models:
        name, opt = m.name, m.optimizer
        for k, v in m.module.state_dict().items():
            if isinstance(v, torch.Tensor):
                out[f"{name}/model/{k}"] = v.detach().clone()
        for i, inner in enumerate(inner_optimizers(opt)):
            for g, group in enumerate(inner.param_groups):
                for j, p in enumerate(group["params"]):
                    out[f"{name}/main/{i}.{g}.{j}"] = p.detach().clone()
                    for sk, sv in inner.state[p].items():
                        out[f"{name}/adam/{i}.{g}.{j}/{sk}"] = torch.as_tensor(sv).clone()
    out["rng"] = torch.load(os.path.join(path, "rng", "rank0.pt"), weights_only=True)
    return out


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _compare(reference: str, outs: list[str], steps: int, assets: dict[str, str], result: str) -> Callable[[], int]:
    """A child that compares every trial's final checkpoint with the reference's (see :func:`_state`)."""

    def go() -> int:
        import torch

        from cooper_mcore.parallel import single_process_world

        def final(out: str) -> str:
            return os.path.join(out, "checkpoints", f"step_{steps}")

        verdicts: dict[str, Any] = {}
        with single_process_world():
            ref = _state(final(reference), assets, steps)
            for part in ("policy", "rm"):
                start = _state_of_initial(assets[f"{part}_ckpt"])
                verdicts[f"{part}_moved"] = any(not torch.equal(v, ref[f"{part}/model/{k}"]) for k, v in start.items())
            for out in outs:
                try:
                    verdicts[out] = _equal(ref, _state(final(out), assets, steps))
                except Exception as e:  # noqa: BLE001 - a missing or unreadable checkpoint is a failed trial
                    verdicts[out] = f"{type(e).__name__}: {e}"
        with open(result, "w") as f:
            json.dump(verdicts, f)
        return 0

    return go


def _state_of_initial(ckpt: str) -> dict[str, Any]:
    import torch

    from cooper_mcore.checkpoint.model import load_checkpoint_model
    from cooper_mcore.config.schema import ParallelConfig

    model, _ = load_checkpoint_model(ckpt, ParallelConfig())
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _tail(log: str, lines: int = 12) -> str:
    """The last lines of a run's log that are not warnings (for the summary's error field)."""
    with open(log, errors="replace") as f:
        keep = [line.rstrip() for line in f if "Warning" not in line and "warnings.warn" not in line]
    return " | ".join(keep[-lines:])


def _preload() -> None:
    """Import what a run imports, so that forked children start warm (no torch code runs here)."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import cooper_mcore.cli  # noqa: F401
    import cooper_mcore.compat.cpu  # noqa: F401
    import cooper_mcore.rl.loop  # noqa: F401
    import cooper_mcore.rollout.hf_engine  # noqa: F401
    import cooper_mcore.verify.rule  # noqa: F401


def _flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def _run_trial(trial: Trial, assets: dict[str, str], out: str, reference: str, steps: int) -> TrialResult:
    """Inject one fault into a run of the job in ``out``, then resume it (see :class:`Trial`)."""
    res = TrialResult(trial)
    args = train_args(assets, out, steps)
    if trial.kind == "corrupt":  # the reference's last checkpoints, the newest damaged
        shutil.copytree(os.path.join(reference, "checkpoints"), os.path.join(out, "checkpoints"))
        newest = os.path.join(out, "checkpoints", f"step_{steps}")
        _flip_byte(os.path.join(newest, trial.point))
    else:
        sig = signal.SIGTERM if trial.kind == "sigterm" else signal.SIGKILL
        if trial.kind == "sigterm":
            args.append("checkpoint.every=2")  # the step-1 checkpoint can only come from the SIGTERM
        env = {FAULT_ENV: format_fault(trial.point, trial.step, trial.delay_s, sig)}
        rc = run_forked(_cli(args), out + ".faulty.log", env)
        if trial.kind == "sigterm":
            res.killed = rc == EXIT_PREEMPTED and os.path.isdir(os.path.join(out, "checkpoints", f"step_{trial.step}"))
        else:
            res.killed = rc == -signal.SIGKILL
        if not res.killed:
            res.error = f"the faulty run ended with {rc}: {_tail(out + '.faulty.log')}"
        res.lock_left = os.path.isfile(os.path.join(out, LOCK_FILE))
    log = out + ".resumed.log"
    rc = run_forked(_cli(args), log)
    text = open(log, errors="replace").read()
    if trial.kind == "corrupt":
        res.killed = f"skipping checkpoint {newest}: {trial.point} has CRC-32" in text
        if not res.killed:
            res.error = "the damaged checkpoint was not reported"
    res.resumed = rc == 0
    res.lock_left = res.lock_left and "taking over from a run that is gone" in text
    if not res.resumed:
        res.error += f" the resumed run failed ({rc}): {_tail(log)}"
    found = _RESUMED_RE.search(text)
    res.resumed_from_step = int(found.group(2)) if found else None
    return res


def run_trials(work: str, n: int = 10, seed: int = 0, steps: int = 3, sigterm: bool = True,
               corrupt: bool = True) -> Summary:
    """Build the assets, run the reference, run ``n`` SIGKILL trials (plus one SIGTERM and one
    corrupt-checkpoint trial), compare; return the summary."""
    os.makedirs(work, exist_ok=True)
    _preload()
    if run_forked(_build_assets(work), os.path.join(work, "assets.log")) != 0:
        raise RuntimeError(f"building the tiny assets failed: {_tail(os.path.join(work, 'assets.log'))}")
    with open(os.path.join(work, "assets.json")) as f:
        assets = json.load(f)
    summary = Summary()
    reference = os.path.join(work, "reference")
    t0 = time.perf_counter()
    rc = run_forked(_cli(train_args(assets, reference, steps)), os.path.join(work, "reference.log"))
    summary.reference_seconds = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"the reference run failed ({rc}): {_tail(os.path.join(work, 'reference.log'))}")
    trials = plan_trials(n, steps, seed) + [SIGTERM_TRIAL] * sigterm + [CORRUPT_TRIAL] * corrupt
    outs = []
    for i, trial in enumerate(trials):
        out = os.path.join(work, f"trial{i}")
        outs.append(out)
        t0 = time.perf_counter()
        res = _run_trial(trial, assets, out, reference, steps)
        res.seconds = time.perf_counter() - t0
        summary.trials.append(res)
        logger.info("trial %d: %s %s@%d+%.3fs injected=%s resumed=%s (from step %s) %.1fs", i, trial.kind,
                    trial.point, trial.step, trial.delay_s, res.killed, res.resumed, res.resumed_from_step,
                    res.seconds)
    verdict_file = os.path.join(work, "compare.json")
    if run_forked(_compare(reference, outs, steps, assets, verdict_file), os.path.join(work, "compare.log")) != 0:
        raise RuntimeError(f"comparing the checkpoints failed: {_tail(os.path.join(work, 'compare.log'))}")
    with open(verdict_file) as f:
        verdicts = json.load(f)
    summary.policy_moved, summary.rm_moved = verdicts["policy_moved"], verdicts["rm_moved"]
    for out, res in zip(outs, summary.trials):
        res.bitwise_equal = verdicts[out] is True
        if not res.bitwise_equal and not res.error:
            res.error = f"final checkpoint differs from the reference: {verdicts[out]}"
    summary.faults = sum(r.killed for r in summary.trials)
    summary.resumed = sum(r.killed and r.resumed for r in summary.trials)
    summary.bitwise_equal = sum(r.killed and r.resumed and r.bitwise_equal for r in summary.trials)
    return summary


def main(argv: Optional[list[str]] = None) -> int:
    """CLI: run the trials and print the summary as one JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="scratch folder (assets, runs, logs)")
    p.add_argument("--trials", type=int, default=10, help="SIGKILL trials (plus one SIGTERM, one corrupt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3, help="steps of the job (a checkpoint after each)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    summary = run_trials(args.work, args.trials, args.seed, args.steps)
    print(json.dumps(asdict(summary)), flush=True)  # the result line
    return 0


if __name__ == "__main__":
    sys.exit(main())
