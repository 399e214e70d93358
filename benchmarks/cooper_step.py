"""Benchmark one full Cooper step on one device: set-up, time and peak memory per phase, beside the planner.

Everything colocated on one device (a GPU, or the CPU with ``--tiny``), built by
:func:`cooper_mcore.rl.setup.build_run` from ``examples/tiny_cpu.yaml`` with ``model.init=random``:
the policy (Qwen2.5-1.5B's shape by default), its host-copy reference and the reward model (the
policy's backbone with a scalar head, as VerifyRM) get random weights made directly on the device,
and the transformers rollout engine is built empty and filled by the project's weight push before
the first rollout. Nothing is converted: the only files are the tiny task's prompts and its
tokenizer widened to the model's vocabulary (:func:`cooper_mcore.demo.assets.build_real_shape_assets`),
so that every token the random policy samples reads back as one token and the reward model sees
completions as long as they were generated. Each setting runs in a fresh process and is stepped
with :func:`cooper_mcore.rl.step.cooper_step`, exactly as ``cooper train`` steps:

* ``no-offload``: training state stays on the device while the engine generates;
* ``offload``: the policy's and the RM's parameters, gradients and optimizer states move to host
  memory around the rollout (``offload.*: true``).

Both release the engine's memory between rollouts (``offload.release_engine``, the presets' choice).

**Sized by the planner.** Unless ``--micro-batch`` is given, each setting asks
:func:`cooper_mcore.planner.plan.largest_micro_batch` for the largest ``train.micro_batch_size`` whose
predicted peak fits the device (the GPU's memory; on CPU the host's), told the longest prompt, and
says what it chose.

**Pairs.** A random policy never answers right, so no prompt would form a reward-model pair and the
RM update would be skipped. The rule verifier still runs (its time stays in the rollout), but its
verdicts are replaced as if each prompt's first rollout were right and the others answered wrong,
and the negatives are the group's wrong rollouts (``rm.negatives=policy``): every prompt forms a
pair of two full-length completions, as in a step where a trained policy solves each prompt at
least once. An assistant's negatives (an LLM server's time) are not measured.

Per phase (``offload``, ``weight_sync``, ``rollout``, ``rm_score``, ``logprobs``, ``policy_update``,
``rm_update`` and, within it, ``negatives``): seconds, and the peak memory while it ran, by the
trainer's :class:`~cooper_mcore.metrics.PhaseTimer`: ``torch.cuda.max_memory_allocated`` on a GPU;
on CPU the process's resident set size: its high-water mark (``VmHWM``, reset at each phase
through ``/proc/self/clear_refs``, Linux; else sampled every 5 ms), with the allocator returning
every freed block above 128 KiB to the system (``MALLOC_MMAP_THRESHOLD_``), so that the resident
set follows the live tensors; next to ``cooper plan``'s per-GPU total for the phase and the ratio.
Then Cooper's extras (RM scoring and the RM update, negatives included) as a share of the step and
of the step without the rollout, offload against no offload, and the rollout engine's agreement with
the trainer (``rollout/logprob_*``).

    python benchmarks/cooper_step.py              # GPU: Qwen2.5-1.5B shape, bf16, 8 prompts x 16, 512 new tokens
    python benchmarks/cooper_step.py --tiny       # CPU: a tiny shape, float32, seconds
    python benchmarks/cooper_step.py --tiny --vocab 151936 --bf16 --max-new-tokens 128 --micro-batch 8  # big logits
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
from shapes import SHAPES  # benchmarks/shapes.py (scripts run from their folder)

from cooper_mcore.metric_names import MetricKey, Phase, memory_key, time_key

#: the phases in the order a step runs them (negatives inside rm_update)
PHASES = (Phase.OFFLOAD, Phase.WEIGHT_SYNC, Phase.ROLLOUT, Phase.RM_SCORE, Phase.LOGPROBS, Phase.POLICY_UPDATE,
          Phase.RM_UPDATE, Phase.NEGATIVES)
#: Cooper's extras over a rule-reward GRPO step (rm_update holds the negatives)
EXTRAS = (Phase.RM_SCORE, Phase.RM_UPDATE)
VARIANTS = {"no-offload": [], "offload": [f"offload.{m}_{k}=true" for m in ("policy", "rm")
                                          for k in ("params", "grads", "optimizer")]}
STEP = "step"
GIB = 2**30
#: the CPU allocator returns blocks above this to the system when freed (the children's environment)
MMAP_THRESHOLD = 131072


@dataclass
class Sizing:
    """The micro-batch a setting ran with, and why."""

    setting: str
    value: int
    chosen_by: str
    """``cooper plan`` (the largest that fits) or ``--micro-batch``."""
    largest_fitting: Optional[int] = None
    limit: Optional[int] = None
    planned_peak_gib: Optional[float] = None
    planned_peak_phase: str = ""


@dataclass
class VariantResult:
    """One setting's measurements (the last step's), with the plan for the same config."""

    variant: str
    device: str
    device_gib: float
    prompt_tokens: int
    overrides: list[str]
    sizing: Sizing
    setup_s: float
    """build_run: models, reference, engine, verifier, data."""
    startup_s: float
    """From the process's start to the end of build_run (imports included)."""
    times: dict[str, float]
    peaks_gib: dict[str, float]
    planned_gib: dict[str, float]
    """``cooper plan``'s per-GPU total per phase."""
    planned_tensors_gib: dict[str, float]
    """The same without CUDA contexts and the flat overhead: what the allocator itself holds."""
    at_rest_gib: float
    response_length: float
    sequences: int
    pairs_valid: int
    steps: int = 1
    engine: dict[str, float] = dataclasses.field(default_factory=dict)
    """The last step's ``rollout/logprob_*`` metrics (the engine against the trainer)."""

    @classmethod
    def from_json(cls, d: dict) -> VariantResult:
        return cls(**dict(d, sizing=Sizing(**d["sizing"])))


def _hwm_bytes() -> int:
    """This process's resident-set high-water mark (``VmHWM``), bytes."""
    with open("/proc/self/status", encoding="utf-8") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_hwm() -> bool:
    """Reset the high-water mark to the current resident set (Linux >= 4.0); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssPeak:
    """The process's largest resident set size since the last call: the kernel's high-water mark
    where it can be reset (exact), and a background thread's samples every 5 ms: a
    :class:`~cooper_mcore.metrics.PhaseTimer` ``peak_memory`` for the CPU."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._hwm = _reset_hwm()
        self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, self._proc.memory_info().rss)

    def __call__(self) -> int:
        now = self._proc.memory_info().rss
        peak, self._peak = max(self._peak, now, _hwm_bytes() if self._hwm else 0), now
        if self._hwm:
            _reset_hwm()
        return peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class _Verdict:
    correct: bool
    answered: bool = True


@dataclass
class OnePairPerPrompt:
    """A stand-in for the rule verifier's verdicts (see the module doc): the real verifier runs, then
    each group's first rollout counts as right and the others as answered and wrong."""

    inner: object
    group_size: int

    def verify_batch(self, golds, preds):
        self.inner.verify_batch(golds, preds)  # its time stays in the rollout phase
        return [_Verdict(correct=i % self.group_size == 0) for i in range(len(preds))]

    def close(self) -> None:
        self.inner.close()


def write_assets(work: str, shape: str, vocab: int = 0) -> dict[str, str]:
    """The prompts, the widened tokenizer and the shape's HF config (cached in ``work``); ``vocab``
    replaces the shape's vocabulary size (the tiny shape with a large vocabulary: the logits dominate)."""
    from cooper_mcore.demo.assets import build_real_shape_assets
    from cooper_mcore.models.tiny import tiny_hf_config

    dims = dict(SHAPES[shape], **({"vocab_size": vocab} if vocab else {}))
    name = f"{shape}-v{vocab}" if vocab else shape
    paths = build_real_shape_assets(os.path.join(work, f"assets-v{vocab}" if vocab else "assets"), dims["vocab_size"],
                                    n_train=256, n_eval=8)
    config = os.path.join(work, f"{name}.json")
    with open(config, "w", encoding="utf-8") as f:
        json.dump(tiny_hf_config("qwen2_tied", **dims).to_dict(), f)
    return dict(paths, policy_config=config)


def run_overrides(work: str, paths: dict[str, str], variant: str, args: argparse.Namespace) -> list[str]:
    """The dotted settings of one setting's run on ``examples/tiny_cpu.yaml``."""
    return [f"out={os.path.join(work, 'run-' + variant)}", "model.init=random",
            f"model.policy_config={paths['policy_config']}", f"model.policy_hf={paths['tokenizer']}",
            f"model.dtype={args.dtype}", f"data.train_path={paths['train']}",
            f"data.eval_path={paths['eval']}", "eval.every=0", "checkpoint.every=0", "logging.wandb=false",
            "rm.negatives=policy", "reward.mode=cooper", f"rollout.group_size={args.group}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"train.prompts_per_step={args.prompts}",
            "optim.lr=1e-6", "rm.optim.lr=1e-5", *VARIANTS[variant]]


def size_micro_batch(cfg, opts, given: Optional[int]) -> Sizing:
    """Set ``train.micro_batch_size``: ``given``, else the largest ``cooper plan`` fits (1 when none does)."""
    from cooper_mcore.planner.plan import largest_micro_batch
    from cooper_mcore.planner.report import load_shapes

    if given:
        cfg.train.micro_batch_size = given
        return Sizing("train.micro_batch_size", given, "--micro-batch")
    policy, rm, _ = load_shapes(cfg)
    fit = largest_micro_batch(cfg, policy, rm, opts)
    cfg.train.micro_batch_size = fit.value if fit else 1
    if fit is None:
        return Sizing("train.micro_batch_size", 1, "cooper plan (nothing fits: the smallest)")
    return Sizing(fit.setting, fit.value, "cooper plan", fit.largest_fitting, fit.limit,
                  round(fit.peak.total / GIB, 2), fit.peak.phase)


def plan_phases(cfg, opts) -> tuple[dict[str, float], dict[str, float]]:
    """``cooper plan``'s per-GPU total per phase, and the same without CUDA contexts and overhead."""
    from cooper_mcore.planner.plan import plan
    from cooper_mcore.planner.report import load_shapes

    policy, rm, _ = load_shapes(cfg)
    phases = plan(cfg, policy, rm, opts).given.phases
    total = {p.phase: p.total / GIB for p in phases}
    tensors = {p.phase: (p.total - p.components.get("contexts", 0) - p.components.get("overhead", 0)) / GIB
               for p in phases}
    return total, tensors


def device_memory() -> tuple[str, float]:
    """This process's device and its memory in GiB (the host's on CPU)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / GIB
    return f"CPU ({os.cpu_count()} cores)", psutil.virtual_memory().total / GIB


def run_variant(args: argparse.Namespace, variant: str) -> VariantResult:
    """Build the run at the planner's micro-batch and time ``args.steps`` Cooper steps (the first a
    warm-up); the last step's figures."""
    from cooper_mcore.config.schema import load_config
    from cooper_mcore.data.templates import longest_prompt_tokens
    from cooper_mcore.data.tokenizer import load_tokenizer
    from cooper_mcore.metrics import PhaseTimer, cuda_peak_memory
    from cooper_mcore.planner.plan import PlanOptions
    from cooper_mcore.rl.setup import build_run
    from cooper_mcore.rl.step import cooper_step

    paths = write_assets(args.workdir, args.shape, args.vocab)
    overrides = run_overrides(args.workdir, paths, variant, args)
    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                                   "tiny_cpu.yaml"), overrides)
    device, device_gib = device_memory()
    prompt_tokens = longest_prompt_tokens(cfg.data.train_path, cfg.data.template, load_tokenizer(cfg.model.policy_hf),
                                          cfg.data.use_chat_template)
    opts = PlanOptions(gpus_per_node=1, gpu_memory_gib=device_gib, prompt_tokens=prompt_tokens, assistant="none")
    sizing = size_micro_batch(cfg, opts, args.micro_batch)
    overrides.append(f"train.micro_batch_size={cfg.train.micro_batch_size}")
    t0 = time.perf_counter()
    run = build_run(cfg)
    setup_s = time.perf_counter() - t0
    startup_s = time.time() - psutil.Process().create_time()
    run.verifier = OnePairPerPrompt(run.verifier, cfg.rollout.group_size) if run.verifier is not None else None
    cuda = torch.cuda.is_available()
    rss = None if cuda else RssPeak()
    timer = PhaseTimer(sync=torch.cuda.synchronize if cuda else None, peak_memory=cuda_peak_memory if cuda else rss)
    for _ in range(args.steps):
        result = cooper_step(run, run.data.next_batch(), timer)
        run.step += 1
        metrics = timer.pop()
    run.close()
    if rss is not None:
        rss.close()
    at_rest = torch.cuda.memory_allocated() if cuda else psutil.Process().memory_info().rss
    planned, tensors = plan_phases(cfg, opts)
    times = {p: metrics[time_key(p)] for p in PHASES if time_key(p) in metrics}
    times[STEP] = metrics[MetricKey.TIME_STEP]
    peaks = {p: metrics[memory_key(p)] for p in PHASES if memory_key(p) in metrics}
    engine = {k: v for k, v in result.rollouts.to_metrics().items() if k.startswith("rollout/")}
    return VariantResult(variant, device, device_gib, prompt_tokens, overrides, sizing, setup_s, startup_s, times,
                         peaks, planned, tensors, at_rest / GIB, result.rollouts.response_length,
                         args.prompts * args.group, sum(p.valid for p in result.pairs), args.steps, engine)


def launch(args: argparse.Namespace, variant: str) -> VariantResult:
    """One setting in a fresh process (a step's allocator state must not carry into the next)."""
    out = os.path.join(args.workdir, f"result-{variant}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--workdir", args.workdir,
           "--result", out, "--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group),
           "--max-new-tokens", str(args.max_new_tokens), "--vocab", str(args.vocab)] + (
           ["--tiny"] if args.tiny else []) + (["--bf16"] if args.bf16 else []) + (
           ["--micro-batch", str(args.micro_batch)] if args.micro_batch else [])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))  # freed CPU tensors leave the resident set
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{r.stderr[-4000:]}")
    with open(out, encoding="utf-8") as f:
        return VariantResult.from_json(json.load(f))


def _num(value: Optional[float], spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def phase_rows(res: VariantResult) -> list[str]:
    """The table's rows of one setting: each phase, the step and the memory at rest."""
    rows = []
    for ph in (*PHASES, STEP):
        peak = max(res.peaks_gib.values(), default=None) if ph == STEP else res.peaks_gib.get(ph)
        plan = max(res.planned_gib.values(), default=None) if ph == STEP else res.planned_gib.get(ph)
        tensors = max(res.planned_tensors_gib.values(), default=None) if ph == STEP else res.planned_tensors_gib.get(ph)
        rows.append(f"| {res.variant} | {ph} | {_num(res.times.get(ph), '.3f')} | {_num(peak)} | {_num(plan)} | "
                    f"{_ratio(peak, plan)} | {_num(tensors)} | {_ratio(peak, tensors)} |")
    rows.append(f"| {res.variant} | at rest after the step | - | {res.at_rest_gib:.2f} | - | - | - | - |")
    return rows


def summary(results: dict[str, VariantResult]) -> list[str]:
    """Sizing, set-up, Cooper's extras and offload against no offload, one line each."""
    lines = []
    for r in results.values():
        s = r.sizing
        why = (f"the largest that fits {r.device_gib:.2f} GiB is {s.largest_fitting} of at most {s.limit}; a run's "
               f"micro-batch divides its {r.sequences} sequences; planned peak {s.planned_peak_gib} GiB in "
               f"{s.planned_peak_phase}" if s.largest_fitting else s.chosen_by)
        lines.append(f"- {r.variant}: {s.setting}={s.value} ({s.chosen_by}: {why})")
    lines += [f"- {r.variant}: set-up {r.setup_s:.1f} s (build_run: models, reference, engine, verifier, data); "
              f"{r.startup_s:.1f} s from the process's start" for r in results.values()]
    for r in results.values():
        extras = sum(r.times.get(p, 0.0) for p in EXTRAS)
        step, rollout, negatives = r.times[STEP], r.times.get(Phase.ROLLOUT, 0.0), r.times.get(Phase.NEGATIVES, 0.0)
        lines.append(f"- {r.variant}: Cooper's extras (rm_score + rm_update, negatives {negatives:.3f} s of it) "
                     f"{extras:.3f} s = {100 * extras / step:.1f}% of the step, "
                     f"{100 * extras / max(step - rollout, 1e-9):.1f}% of the step without the rollout "
                     f"({r.pairs_valid} valid pairs)")
    for r in results.values():
        if r.engine:
            lines.append(f"- {r.variant}: the engine against the trainer: "
                         + ", ".join(f"{k} {v:.3g}" for k, v in r.engine.items()))
    if {"no-offload", "offload"} <= results.keys():
        a, b = results["no-offload"], results["offload"]
        lines.append(f"- offload against no offload: step {b.times[STEP]:.3f} s vs {a.times[STEP]:.3f} s "
                     f"({b.times[STEP] - a.times[STEP]:+.3f} s; moving state {b.times.get(Phase.OFFLOAD, 0):.3f} s), "
                     f"rollout peak {_num(b.peaks_gib.get(Phase.ROLLOUT))} vs {_num(a.peaks_gib.get(Phase.ROLLOUT))} "
                     f"GiB, step peak {_num(max(b.peaks_gib.values()))} vs {_num(max(a.peaks_gib.values()))} GiB")
    return lines


def format_report(results: dict[str, VariantResult], args: argparse.Namespace) -> str:
    """The header line, the per-phase table and the summary lines."""
    first = next(iter(results.values()))
    cuda = "CPU" not in first.device
    mem = "torch.cuda.max_memory_allocated" if cuda else "the process's RSS (not comparable with the plan)"
    vocab = args.vocab or SHAPES[args.shape]["vocab_size"]
    lines = [f"one Cooper step, {args.shape} policy and RM ({args.dtype}, vocabulary {vocab}, random weights built "
             f"on the device), transformers engine, everything colocated on {first.device} ({first.device_gib:.2f} "
             f"GiB); {first.sequences} rollouts ({args.prompts} prompts x {args.group}), max {args.max_new_tokens} new "
             f"tokens (mean {first.response_length:.0f}), prompts up to {first.prompt_tokens} tokens; step "
             f"{args.steps} of {args.steps}; torch {torch.__version__}", "",
             "| setting | phase | seconds | peak GiB | plan GiB | peak / plan | plan w/o ctx+ovh GiB | peak / that |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for res in results.values():
        lines += phase_rows(res)
    lines += ["", *summary(results),
              f"- peak: {mem} during the phase ('offload' covers offload and onload; 'negatives' lies within "
              "'rm_update'); plan: cooper plan's per-GPU total for the phase, which adds CUDA contexts (0.75 GiB "
              "each) and a 2 GiB overhead the allocator does not see ('w/o ctx+ovh' leaves them out)"]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one Cooper step: set-up, time and peak memory per phase, beside the plan")
    p.add_argument("--tiny", action="store_true", help="a tiny shape on CPU (float32), seconds")
    p.add_argument("--steps", type=int, default=2, help="steps per setting; the last is reported")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (GPU 8, tiny 4)")
    p.add_argument("--group", type=int, default=None, help="rollouts per prompt (GPU 16, tiny 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="GPU 512, tiny 16")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per micro-batch (default: the largest cooper plan fits on the device)")
    p.add_argument("--vocab", type=int, default=0,
                   help="with --tiny: this vocabulary instead of the tiny shape's (the logits dominate)")
    p.add_argument("--bf16", action="store_true", help="with --tiny: bf16 models instead of float32")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated settings to run")
    p.add_argument("--workdir", default=None, help="assets are kept here (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write every setting's figures as JSON here")
    p.add_argument("--variant", choices=sorted(VARIANTS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if (args.vocab or args.bf16) and not args.tiny:
        p.error("--vocab and --bf16 need --tiny")
    args.shape = "tiny" if args.tiny else "qwen2.5-1.5b"
    args.dtype = "float32" if args.tiny and not args.bf16 else "bfloat16"
    args.prompts = args.prompts or (4 if args.tiny else 8)
    args.group = args.group or (4 if args.tiny else 16)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 512)
    args.steps = max(args.steps, 1)
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.variant:  # a child process: one setting
        result = run_variant(args, args.variant)
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(result), f)
        return
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"cooper_step.py: unknown --variants {unknown}; choose from {sorted(VARIANTS)}")
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="cooper-bench-step-")
    write_assets(args.workdir, args.shape, args.vocab)  # once, before the timed processes
    results: dict[str, VariantResult] = {}
    for variant in args.variants.split(","):
        results[variant] = launch(args, variant)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"shape": args.shape, "dtype": args.dtype,
                           "vocab": args.vocab or SHAPES[args.shape]["vocab_size"], "prompts": args.prompts,
                           "group": args.group,
                           "max_new_tokens": args.max_new_tokens, "steps": args.steps,
                           "results": {v: dataclasses.asdict(r) for v, r in results.items()}}, f, indent=2)
        # the report so far after each setting: a run stopped at its time limit keeps what it measured
        print(format_report(results, args) + "\n", flush=True)


if __name__ == "__main__":
    main()
