"""Benchmark a mixture-of-experts training step: tokens/s at expert-parallel sizes, and the share of
the step spent dispatching tokens to the experts.

A Qwen3-MoE-like model built by :func:`cooper_mcore.models.builder.build_model` (megatron's router,
alltoall token dispatcher, every layer sparse; the experts grouped (:class:`~cooper_mcore.models.experts.
GroupedExperts`, grouped matrix multiplies) or megatron's ``SequentialMLP``, ``--experts``), wrapped for training as the
trainer does (:func:`~cooper_mcore.train.step.wrap_for_training`: megatron DDP, distributed optimizer,
per-token loss) and stepped with :func:`~cooper_mcore.train.step.train_step` on random tokens. Each
(ranks, EP) setting runs in its own ``torchrun`` world (gloo on CPU, NCCL on GPUs); every rank is a
data-parallel replica of the dense part with its own batch, and EP splits the experts.

Dispatch time is measured by wrapping megatron's ``MoEAlltoAllTokenDispatcher`` methods (forward:
``dispatch_preprocess``, ``token_dispatch``, ``dispatch_postprocess``, ``combine_preprocess``,
``token_combine``, ``combine_postprocess``: permutation and all-to-all) and the all-to-all's autograd
function (``tensor_parallel.mappings._AllToAll``, forward and backward), with a device synchronise
around each call on GPUs. The backward of the permutations is not counted, so the share is a lower
bound. Rank 0's figures are reported; the table is printed after every run (a run stopped at a time
limit keeps what it measured), and a non-finite loss ends the benchmark with an error. The experts
column says how the grouped experts multiplied: ``torch._grouped_mm`` or, where it is not known
correct (:func:`~cooper_mcore.models.experts.grouped_mm_supported`), one matmul per expert.

    python benchmarks/moe_step.py                 # CPU: hidden 256, 8 experts, top 2; 1 rank EP=1, 2 ranks EP=1, EP=2
    python benchmarks/moe_step.py --gpu           # GPUs: Qwen3-30B-A3B's layer shape, 4 layers, bf16
    python benchmarks/moe_step.py --gpu --settings 1x1 --experts grouped,sequential   # both experts, one GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import megatron.core
import torch
import torch.distributed as dist
from lm_step import megatron_lm_step  # benchmarks/lm_step.py (scripts run from their folder)
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.experts import GroupedExperts, grouped_mm_supported
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed

logger = logging.getLogger("moe_step")

_COMMON = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
               mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.001, rope_theta=1e6,
               rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=8192)
#: the vocabulary is cut to 4096 in both shapes so that the step is the layers', not the output head's
SHAPES: dict[str, dict[str, Any]] = {
    "cpu": dict(_COMMON, hidden_size=256, intermediate_size=768, moe_intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=4096, num_experts=8,
                num_experts_per_tok=2),
    # Qwen3-30B-A3B's layer (examples/model_configs/qwen3-30b-a3b.json), 4 of its 48 layers
    "gpu": dict(_COMMON, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=4096, num_experts=128,
                num_experts_per_tok=8),
}
DISPATCHER_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                      "token_combine", "combine_postprocess")
TIMES: defaultdict[str, float] = defaultdict(float)  # seconds per timed part, since the last reset


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable, key: str) -> Callable:
    """``fn`` adding its wall time (device synchronised) to ``TIMES[key]``."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync()
        TIMES[key] += time.perf_counter() - t0
        return out
    return wrapper


def instrument_dispatch() -> None:
    """Time megatron's alltoall dispatcher (forward) and its all-to-all (forward and backward)."""
    for name in DISPATCHER_METHODS:
        setattr(MoEAlltoAllTokenDispatcher, name, _timed(getattr(MoEAlltoAllTokenDispatcher, name), "dispatcher"))
    a2a = mappings._AllToAll
    # autograd looks forward and backward up on the class (on CPU, compat.cpu gives it list splits)
    a2a.forward = staticmethod(_timed(a2a.forward, "a2a_fwd"))
    a2a.backward = staticmethod(_timed(a2a.backward, "a2a_bwd"))


def make_step(shape: dict[str, Any], ep: int, batches: list[torch.Tensor],
              dtype: torch.dtype, grouped: bool = True) -> tuple[Callable[[], float], str]:
    """A training step of the MoE model on ``batches`` (one optimizer step; it returns the mean loss),
    and how its experts multiply: ``torch._grouped_mm``, one matmul per expert, or ``SequentialMLP``."""
    arch = ArchSpec.from_hf_config(dict(shape))
    model = build_model(arch, ParallelConfig(ep=ep), dtype=dtype, grouped_experts=grouped)
    experts = next((m for m in model.modules() if isinstance(m, GroupedExperts)), None)
    kernel = "SequentialMLP"
    if experts is not None:
        w = experts.linear_fc1.weight
        kernel = ("torch._grouped_mm" if grouped_mm_supported(w.new_empty((0, w.shape[2])), w)
                  else "one matmul per expert")
    step, _ = megatron_lm_step(model, batches)
    return step, kernel

def worker(args: argparse.Namespace) -> None:
    """One rank of a ``torchrun`` world: time the steps, rank 0 writes the figures to ``args.out``."""
    shape = SHAPES["gpu" if args.gpu else "cpu"]
    init_distributed(ParallelConfig(ep=args.ep))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        gen = torch.Generator().manual_seed(rank)  # each data-parallel rank has its own tokens
        batches = [torch.randint(0, shape["vocab_size"], (args.micro_batch, args.seq), generator=gen)
                   for _ in range(args.micro_batches)]
        instrument_dispatch()
        step, kernel = make_step(shape, args.ep, batches, torch.bfloat16 if args.gpu else torch.float32,
                                 args.experts == "grouped")
        for _ in range(args.warmup):
            step()
        TIMES.clear()
        times, loss = [], float("nan")
        for _ in range(args.steps):
            _sync()
            t0 = time.perf_counter()
            loss = step()
            _sync()
            times.append(time.perf_counter() - t0)
        median = sorted(times)[len(times) // 2]
        if rank == 0:
            row = {"ranks": world, "ep": args.ep, "experts": args.experts, "kernel": kernel,
                   "experts_per_rank": shape["num_experts"] // args.ep,
                   "tokens_per_step": world * args.micro_batch * args.seq * args.micro_batches,
                   "ms_per_step": median * 1e3, "loss": loss, "total_s": sum(times),
                   **{f"{k}_s": v for k, v in TIMES.items()}}
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(row, f)
    finally:
        destroy_distributed()


def run_setting(ranks: int, ep: int, experts: str, args: argparse.Namespace, passthrough: list[str]) -> dict[str, Any]:
    """Run one (ranks, EP, experts) setting in its own ``torchrun`` world and return rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               os.path.abspath(__file__), "--worker", "--ep", str(ep), "--out", out, "--experts", experts,
               *passthrough]
        env = dict(os.environ)
        if not args.gpu:  # the cores are shared between the ranks
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
        subprocess.run(cmd, check=True, env=env)
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The markdown table of the settings' figures."""
    dev = torch.cuda.get_device_name() if args.gpu else f"CPU ({os.cpu_count()} cores, gloo)"
    shape = SHAPES["gpu" if args.gpu else "cpu"]
    lines = [f"shape {'gpu (Qwen3-30B-A3B layers)' if args.gpu else 'cpu'}: hidden {shape['hidden_size']}, "
             f"{shape['num_hidden_layers']} layers, {shape['num_experts']} experts top {shape['num_experts_per_tok']} "
             f"(expert FFN {shape['moe_intermediate_size']}), vocab {shape['vocab_size']}; "
             f"{'bf16' if args.gpu else 'fp32'}; {args.micro_batches} micro-batches x {args.micro_batch} x "
             f"{args.seq} tokens per rank; {dev}; torch {torch.__version__}, megatron-core "
             f"{megatron.core.__version__}; median of {args.steps} steps after {args.warmup}"
             + (f", median run of {args.repeat}" if args.repeat > 1 else ""),
             "| ranks | EP | experts | experts/rank | tokens/step | ms/step | tokens/s | dispatcher fwd (ms/step) "
             "| all-to-all fwd+bwd (ms/step) | dispatch share | loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        dispatcher = r.get("dispatcher_s", 0.0) / args.steps
        a2a = (r.get("a2a_fwd_s", 0.0) + r.get("a2a_bwd_s", 0.0)) / args.steps
        share = (dispatcher + r.get("a2a_bwd_s", 0.0) / args.steps) / (r["total_s"] / args.steps)
        lines.append(f"| {r['ranks']} | {r['ep']} | {r['experts']} ({r['kernel']}) | {r['experts_per_rank']} | "
                     f"{r['tokens_per_step']} | "
                     f"{r['ms_per_step']:.1f} | {r['tokens_per_step'] / r['ms_per_step'] * 1e3:,.0f} | "
                     f"{dispatcher * 1e3:.1f} | {a2a * 1e3:.1f} | {share:.1%} | {r['loss']:.4f} |")
    return "\n".join(lines)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The options, and those a worker must see too."""
    p = argparse.ArgumentParser(description="MoE training step: tokens/s by expert-parallel size, dispatch share")
    p.add_argument("--gpu", action="store_true", help="Qwen3-30B-A3B's layer shape in bf16 on the GPUs")
    p.add_argument("--settings", default=None,
                   help="comma-separated RANKSxEP, e.g. 1x1,2x1,2x2 (CPU default); GPU default: 1x1 and NxN "
                        "for the N GPUs present")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (CPU 256, GPU 4096)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (CPU 2, GPU 1)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every setting this many times, alternating the expert modules; report the median run")
    p.add_argument("--experts", default="grouped,sequential",
                   help="comma-separated expert modules to time: grouped (grouped matmuls), sequential (SequentialMLP)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.seq = args.seq or (4096 if args.gpu else 256)
    args.micro_batch = args.micro_batch or (1 if args.gpu else 2)
    passthrough = ["--seq", str(args.seq), "--micro-batch", str(args.micro_batch), "--micro-batches",
                   str(args.micro_batches), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    return args, passthrough + (["--gpu"] if args.gpu else [])


def default_settings(gpu: bool) -> list[tuple[int, int]]:
    """CPU: 1 rank at EP=1, 2 ranks at EP=1 and EP=2; GPU: 1 GPU at EP=1, all N GPUs at EP=N."""
    if not gpu:
        return [(1, 1), (2, 1), (2, 2)]
    n = torch.cuda.device_count()
    if n < 1:
        raise ValueError("--gpu: no CUDA device here")
    return [(1, 1)] + ([(n, n)] if n > 1 else [])


def parse_settings(text: str) -> list[tuple[int, int]]:
    """``"1x1,2x2"`` -> [(1, 1), (2, 2)] (ranks, EP).

    Raises:
        ValueError: an entry that is not RANKSxEP with EP dividing RANKS, naming it.
    """
    out = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) % int(parts[1]):
            raise ValueError(f"--settings entry {item!r} is not RANKSxEP with EP dividing RANKS (e.g. 2x2)")
        out.append((int(parts[0]), int(parts[1])))
    return out


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # megatron's INFO is verbose
    logger.setLevel(logging.INFO)
    args, passthrough = parse_args()
    if args.worker:
        worker(args)
        return
    settings = parse_settings(args.settings) if args.settings else default_settings(args.gpu)
    kinds = [k.strip() for k in args.experts.split(",")]
    if not kinds or any(k not in ("grouped", "sequential") for k in kinds):
        raise ValueError(f"--experts {args.experts!r}: a comma-separated list of grouped and sequential")
    rows: list[dict[str, Any]] = []
    for ranks, ep in settings:
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
        for _ in range(args.repeat):  # alternating, so that a busy spell of a shared machine hits both
            for kind in kinds:
                logger.info("ranks=%d ep=%d experts=%s ...", ranks, ep, kind)
                runs[kind].append(run_setting(ranks, ep, kind, args, passthrough))
                # the table so far after every run: a run stopped at its time limit keeps what it measured
                print(table(rows + [median_run(r) for r in runs.values() if r], args) + "\n", flush=True)
                if not math.isfinite(runs[kind][-1]["loss"]):
                    raise SystemExit(f"moe_step: ranks={ranks} ep={ep} experts={kind}: non-finite loss")
        rows += [median_run(r) for r in runs.values()]


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median step time."""
    return sorted(runs, key=lambda x: x["ms_per_step"])[len(runs) // 2]


if __name__ == "__main__":
    main()
