"""``cooper rehearse``: a preset's own job, run on CPU in minutes, before it spends GPU hours.

Three launches of ``cooper train`` under torchrun (gloo, ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) on a
tiny model of the preset's family (:mod:`cooper_mcore.rehearsal.preset`):

1. the reference: :data:`~cooper_mcore.rehearsal.preset.STEPS` steps, evaluating every step and
   checkpointing every two;
2. the same job, sent SIGUSR1 (SLURM's warning before a time limit) in step
   :data:`~cooper_mcore.rehearsal.preset.STOP_STEP`: it must checkpoint and exit 75;
3. the same command with ``--resume auto``: it must continue from that checkpoint and end on the
   reference's metrics and weights, bit for bit.

Every step must finish within a wall-clock limit: with ``DETAIL`` torch checks that all ranks of a
group call the same collective with the same shapes and raises otherwise; a hang that check cannot
see (ranks waiting in different groups) is caught by the limit, every rank's Python stack is dumped
(SIGUSR2, :func:`cooper_mcore.cli.main` registers the handler) and the report names where each rank
waits. The report lists what ran, what was substituted, per-step metrics, each check and one
verdict line. What a rehearsal cannot show: NCCL, CUDA IPC, real GPU memory and speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import psutil
import torch

from cooper_mcore.atomic import exclusive
from cooper_mcore.checkpoint.model import load_checkpoint_tensors
from cooper_mcore.config.checks import Elsewhere, validate
from cooper_mcore.config.model_shapes import ModelShape
from cooper_mcore.config.presets import resolve_preset
from cooper_mcore.config.schema import CooperConfig, load_config, save_config
from cooper_mcore.data.templates import longest_prompt_tokens
from cooper_mcore.data.tokenizer import load_tokenizer
from cooper_mcore.demo.assets import build_real_shape_assets, build_tiny_assets
from cooper_mcore.job import EXIT_PREEMPTED
from cooper_mcore.metric_names import SCHEMA, TIME_PREFIX, Phase, memory_key, time_key
from cooper_mcore.metric_names import MetricKey as K
from cooper_mcore.metrics import METRICS_FILE
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.tiny import tiny_hf_config
from cooper_mcore.parallel import single_process_world
from cooper_mcore.planner.plan import PHASES, PlanOptions, largest_micro_batch
from cooper_mcore.planner.plan import plan as plan_memory
from cooper_mcore.planner.report import load_shapes
from cooper_mcore.rehearsal.assistant import StandInAssistant
from cooper_mcore.rehearsal.preset import (
    REAL_STEPS,
    STEPS,
    STOP_STEP,
    RehearsalPlan,
    Substitution,
    TinyShape,
    change_setting,
    plan_rehearsal,
    preset_model_shapes,
)
from cooper_mcore.train.faults import FAULT_ENV, format_fault

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: steps of the tiny policy's SFT: enough that it is sometimes right, so the RM gets pairs
SFT_STEPS = 150
TABLE_KEYS = (K.REWARD_MEAN, K.RULE_ACC, K.LOSS, K.KL, K.GRAD_NORM, K.RM_LOSS, K.PAIRS_VALID, K.EVAL_ACC, K.TIME_STEP)
_RANK_EXIT = re.compile(r"rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)")
_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


@dataclass
class Limits:
    """Wall-clock limits of a rehearsal's runs."""

    startup_s: float = 600.0
    """From launch to the first step's metrics (imports, models, engine)."""
    step_s: float = 180.0
    """From one step's metrics to the next's (a step, its evaluation and checkpoint)."""


@dataclass
class RunResult:
    """One launch of ``cooper train``."""

    name: str
    rc: Optional[int]
    steps: list[dict[str, Any]]
    seconds: float
    log_dir: str
    hang: str = ""
    """Where each rank waited when the run passed its limit (empty: no hang)."""
    errors: list[str] = field(default_factory=list)
    """Collective mismatches and the last error line of each failed rank."""
    rank_exit_codes: dict[int, int] = field(default_factory=dict)
    """The failed ranks' exit codes, from torchrun's failure summary."""
    resumed_from: Optional[int] = None


@dataclass
class Check:
    """One thing the rehearsal requires."""

    name: str
    ok: bool
    detail: str


@dataclass
class PhaseMeasure:
    """One phase of a real-shape rehearsal: what it took, and what ``cooper plan`` predicted."""

    phase: str
    seconds: Optional[float]
    """The last step's wall seconds."""
    peak_gib: Optional[float]
    """The peak allocated GPU memory over the steps (None on a CPU)."""
    planned_gib: Optional[float]
    """``cooper plan``'s per-GPU total for the phase (it also counts CUDA contexts and an overhead)."""

    @property
    def ratio(self) -> Optional[float]:
        """Measured peak over planned."""
        return self.peak_gib / self.planned_gib if self.peak_gib is not None and self.planned_gib else None


@dataclass
class RehearsalReport:
    """The outcome of :func:`rehearse`."""

    plan: RehearsalPlan
    runs: list[RunResult]
    checks: list[Check]
    assistant_counts: dict[str, int] = field(default_factory=dict)
    phases: list[PhaseMeasure] = field(default_factory=list)
    """Per-phase time and memory next to the planner's prediction (real-shape rehearsals)."""

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def verdict(self) -> str:
        failed = [c.name for c in self.checks if not c.ok]
        name = os.path.basename(self.plan.preset)
        if not failed:
            return f"rehearsal of {name}: PASS ({len(self.checks)} checks)"
        return f"rehearsal of {name}: FAIL ({', '.join(failed)})"

    def format(self) -> str:
        """The report: what ran, substitutions, per-step metrics, checks, the verdict line last."""
        p = self.plan
        lines = [f"rehearsal of {p.preset}", f"  layout:   {p.layout()}", f"  features: {p.features()}",
                 f"  model:    {p.shape.describe()}", "  substituted:"]
        lines += [f"    {s}" for s in p.substitutions] or ["    nothing"]
        if self.assistant_counts:
            counts = ", ".join(f"{k} {v}" for k, v in self.assistant_counts.items())
            lines.append(f"  stand-in assistant answers: {counts}")
        for run in self.runs:
            lines.append(f"  run {run.name}: exit {run.rc}, {len(run.steps)} step(s) logged, {run.seconds:.0f} s"
                         + (f", resumed from step {run.resumed_from}" if run.resumed_from is not None else ""))
            lines += [f"    {e}" for e in run.errors]
            if run.hang:
                lines.append(f"    hang: {run.hang}")
        lines.append("  " + " ".join(f"{k:>12}" for k in (K.STEP,) + TABLE_KEYS))
        reference = self.runs[0].steps if self.runs else []
        for m in reference:
            cells = [f"{m[K.STEP]:>12}"] + [f"{m[k]:>12.4g}" if isinstance(m.get(k), (int, float)) else f"{'-':>12}"
                                            for k in TABLE_KEYS]
            lines.append("  " + " ".join(cells))
        if self.phases:
            lines.append(f"  {'phase':>14} {'seconds':>9} {'peak GiB':>9} {'planned GiB':>12} {'peak/plan':>10}")
            lines += [f"  {m.phase:>14} {_cell(m.seconds, '.2f', 9)} {_cell(m.peak_gib, '.2f', 9)} "
                      f"{_cell(m.planned_gib, '.2f', 12)} {_cell(m.ratio, '.2f', 10)}" for m in self.phases]
            lines.append(f"  {self.extras()}")
        lines += [f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in self.checks]
        lines.append(self.verdict())
        return "\n".join(lines)

    def extras(self) -> str:
        """Cooper's extras (RM scoring and the RM update, negatives included) as a share of the last
        step and of the step without the rollout."""
        last = self.runs[0].steps[-1] if self.runs and self.runs[0].steps else {}
        step, rollout = last.get(K.TIME_STEP), last.get(time_key(Phase.ROLLOUT), 0.0)
        if not step:
            return "Cooper's extras: no step measured"
        extras = sum(last.get(time_key(p), 0.0) for p in (Phase.RM_SCORE, Phase.RM_UPDATE))
        pairs = last.get(K.PAIRS_VALID, 0)
        text = (f"Cooper's extras (rm_score + rm_update, negatives {last.get(time_key(Phase.NEGATIVES), 0.0):.2f} s "
                f"of it): {extras:.2f} s = {100 * extras / step:.1f}% of the step, "
                f"{100 * extras / max(step - rollout, 1e-9):.1f}% of the step without the rollout")
        if not pairs:
            text += ("; no valid pair in the last step (a random policy is rarely right), so its RM update was "
                     "skipped: benchmarks/cooper_step.py measures the update with a pair per prompt")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.plan.preset, "ok": self.ok, "verdict": self.verdict(), "layout": self.plan.layout(),
                "features": self.plan.features(), "nproc": self.plan.nproc,
                "substitutions": [dataclasses.asdict(s) for s in self.plan.substitutions],
                "runs": [dataclasses.asdict(r) for r in self.runs],
                "checks": [dataclasses.asdict(c) for c in self.checks],
                "assistant_counts": self.assistant_counts, "phases": [dataclasses.asdict(m) for m in self.phases]}


def _cell(value: Optional[float], spec: str, width: int) -> str:
    return f"{value:>{width}{spec}}" if value is not None else f"{'-':>{width}}"


def build_assets(shape: TinyShape, dtype: str, root: str) -> dict[str, str]:
    """The tiny task and tokenizer, a policy with a short SFT (so that the RM sees pairs) and a random
    RM of ``shape`` (cached under ``root``)."""
    f = shape.fields
    key = (f"{shape.family}-{shape.rm_family}-l{shape.num_layers}-h{shape.hidden_size}-a{f['num_attention_heads']}"
           f"-kv{f['num_key_value_heads']}-{'tied' if f['tie_word_embeddings'] else 'untied'}-{dtype}"
           + ("-allsparse" if f.get("mlp_only_layers") == [] else ""))
    folder = os.path.join(root, key)
    with exclusive(folder):  # rehearsals run side by side build each shape once, the others reuse it
        return build_tiny_assets(folder, n_train=512, n_eval=16, hidden_size=shape.hidden_size,
                                 num_layers=shape.num_layers, sft_steps=SFT_STEPS, family=shape.family,
                                 rm_family=shape.rm_family, shape=dict(f), dtype=DTYPES[dtype])


def use_real_shape(plan: RehearsalPlan, root: str) -> PlanOptions:
    """Point the real-shape run at random weights of the preset's shapes (their configs written in its
    folder), the task's prompts and a tokenizer of the model's vocabulary (cached under ``root``), and
    set its micro-batch to the largest ``cooper plan`` fits on this device (recorded as a substitution).

    Returns:
        The planner's options for this device and these prompts (the phases are compared with it).
    """
    cfg = plan.cfg
    for setting, hf_config in plan.model_configs.items():
        path = os.path.join(cfg.out, f"{setting.split('.')[-1]}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        setattr(cfg.model, setting.split(".")[-1], path)
    vocab = plan.model_configs["model.policy_config"]["vocab_size"]
    with exclusive(os.path.join(root, f"real-v{vocab}")):
        paths = build_real_shape_assets(os.path.join(root, f"real-v{vocab}"), vocab)
    cfg.model.policy_hf, cfg.model.policy_ckpt, cfg.model.rm_ckpt = paths["tokenizer"], "", ""
    cfg.data.train_path, cfg.data.eval_path = paths["train"], paths["eval"]
    name, memory = device_memory()
    opts = PlanOptions(gpus_per_node=1, gpu_memory_gib=memory, assistant="none",
                       prompt_tokens=longest_prompt_tokens(cfg.data.train_path, cfg.data.template,
                                                           load_tokenizer(cfg.model.policy_hf),
                                                           cfg.data.use_chat_template))
    policy, rm, _ = load_shapes(cfg)
    fit = largest_micro_batch(cfg, policy, rm, opts)
    if fit is None:
        plan.substitutions.append(Substitution("train.micro_batch_size", str(cfg.train.micro_batch_size), "kept",
                                               f"cooper plan fits no micro-batch in {memory:.2f} GiB ({name})"))
    else:
        change_setting(cfg, plan.substitutions, fit.setting, fit.value,
             f"the largest cooper plan fits in {memory:.2f} GiB ({name}; planned peak {fit.peak.total / 2**30:.2f} "
             f"GiB in {fit.peak.phase}, prompts up to {opts.prompt_tokens} tokens)")
    return opts


def device_memory() -> tuple[str, float]:
    """This machine's first GPU and its memory in GiB (``nvidia-smi``, so that this process makes no
    CUDA context beside the run's), else the host's memory."""
    try:
        query = ["nvidia-smi", "-i", "0", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        name, mib = out.rsplit(",", 1)
        return name.strip(), float(mib) / 1024
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 2**30
    return "the host's memory (no GPU)", psutil.virtual_memory().total / 2**30


def _use_assets(cfg: CooperConfig, assets: dict[str, str]) -> None:
    cfg.model.policy_ckpt, cfg.model.policy_hf = assets["policy_ckpt"], assets["policy_hf"]
    cfg.model.rm_ckpt = assets["rm_ckpt"]
    cfg.data.train_path, cfg.data.eval_path = assets["train"], assets["eval"]


def _read_steps(out: str) -> list[dict[str, Any]]:
    path = os.path.join(out, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def _rank_logs(log_dir: str) -> dict[int, str]:
    """torchrun's per-rank stderr files (``--redirects 3``), by local rank."""
    out = {}
    for path in glob.glob(os.path.join(log_dir, "**", "stderr.log"), recursive=True):
        rank = os.path.basename(os.path.dirname(path))
        if rank.isdigit():
            out[int(rank)] = path
    return out


def _where(text: str) -> str:
    """Where the main thread of a faulthandler dump waits: the innermost cooper_mcore frame and
    torch.distributed call."""
    dumps = text.split("most recent call first")
    if len(dumps) < 2:
        return "no stack dump"
    frames = _FRAME.findall(dumps[-1].split("\n\n")[0])
    ours = next((f"{os.path.basename(p)}:{n} {fn}" for p, n, fn in frames if "cooper_mcore" in p), "?")
    dist = next((fn for p, _, fn in frames if "torch/distributed" in p), "")
    return ours + (f" in {dist}" if dist else "")


def _errors(log_dir: str) -> list[str]:
    """Collective mismatches DETAIL found, and each rank's last error line."""
    out = []
    for rank, path in sorted(_rank_logs(log_dir).items()):
        with open(path, errors="replace") as f:
            text = f.read()
        for line in text.splitlines():
            if "Detected mismatch between collectives" in line:
                out.append(f"rank {rank}: {line.strip()[:400]}")
                break
        errs = [line for line in text.splitlines() if re.match(r"^\w*(Error|Exception)\b|^\S+Error:", line)
                or " ERROR " in line]
        if errs:
            out.append(f"rank {rank}: {errs[-1].strip()[:400]}")
    return out


def _stop(proc: subprocess.Popen, dump: bool) -> None:
    """End a launch and everything it started; first ask its ranks for their stacks."""
    try:
        agent = psutil.Process(proc.pid)
        ranks = agent.children()
        family = agent.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    if dump:
        for p in ranks:
            with contextlib.suppress(psutil.Error):  # already gone
                p.send_signal(signal.SIGUSR2)
        time.sleep(3.0)
    for p in [agent, *family]:
        with contextlib.suppress(psutil.Error):  # already gone
            p.kill()
    proc.wait()


def launch(name: str, cfg_path: str, out: str, nproc: int, limits: Limits, resume: str = "none",
           env: Optional[dict[str, str]] = None) -> RunResult:
    """Run ``cooper train`` under torchrun with DETAIL checks and the wall-clock limits."""
    log_dir = os.path.join(os.path.dirname(out), f"{name}.logs")
    agent_path = os.path.join(os.path.dirname(out), f"{name}.agent.log")
    shutil.rmtree(log_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--log-dir", log_dir, "--redirects", "3", "-m", "cooper_mcore", "train", "--config", cfg_path,
           "--out", out, "--resume", resume]
    run_env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}  # only the fault asked for here
    run_env.update(TORCH_DISTRIBUTED_DEBUG="DETAIL", OMP_NUM_THREADS="1", WANDB_MODE="disabled", **(env or {}))
    t0 = last = time.monotonic()
    seen = len(_read_steps(out))
    start_steps = seen
    hang = ""
    with open(agent_path, "w") as agent_log:
        proc = subprocess.Popen(cmd, stdout=agent_log, stderr=subprocess.STDOUT, env=run_env)
        while proc.poll() is None:
            time.sleep(0.5)
            n = len(_read_steps(out))
            now = time.monotonic()
            if n > seen:
                seen, last = n, now
            limit = limits.startup_s if seen == start_steps else limits.step_s
            if now - last > limit:
                _stop(proc, dump=True)
                where = [f"rank {r}: {_where(open(p, errors='replace').read())}"
                         for r, p in sorted(_rank_logs(log_dir).items())]
                hang = (f"no step finished within {limit:.0f} s after step {seen} (killed); " + "; ".join(where))
                break
    steps = _read_steps(out)
    with open(agent_path, errors="replace") as f:
        failures = _RANK_EXIT.findall(f.read())  # torchrun exits 1 for any failure; the ranks' codes are here
    result = RunResult(name=name, rc=proc.returncode, steps=steps, seconds=time.monotonic() - t0, log_dir=log_dir,
                       hang=hang, errors=_errors(log_dir) if proc.returncode else [],
                       rank_exit_codes={int(r): int(c) for r, c in failures})
    found = [re.search(r"resumed from \S+ \(step (\d+)\)", open(p, errors="replace").read())
             for p in _rank_logs(log_dir).values()]
    result.resumed_from = next((int(m.group(1)) for m in found if m), None)
    return result


#: the asynchronous rollouts' keys (metric_names' ``async`` section), written by a disaggregated run only
ASYNC_KEYS = frozenset(k for k, m in SCHEMA.items() if m.section == "async")


def metrics_differ(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys of two metrics lines whose values differ (timings aside; NaN equals NaN; the asynchronous rollouts'
    keys only where both lines have them: a colocated reference has none): the resume checks here and in the
    multi-node tests compare a resumed run's steps with its reference's with it."""
    keys = {k for k in a.keys() | b.keys() if not k.startswith(TIME_PREFIX)
            and not (k in ASYNC_KEYS and (k not in a or k not in b))}

    def same(x: Any, y: Any) -> bool:
        both_nan = isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
        return x == y or both_nan

    return sorted(k for k in keys if not same(a.get(k), b.get(k)))


def _weights(ckpt: str) -> dict[str, torch.Tensor]:
    """The model's tensors in a checkpoint (not the optimizer's: megatron's ``dp_reshardable``
    buckets hold uninitialised padding; the optimizer's state shows in the next step's weights).
    With expert parallelism the optimizer is chained (dense and expert parameters): ``chained_<i>.optimizer.``."""
    with single_process_world():
        return {k: v for k, v in load_checkpoint_tensors(ckpt).items()
                if isinstance(v, torch.Tensor) and not _OPTIMIZER_KEY.match(k)}


def weights_differ(a: str, b: str) -> list[str]:
    """The names of the model tensors that differ between the checkpoints at ``a`` and ``b``, bit for bit (all of
    them, when the two do not hold the same names)."""
    wa, wb = _weights(a), _weights(b)
    if wa.keys() != wb.keys():
        return [f"tensor names differ: {sorted(wa.keys() ^ wb.keys())[:4]}"]
    return [k for k in sorted(wa) if not torch.equal(wa[k], wb[k])]


def check_runs(plan: RehearsalPlan, ref: RunResult, cut: RunResult, resumed: RunResult) -> list[Check]:
    """The rehearsal's checks on its three runs (see the module doc)."""
    cfg = plan.cfg
    runs = (ref, cut, resumed)
    hangs = [f"{r.name}: {r.hang}" for r in runs if r.hang]
    mismatches = [f"{r.name}: {e}" for r in runs for e in r.errors if "mismatch" in e]
    checks = [Check("collectives", not hangs and not mismatches,
                    "; ".join(hangs + mismatches) or "every rank called the same collectives (DETAIL), no step "
                                                     "over its limit")]
    ref_ok = ref.rc == 0 and [m[K.STEP] for m in ref.steps] == list(range(1, STEPS + 1))
    checks.append(Check("run", ref_ok, f"exit {ref.rc}, steps {[m[K.STEP] for m in ref.steps]}"
                        + ("" if ref.rc == 0 else f"; {'; '.join(ref.errors[-2:])}")))
    if not ref_ok:  # the rest reads the reference's steps and checkpoints
        return checks
    evals = [m[K.STEP] for m in ref.steps if K.EVAL_ACC in m]
    checks.append(Check("evaluation", len(evals) >= 2 and evals == [m[K.STEP] for m in ref.steps],
                        f"{K.EVAL_ACC} at steps {evals}"))
    ckpts = sorted(int(d.split("_")[1]) for d in os.listdir(os.path.join(cfg.out, "reference", "checkpoints"))
                   if d.startswith("step_") and d.split("_")[1].isdigit()) if ref.rc == 0 else []
    checks.append(Check("checkpoints", len(ckpts) >= 2, f"written at steps {ckpts}"))
    finite = all(m.get(K.SKIPPED_NONFINITE, 0) == 0 for m in ref.steps)
    checks.append(Check("finite", finite and ref_ok, "no update skipped for a non-finite loss or gradient norm"
                        if finite else f"an update was skipped ({K.SKIPPED_NONFINITE} > 0)"))
    if cfg.reward.mode.trains_rm:
        valid = sum(m.get(K.PAIRS_VALID, 0) for m in ref.steps)
        checks.append(Check("rm pairs", valid > 0, f"{valid:g} valid reward-model pairs over {len(ref.steps)} steps"))
    return checks + interrupted_checks(plan, ref, cut, resumed)


def interrupted_checks(plan: RehearsalPlan, ref: RunResult, cut: RunResult, resumed: RunResult,
                       folder: str = "cut", label: str = "") -> list[Check]:
    """The stop signal and the resume of the interrupted launches that ran in ``<out>/<folder>``,
    against the reference; ``label`` names a variant's settings in the checks' names."""
    stop_ckpt = os.path.join(plan.cfg.out, folder, "checkpoints", f"step_{STOP_STEP}")
    codes = sorted(set(cut.rank_exit_codes.values()))
    said = sum(bool(re.search(rf"preempted \(.*\) after step {STOP_STEP}\b", open(p, errors="replace").read()))
               for p in _rank_logs(cut.log_dir).values()) if cut.log_dir else 0
    # torchrun ends the other ranks with SIGTERM once the first has exited: a rank that had said so and
    # was still tearing down then shows -15
    preempted = EXIT_PREEMPTED in codes and set(codes) <= {EXIT_PREEMPTED, -signal.SIGTERM} and said == plan.nproc
    stopped = preempted and os.path.isdir(stop_ckpt) and len(cut.steps) == STOP_STEP
    suffix = f" [{label}]" if label else ""
    return [Check(f"stop signal{suffix}", stopped,
                  f"SIGUSR1 in step {STOP_STEP}: {said} of {plan.nproc} ranks wrote their part and said so, exit "
                  f"codes {codes} ({EXIT_PREEMPTED} expected), {len(cut.steps)} step(s), checkpoint step_{STOP_STEP} "
                  f"{'written' if os.path.isdir(stop_ckpt) else 'missing'}"),
            Check(f"resume{suffix}", *_resume_check(plan.cfg, ref, resumed, folder))]


def _resume_check(cfg: CooperConfig, ref: RunResult, resumed: RunResult, folder: str) -> tuple[bool, str]:
    if resumed.rc != 0 or resumed.resumed_from != STOP_STEP:
        return False, f"exit {resumed.rc}, resumed from step {resumed.resumed_from} (step {STOP_STEP} expected)"
    if len(ref.steps) != STEPS or len(resumed.steps) != STEPS:
        return False, f"{len(resumed.steps)} steps logged, {STEPS} expected"
    if cfg.rollout.uses_sglang:
        return True, (f"resumed from step {STOP_STEP} and finished; not compared with the reference: SGLang's CPU "
                      "backend does not honour per-request seeds, so two runs sample different rollouts")
    diffs = [f"step {a[K.STEP]}: {d}" for a, b in zip(ref.steps, resumed.steps) if (d := metrics_differ(a, b))]
    if diffs:
        return False, "metrics differ from the uninterrupted run's: " + "; ".join(diffs[:3])
    parts = ["policy"] + (["rm"] if cfg.reward.mode.trains_rm else [])
    final = f"step_{STEPS}"
    for part in parts:
        differ = weights_differ(os.path.join(cfg.out, "reference", "checkpoints", final, part),
                                 os.path.join(cfg.out, folder, "checkpoints", final, part))
        if differ:
            return False, f"{part} weights at {final} differ from the uninterrupted run's: {differ[:3]}"
    return True, (f"resumed from step {STOP_STEP}; every step's metrics and the {' and '.join(parts)} weights at "
                  f"{final} equal the uninterrupted run's bit for bit")


def check_real_shape_run(run: RunResult) -> list[Check]:
    """A real-shape rehearsal's checks: its steps ran, agreed, evaluated and stayed finite."""
    steps = [m[K.STEP] for m in run.steps]
    return [Check("collectives", not run.hang and not any("mismatch" in e for e in run.errors),
                  run.hang or "; ".join(run.errors) or "no step over its limit"),
            Check("run", run.rc == 0 and steps == list(range(1, REAL_STEPS + 1)), f"exit {run.rc}, steps {steps}"
                  + ("" if run.rc == 0 else f"; {'; '.join(run.errors[-2:])}")),
            Check("evaluation", any(K.EVAL_ACC in m for m in run.steps), f"{K.EVAL_ACC} logged"),
            Check("finite", run.rc == 0 and all(m.get(K.SKIPPED_NONFINITE, 0) == 0 for m in run.steps),
                  "no update skipped for a non-finite loss or gradient norm")]


def measure_phases(cfg: CooperConfig, run: RunResult, opts: PlanOptions) -> list[PhaseMeasure]:
    """Per-phase seconds (last step) and peak memory (over the steps) next to ``cooper plan``'s
    per-GPU prediction for the same config with ``opts`` (this device, these prompts)."""
    policy, rm, _ = load_shapes(cfg)
    planned = {p.phase: p.total / 2**30 for p in plan_memory(cfg, policy, rm, opts).given.phases}
    last = run.steps[-1] if run.steps else {}
    out = []
    for phase in (Phase.OFFLOAD, *PHASES, Phase.NEGATIVES, Phase.EVAL):
        peaks = [m[memory_key(phase)] for m in run.steps if memory_key(phase) in m]
        if time_key(phase) in last or peaks or phase in planned:
            out.append(PhaseMeasure(phase, last.get(time_key(phase)), max(peaks) if peaks else None,
                                    planned.get(phase)))
    return out


def rehearse(plan: RehearsalPlan, assets_root: str, limits: Limits,
             variants: Optional[list[list[str]]] = None) -> RehearsalReport:
    """Build the assets, run the launches, check them (see the module doc).

    ``variants``: lists of dotted settings that must not change the numbers (the engine's memory
    release, offloading): for each, the interrupted and resumed launches run again with those
    settings and must end on the reference's metrics and weights bit for bit.
    """
    cfg = plan.cfg
    os.makedirs(cfg.out, exist_ok=True)
    if plan.real_shape:
        opts = use_real_shape(plan, assets_root)
    else:
        _use_assets(cfg, build_assets(plan.shape, cfg.model.dtype, assets_root))
    counts: dict[str, int] = {}
    with StandInAssistant(cfg.rm.assistant_model) as assistant:
        if plan.assistant:
            cfg.rm.assistant_url = assistant.url
        validate(cfg, plan.nproc)
        cfg_path = os.path.join(cfg.out, "rehearsal.yaml")
        save_config(cfg, cfg_path)
        shutil.rmtree(os.path.join(cfg.out, "reference"), ignore_errors=True)
        ref = launch("reference", cfg_path, os.path.join(cfg.out, "reference"), plan.nproc, limits)
        if plan.real_shape:
            counts = dict(assistant.counts) if plan.assistant else {}
            report = RehearsalReport(plan, [ref], check_real_shape_run(ref), counts, measure_phases(cfg, ref, opts))
            _write(report)
            return report
        cut = resumed = RunResult("cut", None, [], 0.0, "", errors=["not run: the reference run failed"])
        runs, extra = [ref], []
        if ref.rc == 0:  # else the interrupted runs would fail the same way: report the reference's failure
            cut, resumed = interrupted_launches(plan, cfg_path, "cut", limits)
            runs += [cut, resumed]
            for i, settings in enumerate(variants or []):
                label = " ".join(settings)
                path = os.path.join(cfg.out, f"rehearsal.variant{i}.yaml")
                variant = load_config(cfg_path, settings)
                validate(variant, plan.nproc)
                save_config(variant, path)
                v_cut, v_resumed = interrupted_launches(plan, path, f"variant{i}", limits)
                runs += [v_cut, v_resumed]
                extra += interrupted_checks(plan, ref, v_cut, v_resumed, f"variant{i}", label)
        if plan.assistant:
            counts = dict(assistant.counts)
    report = RehearsalReport(plan, runs, check_runs(plan, ref, cut, resumed) + extra, counts)
    _write(report)
    return report


def interrupted_launches(plan: RehearsalPlan, cfg_path: str, folder: str, limits: Limits) -> tuple[RunResult, ...]:
    """The job of ``cfg_path`` in ``<out>/<folder>``: sent SIGUSR1 in step :data:`STOP_STEP`, then resumed."""
    out = os.path.join(plan.cfg.out, folder)
    shutil.rmtree(out, ignore_errors=True)
    fault = {FAULT_ENV: format_fault(Phase.ROLLOUT, STOP_STEP, sig=signal.SIGUSR1)}
    suffix = "" if folder == "cut" else f"-{folder}"
    cut = launch(f"cut{suffix}", cfg_path, out, plan.nproc, limits, env=fault)
    return cut, launch(f"resumed{suffix}", cfg_path, out, plan.nproc, limits, resume="auto")


def _write(report: RehearsalReport) -> None:
    with open(os.path.join(report.plan.cfg.out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=2, default=str)


def sglang_runs_here() -> bool:
    """Whether SGLang and its kernels import here (else the transformers engine stands in)."""
    try:
        importlib.import_module("sglang")
        importlib.import_module("sgl_kernel")
    except Exception:  # noqa: BLE001 - any failure (missing, CUDA-only kernels) means it cannot run here
        return False
    return True


def rehearse_preset(preset: str, overrides: Optional[list[str]] = None, out: str = "",
                    policy_config: Optional[str] = None, rm_config: Optional[str] = None,
                    limits: Optional[Limits] = None, at_real_shape: bool = False,
                    variants: Optional[list[list[str]]] = None) -> RehearsalReport:
    """Rehearse the preset at ``preset`` with ``overrides`` (dotted settings) in ``out`` (default
    ``runs/rehearse/<preset name>``; the assets are cached beside it, in ``assets/``).
    ``at_real_shape``: one process at the preset's model shape (on a GPU), see
    :func:`~cooper_mcore.rehearsal.preset.plan_rehearsal`. ``variants``: settings that must not
    change the numbers, each checked against the same reference (:func:`rehearse`).

    Raises:
        ValueError: the preset or its rehearsal config is invalid, or no model shape is found, or
            variants are asked of a real-shape rehearsal.
    """
    if at_real_shape and variants:
        raise ValueError("--variant needs the interrupted and resumed runs, which a --real-shape rehearsal does not "
                         "make; leave out one of them")
    preset = resolve_preset(preset)
    cfg = load_config(preset, overrides or [])
    try:
        policy, rm, _ = preset_model_shapes(cfg, preset, policy_config, rm_config)
        missing = None
    except ValueError as e:  # e.g. tiny_cpu.yaml before `cooper tiny-assets`: its models are that family
        if policy_config:
            raise
        tiny = tiny_hf_config("qwen2_tied").to_dict()
        policy, rm = ModelShape(ArchSpec.from_hf_config(tiny), tiny, "the tiny qwen2 (tied)"), None
        missing = Substitution("model shape", "not found", "qwen2 (tied), as `cooper tiny-assets` makes", str(e))
    # the preset's own settings (its engine's too) pass the checks `cooper train` runs, before any is swapped
    validate(cfg, None, Elsewhere(None if missing else policy.arch, rm.arch if rm and not missing else None))
    plan = plan_rehearsal(preset, cfg, policy.arch, rm.arch if rm else None, sglang_available=sglang_runs_here(),
                          at_real_shape=at_real_shape)
    swapped = [str(sub) for sub in plan.substitutions if sub.setting == "rollout.engine"]
    if swapped:
        logger.info("the preset's settings pass the trainer's checks; the rehearsal swaps %s", swapped[0])
    if at_real_shape:
        plan.model_configs = {"model.policy_config": policy.hf_config,
                              **({"model.rm_config": rm.hf_config} if rm is not None else {})}
    if missing:
        plan.substitutions.insert(0, missing)
    stem = os.path.splitext(os.path.basename(preset))[0]
    plan.cfg.out = os.path.abspath(out or os.path.join("runs", "rehearse", stem))
    return rehearse(plan, os.path.join(os.path.dirname(plan.cfg.out), "assets"), limits or Limits(), variants)
