"""Benchmark one full Cooper step on one device: time and peak memory per phase.

Everything colocated on one device (GPU, or the CPU with ``--tiny``): the Megatron policy with its
optimizer and the host-copy reference, the VerifyRM being trained, and the transformers rollout
engine. Built with :func:`cooper_mcore.rl.setup.build_run` from a config like
``examples/tiny_cpu.yaml`` and stepped with :func:`cooper_mcore.rl.step.cooper_step`, exactly as
``cooper train`` does, in two settings, each in a fresh process:

* ``no-offload``: training state stays on the device while the engine generates;
* ``offload``: the policy's and the RM's parameters, gradients and optimizer states move to host
  memory around the rollout (``offload.*: true``).

Per phase (``offload``, ``rollout``, ``rm_score``, ``logprobs``, ``policy_update``, ``rm_update``,
``weight_sync``): seconds, and the peak memory while it ran: ``torch.cuda.max_memory_allocated``
(reset at the phase's start) on a GPU; on CPU the process's resident set size: its high-water mark
(``VmHWM``, reset at the phase's start through ``/proc/self/clear_refs``, Linux), with the
allocator returning every block above 128 KiB to the system when freed (``MALLOC_MMAP_THRESHOLD_``),
so that the resident set follows the live tensors; elsewhere sampled every 5 ms.
Negatives come from answer perturbation (``rm.negatives=perturb``: no assistant server).

    python benchmarks/cooper_step.py              # GPU: policy and RM with the Qwen2.5-1.5B shape, bf16
    python benchmarks/cooper_step.py --tiny       # CPU: tiny assets (`cooper tiny-assets`), seconds
    python benchmarks/cooper_step.py --tiny --vocab 151936 --max-new-tokens 128   # CPU: the logits dominate
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil
import torch
from shapes import SHAPES  # benchmarks/shapes.py (scripts run from their folder)

from cooper_mcore.metric_names import MetricKey, Phase, time_key

PHASES = (Phase.OFFLOAD, Phase.ROLLOUT, Phase.RM_SCORE, Phase.LOGPROBS, Phase.POLICY_UPDATE, Phase.RM_UPDATE,
          Phase.WEIGHT_SYNC)
VARIANTS = {"no-offload": [], "offload": [f"offload.{m}_{k}=true" for m in ("policy", "rm")
                                          for k in ("params", "grads", "optimizer")]}


#: the CPU allocator returns blocks above this to the system when freed (child processes' environment)
MMAP_THRESHOLD = 131072


def _hwm_bytes() -> int:
    """This process's resident-set high-water mark (``VmHWM``), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _reset_hwm() -> bool:
    """Reset the high-water mark to the current resident set (Linux >= 4.0); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _RssSampler:
    """The largest resident set size since :meth:`reset`: the kernel's high-water mark where it can
    be reset (exact), and a background thread's samples every 5 ms."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._hwm = _reset_hwm()
        self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def reset(self) -> None:
        self.peak = self._proc.memory_info().rss
        if self._hwm:
            _reset_hwm()

    def read(self) -> int:
        return max(self.peak, self._proc.memory_info().rss, _hwm_bytes() if self._hwm else 0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class PhaseProbe:
    """A :class:`cooper_mcore.metrics.PhaseTimer` that also records each phase's peak memory."""

    def __init__(self) -> None:
        from cooper_mcore.metrics import PhaseTimer

        self.cuda = torch.cuda.is_available()
        self.timer = PhaseTimer(sync=torch.cuda.synchronize if self.cuda else None)
        self.rss = None if self.cuda else _RssSampler()
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.rss.reset()
        with self.timer.phase(name):
            yield
        peak = torch.cuda.max_memory_allocated() if self.cuda else self.rss.read()
        self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def pop(self) -> tuple[dict[str, float], dict[str, int]]:
        times, peaks = self.timer.pop(), self.peaks
        self.peaks = {}
        return times, peaks


def make_assets(out: str, shape: str, vocab: int = 0, dtype: str = "") -> dict[str, str]:
    """Prompts, a tokenizer and policy/RM checkpoints: the tiny assets, or (``qwen2.5-1.5b``) the
    same data with random bf16 models of the Qwen2.5-1.5B shape (VerifyRM has that shape too), or
    (``tiny`` with ``vocab``) random models of the tiny shape with a ``vocab``-entry vocabulary, in
    ``dtype`` (the tokenizer's ids are the first entries; ids past them decode to nothing)."""
    from cooper_mcore.demo.assets import build_tiny_assets

    paths = build_tiny_assets(out, n_train=256, n_eval=8)
    if shape == "tiny" and not vocab:
        return paths
    import shutil

    from cooper_mcore.convert.hf import hf_to_mcore
    from cooper_mcore.models.tiny import save_tiny_hf_model

    dims = dict(SHAPES[shape], **({"vocab_size": vocab} if vocab else {}))
    dtype = dtype or ("float32" if shape == "tiny" else "bfloat16")
    name = f"{shape}-v{vocab}-{dtype}" if vocab else shape
    big = {}
    for kind, family in (("causal_lm", "qwen2_tied"), ("reward", "qwen2")):
        hf = os.path.join(out, f"{name}-{kind}-hf")
        ckpt = os.path.join(out, f"{name}-{kind}-mcore")
        if not os.path.exists(ckpt):
            save_tiny_hf_model(hf, family, kind, dtype=getattr(torch, dtype), **dims)
            shutil.copytree(paths["tokenizer"], hf, dirs_exist_ok=True)
            hf_to_mcore(hf, ckpt)
        big[kind] = (hf, ckpt)
    paths.update(policy_hf=big["causal_lm"][0], policy_ckpt=big["causal_lm"][1], rm_ckpt=big["reward"][1])
    return paths


def run_variant(assets: str, shape: str, variant: str, steps: int, prompts: int, group: int,
                max_new_tokens: int, mbs: int, vocab: int = 0, dtype: str = "") -> dict:
    """Build the run and time ``steps`` Cooper steps (the first is a warm-up); return the last."""
    from cooper_mcore.config.schema import load_config
    from cooper_mcore.rl.setup import build_run
    from cooper_mcore.rl.step import cooper_step

    dtype = dtype or ("float32" if shape == "tiny" else "bfloat16")
    paths = make_assets(assets, shape, vocab, dtype)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    overrides = [
        f"out={os.path.join(assets, 'run-' + variant)}", f"model.policy_ckpt={paths['policy_ckpt']}",
        f"model.policy_hf={paths['policy_hf']}", f"model.rm_ckpt={paths['rm_ckpt']}", f"model.dtype={dtype}",
        f"data.train_path={paths['train']}", f"data.eval_path={paths['eval']}", "eval.every=0",
        "checkpoint.every=0", "logging.wandb=false", "rm.negatives=perturb", "reward.mode=cooper",
        f"rollout.group_size={group}", f"rollout.max_new_tokens={max_new_tokens}", f"train.prompts_per_step={prompts}",
        f"train.micro_batch_size={mbs}", "optim.lr=1e-6", "rm.optim.lr=1e-5", *VARIANTS[variant]]
    cfg = load_config(os.path.join(root, "examples", "tiny_cpu.yaml"), overrides)
    run = build_run(cfg)
    probe = PhaseProbe()
    for _ in range(steps):
        result = cooper_step(run, run.data.next_batch(), probe)
        run.step += 1
        times, peaks = probe.pop()
    if run.verifier is not None:
        run.verifier.close()
    at_rest = torch.cuda.memory_allocated() if torch.cuda.is_available() else psutil.Process().memory_info().rss
    engine = {k: v for k, v in result.rollouts.to_metrics().items() if k.startswith("rollout/")}
    return {"times": times, "peaks": peaks, "at_rest": at_rest, "config_overrides": overrides, "engine": engine,
            "policy_config": os.path.join(paths["policy_hf"], "config.json"),
            "response_length": result.rollouts.response_length, "sequences": prompts * group}


def main() -> None:
    p = argparse.ArgumentParser(description="one Cooper step: time and peak memory per phase")
    p.add_argument("--tiny", action="store_true", help="tiny assets on CPU (float32), seconds")
    p.add_argument("--steps", type=int, default=2, help="steps per setting; the last is reported")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (GPU 8, tiny 4)")
    p.add_argument("--group", type=int, default=None, help="rollouts per prompt (GPU 16, tiny 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="GPU 512, tiny 16")
    p.add_argument("--micro-batch", type=int, default=None, help="GPU 8, tiny 8")
    p.add_argument("--vocab", type=int, default=0,
                   help="with --tiny: random tiny-shape models with this vocabulary (the logits dominate)")
    p.add_argument("--bf16", action="store_true", help="with --vocab: the random tiny models in bf16")
    p.add_argument("--workdir", default=None, help="assets are kept here (default: a temporary folder)")
    p.add_argument("--json", default=None, help="also write every setting's times and peaks as JSON here")
    p.add_argument("--variant", choices=sorted(VARIANTS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = "tiny" if args.tiny else "qwen2.5-1.5b"
    dtype = "float32" if args.tiny and not args.bf16 else "bfloat16"
    prompts = args.prompts or (4 if args.tiny else 8)
    group = args.group or (4 if args.tiny else 16)
    new_tokens = args.max_new_tokens or (16 if args.tiny else 512)
    mbs = args.micro_batch or 8
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.variant:  # a child process: one setting
        result = run_variant(args.workdir, shape, args.variant, args.steps, prompts, group, new_tokens, mbs, args.vocab,
                             dtype)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return

    if (args.vocab and not args.tiny) or (args.bf16 and not args.vocab):
        p.error("--vocab needs --tiny, --bf16 needs --vocab")
    work = args.workdir or tempfile.mkdtemp(prefix="cooper-bench-step-")
    make_assets(work, shape, args.vocab, dtype)  # once, before the timed processes
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))  # freed CPU tensors leave the resident set
    results = {}
    for variant in VARIANTS:
        out = os.path.join(work, f"result-{variant}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--workdir", work, "--result", out,
               "--steps", str(args.steps), "--prompts", str(prompts), "--group", str(group),
               "--max-new-tokens", str(new_tokens), "--micro-batch", str(mbs), "--vocab", str(args.vocab)] + \
            (["--tiny"] if args.tiny else []) + (["--bf16"] if args.bf16 else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{r.stderr[-4000:]}")
        with open(out) as f:
            results[variant] = json.load(f)
        results[variant]["wall"] = time.perf_counter() - t0
    vocab = args.vocab or SHAPES[shape]["vocab_size"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "dtype": dtype, "vocab": vocab, "prompts": prompts, "group": group,
                       "max_new_tokens": new_tokens, "micro_batch": mbs,
                       "overrides": {v: VARIANTS[v] for v in results}, "results": results}, f, indent=2)
    gib = 2**30
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    mem = "torch.cuda.max_memory_allocated" if torch.cuda.is_available() else "process RSS"
    first = next(iter(results.values()))
    print(f"\none Cooper step, {shape} policy and RM ({dtype}, vocabulary {vocab}), "
          "transformers engine, "
          f"everything colocated on {dev}; {first['sequences']} rollouts ({prompts} prompts x {group}), "
          f"max {new_tokens} new tokens (mean {first['response_length']:.0f}); step {args.steps} of {args.steps}; "
          f"torch {torch.__version__}")
    head = " | ".join(f"{v} s | {v} peak GiB" for v in results)
    print(f"| phase | {head} |")
    print("|---|" + "---|" * (2 * len(results)))
    for ph in (*PHASES, "step"):
        cells = []
        for res in results.values():
            t = res["times"].get(MetricKey.TIME_STEP if ph == "step" else time_key(ph))
            peak = max(res["peaks"].values()) if ph == "step" else res["peaks"].get(ph)
            cells += [f"{t:.3f}" if t is not None else "-", f"{peak / gib:.2f}" if peak is not None else "-"]
        print(f"| {ph} | " + " | ".join(cells) + " |")
    print("| at rest after the step | " + " | ".join(f"- | {r['at_rest'] / gib:.2f}" for r in results.values())
          + " |")
    print(f"peak memory per phase: {mem} during the phase ('offload' covers offload and onload together).")
    if not torch.cuda.is_available():
        print("on CPU the peak is the process's resident set: models, optimizer states and the engine included.")
    for name, res in results.items():
        if res.get("engine"):
            print(f"{name}: engine vs trainer: " + ", ".join(f"{k} {v:.3g}" for k, v in res["engine"].items()))


if __name__ == "__main__":
    main()
