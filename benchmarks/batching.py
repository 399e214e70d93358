"""Benchmark micro-batching of a GRPO-shaped batch: fixed micro-batches vs a token budget vs packing.

One GRPO mini-batch (``--prompts`` prompts of 20-200 tokens, ``--group`` responses each, response
lengths log-normal with median ``--median-response`` tokens, cut at ``--max-response`` = 1024: a
long tail) goes through the two passes the trainer runs on it, with the model and forward
functions of cooper_mcore directly (TP = PP = 1, the torch-native spec):

* the log-probability pass: forward without gradients, per-token log-probabilities by
  vocab-parallel cross entropy;
* a policy-update-shaped pass: forward and backward of a token-mean clipped-ratio loss, micro-batch
  by micro-batch (gradient accumulation; no optimizer step).

Three ways to form the micro-batches:

* ``fixed``: as the trainer does today: every row padded to the longest sequence of the
  mini-batch (rounded up to 8), ``--micro-batch-size`` rows per micro-batch, in rollout order;
* ``token_budget``: :func:`cooper_mcore.micro_batching.planning.plan_micro_batches` with the padded cost and
  ``--max-tokens``; each micro-batch padded to its own longest row (rounded up to 8);
* ``packing``: the same planner with the packed cost; each micro-batch is one packed row
  (:func:`cooper_mcore.micro_batching.packing.pack_rows`, rounded up to 8) run with ``PackedSeqParams``.

Times: one process, one model; every method's log-probability pass runs once to warm up, then the
methods are timed in turn, ``--repeats`` rounds (so that a change of machine load hits all of
them); the best round of each is reported (on a shared machine the least disturbed one).
Peak memory: each method once more in its own fresh process (same seed, same weights): on a GPU
``torch.cuda.max_memory_allocated`` above what was allocated before the passes, on the CPU the
growth of the peak resident set size over them. Prints a table; the last line is
``token_budget_speedup=<x> packing_speedup=<y> packed_padding=<fraction>`` (speedups of the
log-probability pass plus the update over ``fixed``; padding = padded slots / all slots).

    python benchmarks/batching.py                 # CPU: the tiny shape, 64 sequences
    python benchmarks/batching.py --shape qwen2.5-1.5b --prompts 16 --max-tokens 16384   # GPU
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue as queue_module
import resource
import time
from dataclasses import dataclass

import torch
from shapes import SHAPES  # benchmarks/shapes.py (scripts run from their folder)

METHODS = ("fixed", "token_budget", "packing")
MULTIPLE = 8  # row lengths are rounded up to a multiple of 8, as the trainer pads


@dataclass
class Result:
    method: str
    micro_batches: int
    slots: int  # token positions computed, padding included
    tokens: int  # real tokens
    logprob_s: float
    update_s: float
    peak_mib: float = math.nan

    @property
    def padding(self) -> float:
        return 1.0 - self.tokens / self.slots


def grpo_lengths(prompts: int, group: int, median: int, max_response: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths in rollout order: a group shares its prompt; responses log-normal."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(prompts):
        p = int(torch.randint(20, 201, (1,), generator=g))
        z = torch.randn(group, generator=g)
        for r in (median * torch.exp(0.9 * z)).round().clamp(1, max_response).long().tolist():
            out.append((p, r))
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Setup:
    """The model, the batch and each method's micro-batches, built alike in every process."""

    def __init__(self, args: argparse.Namespace, methods: list[str]) -> None:
        import transformers

        from cooper_mcore.micro_batching.packing import pack_rows, round_up
        from cooper_mcore.micro_batching.planning import plan_micro_batches
        from cooper_mcore.models.arch import ArchSpec
        from cooper_mcore.models.builder import build_model
        from cooper_mcore.models.forward import shifted_labels
        from cooper_mcore.parallel import ParallelConfig, device

        shape = dict(SHAPES[args.shape], max_position_embeddings=4096)
        cfg = transformers.Qwen2Config(**shape)
        cfg.architectures = ["Qwen2ForCausalLM"]
        arch = ArchSpec.from_hf_config(cfg.to_dict())
        self.dev = device()
        pairs = grpo_lengths(args.prompts, args.group, args.median_response, args.max_response, args.seed)
        lengths = torch.tensor([p + r for p, r in pairs])
        n, width = len(pairs), round_up(int(lengths.max()), MULTIPLE)
        g = torch.Generator().manual_seed(args.seed + 1)
        ids = torch.randint(1, arch.vocab_size, (n, width), generator=g)
        ids[torch.arange(width)[None, :] >= lengths[:, None]] = 0
        labels = shifted_labels(ids)
        mask = torch.zeros(n, width)
        for i, (p, r) in enumerate(pairs):
            mask[i, p - 1:p + r - 1] = 1.0
        adv = torch.randn(n, generator=g)[:, None].expand(n, width).contiguous()
        self.tokens = int(lengths.sum())
        self.total = mask.sum().to(self.dev)
        self.micro: dict[str, list] = {}  # method -> [(model input, labels, mask, advantages, slots)]
        for method in methods:
            if method == "fixed":
                groups = [list(range(i, min(i + args.micro_batch_size, n)))
                          for i in range(0, n, args.micro_batch_size)]
            else:
                cost = "packed" if method == "packing" else "padded"
                groups = plan_micro_batches(lengths.tolist(), args.max_tokens, cost=cost).for_rank(0)
            micro = []
            for rows in groups:
                if method == "packing":
                    pk = pack_rows(ids, lengths, rows, pad_id=0, multiple_of=MULTIPLE)
                    micro.append((pk, pk.pack(labels), pk.pack(mask), pk.pack(adv), pk.width))
                else:
                    w = width if method == "fixed" else round_up(int(lengths[rows].max()), MULTIPLE)
                    r = torch.tensor(rows)
                    micro.append((ids[r, :w], labels[r, :w], mask[r, :w], adv[r, :w], len(rows) * w))
            self.micro[method] = micro
        torch.manual_seed(0)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        self.model = build_model(arch, ParallelConfig(), dtype=dtype)

    def result(self, method: str, logprob_s: float, update_s: float) -> Result:
        micro = self.micro[method]
        return Result(method, len(micro), sum(m[4] for m in micro), self.tokens, logprob_s, update_s)

    def _logits(self, method: str, x) -> torch.Tensor:
        from cooper_mcore.micro_batching.runner import forward_packed
        from cooper_mcore.models.forward import position_ids_for

        if method == "packing":
            return forward_packed(self.model, x)
        x = x.to(self.dev)
        return self.model(x, position_ids_for(x), None)

    def logprob_pass(self, method: str) -> None:
        from cooper_mcore.train.tokens import token_logprobs

        self.model.eval()
        with torch.no_grad():
            for x, lab, _, _, _ in self.micro[method]:
                token_logprobs(self._logits(method, x), lab.to(self.dev))

    def update_pass(self, method: str) -> None:
        from cooper_mcore.train.tokens import token_logprobs

        self.model.train()
        self.model.zero_grad(set_to_none=True)
        dev = self.dev
        for x, lab, m, a, _ in self.micro[method]:
            logp = token_logprobs(self._logits(method, x), lab.to(dev))
            ratio = torch.exp(logp - logp.detach())
            a = a.to(dev)
            loss = -(torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) * m.to(dev)).sum()
            (loss / self.total).backward()


def _timed(fn, *args) -> float:
    _sync()
    t0 = time.perf_counter()
    fn(*args)
    _sync()
    return time.perf_counter() - t0


def _time_methods(args: argparse.Namespace, methods: list[str], queue) -> None:
    """One process, one model: warm up every method, then time them in turn, ``repeats`` rounds (best kept)."""
    from cooper_mcore.parallel import single_process_world

    if args.threads:
        torch.set_num_threads(args.threads)
    with single_process_world():
        setup = _Setup(args, methods)
        for m in methods:
            setup.logprob_pass(m)
        times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in methods}
        for _ in range(args.repeats):
            for m in methods:
                times[m][0].append(_timed(setup.logprob_pass, m))
                times[m][1].append(_timed(setup.update_pass, m))
    queue.put({m: setup.result(m, min(times[m][0]), min(times[m][1])) for m in methods})


def _peak_memory(args: argparse.Namespace, method: str, queue) -> None:
    """A fresh process: peak memory (MiB) of one log-probability pass and one update with ``method``."""
    from cooper_mcore.parallel import single_process_world

    if args.threads:
        torch.set_num_threads(args.threads)
    with single_process_world():
        setup = _Setup(args, [method])
        cuda = torch.cuda.is_available()
        base = torch.cuda.memory_allocated() if cuda else _rss_bytes()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        setup.logprob_pass(method)
        setup.update_pass(method)
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((peak - base) / 2**20)


def _in_process(target, *args):
    """Run ``target(*args, queue)`` in a fresh (spawned) process and return what it puts."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    while True:
        try:
            out = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} failed in its process (exit code {proc.exitcode})") from None
    proc.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="fixed micro-batches vs token budget vs packing on a GRPO batch")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--median-response", type=int, default=150)
    p.add_argument("--max-response", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch of 'fixed'")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget per micro-batch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    results = _in_process(_time_methods, args, methods)
    for m in methods:
        results[m].peak_mib = _in_process(_peak_memory, args, m)

    pairs = grpo_lengths(args.prompts, args.group, args.median_response, args.max_response, args.seed)
    resp = sorted(r for _, r in pairs)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    print(f"{args.shape} shape on {where}; {len(pairs)} sequences ({args.prompts} prompts x {args.group}), "
          f"{results[methods[0]].tokens} tokens; responses median {resp[len(resp) // 2]}, max {resp[-1]}; "
          f"fixed: {args.micro_batch_size} rows per micro-batch; budget: {args.max_tokens} tokens")
    print(f"{'method':<13}{'micro-b.':>9}{'padding':>9}{'logprob tok/s':>15}{'update tok/s':>14}"
          f"{'both s':>9}{'peak MiB':>10}")
    for r in results.values():
        print(f"{r.method:<13}{r.micro_batches:>9}{r.padding:>9.1%}{r.tokens / r.logprob_s:>15.0f}"
              f"{r.tokens / r.update_s:>14.0f}{r.logprob_s + r.update_s:>9.2f}{r.peak_mib:>10.0f}")

    def speedup(name: str) -> float:
        if "fixed" not in results or name not in results:
            return math.nan
        fixed, r = results["fixed"], results[name]
        return (fixed.logprob_s + fixed.update_s) / (r.logprob_s + r.update_s)

    packed = results["packing"].padding if "packing" in results else math.nan
    print(f"token_budget_speedup={speedup('token_budget'):.2f} packing_speedup={speedup('packing'):.2f} "
          f"packed_padding={packed:.3f}")


if __name__ == "__main__":
    main()
