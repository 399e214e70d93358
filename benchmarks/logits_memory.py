"""Benchmark the memory of the policy loss over the logits: the chunked log-probabilities and entropy
against the previous full-vocabulary fp32 path, beside the planner's prediction.

One micro-batch of ``--tokens`` positions (``--rows`` rows) goes through what the last pipeline stage
does in a GRPO update: an output layer (``hidden @ W^T``, ``[s, b, V]``, with ``--hidden`` small so the
logits dominate), megatron's contiguous ``[b, s, V]`` transpose, the per-token GRPO loss and its
backward (``train``), or the old log-probabilities alone without gradients (``forward``). Two paths:

* ``previous``: the trainer before the chunked loss (megatron's ``vocab_parallel_cross_entropy`` on an
  fp32 copy of the logits, the entropy metric on the whole fp32 vocabulary);
* ``chunked``: :func:`cooper_mcore.rl.policy.grpo_token_loss` as the trainer runs it now
  (:func:`cooper_mcore.algo.chunked_logprobs_entropy`, ``--chunk`` positions at a time).

Each measurement runs in a fresh process whose allocator returns every block above 128 KiB to the
system at once (``MALLOC_MMAP_THRESHOLD_``), so the resident set follows the live tensors; the peak is
the kernel's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) above the resident
set before the output layer: exact, not sampled. Linux only; CPU only (on a GPU, ``cooper plan`` and
``benchmarks/cooper_step.py`` give the figures). The planner's ``logits`` term
(:func:`cooper_mcore.planner.sizes.logits_bytes`) is printed beside each.

    python benchmarks/logits_memory.py                              # 2048 tokens x 65536 vocabulary, fp32
    python benchmarks/logits_memory.py --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

MIB = 2**20
#: glibc returns blocks above this to the system when they are freed (and stops adapting the threshold)
MMAP_THRESHOLD = 131072


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def peak_tracking_available() -> bool:
    """Whether this process can reset its resident-set high-water mark (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM") > 0
    except OSError:
        return False


def previous_terms(logits, labels, entropy_grad: bool):
    """The trainer's log-probabilities and entropy before the chunked loss (kept here to measure it)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from cooper_mcore.collectives import all_reduce

    def entropy(x):
        x = x.float()
        group = parallel_state.get_tensor_model_parallel_group()
        m = all_reduce(x.detach().max(dim=-1).values, dist.ReduceOp.MAX, group)
        e = torch.exp(x - m.unsqueeze(-1))
        z = tensor_parallel.reduce_from_tensor_model_parallel_region(e.sum(-1))
        s = tensor_parallel.reduce_from_tensor_model_parallel_region((e * x).sum(-1))
        return torch.log(z) + m - s / z

    logp = -tensor_parallel.vocab_parallel_cross_entropy(logits.to(torch.float32, copy=True), labels)
    if entropy_grad:
        return logp, entropy(logits)
    with torch.no_grad():
        return logp, entropy(logits)


def measure(path: str, phase: str, tokens: int, rows: int, vocab: int, hidden: int, dtype: str, chunk: int,
            entropy_coef: float, warm_up: bool = True) -> int:
    """Peak bytes above the start of the output layer, in this process (see the module doc). A first
    run at a tiny shape pages in the code and scratch buffers of every kernel, which the resident
    set would otherwise count; the output layer runs once before the baseline, so that the CPU GEMM's
    own scratch buffer (kept between calls) is not counted either."""
    if warm_up:
        measure(path, phase, 2 * rows, rows, 64, hidden, dtype, 2, entropy_coef, warm_up=False)
    import torch

    from cooper_mcore.algo import kl_penalty, masked_sum, policy_loss
    from cooper_mcore.parallel import single_process_world
    from cooper_mcore.rl.policy import GRPOLoss, grpo_token_loss
    from cooper_mcore.train.tokens import TokenBatch, token_logprobs

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    seq = tokens // rows
    g = torch.Generator().manual_seed(0)
    with single_process_world():
        hidden_states = torch.randn(seq, rows, hidden, generator=g).to(dt)
        weight = torch.nn.Parameter((0.3 * torch.randn(vocab, hidden, generator=g)).to(dt))
        labels = torch.randint(0, vocab, (rows, seq), generator=g)
        mask = torch.ones(rows, seq)
        old = -torch.rand(rows, seq, generator=g) * 5
        mb = TokenBatch(labels, mask, torch.linspace(-1, 1, rows), old, old - 0.1, label_ids=labels)
        loss = GRPOLoss(kl_coef=1e-3, entropy_coef=entropy_coef, chunk_tokens=chunk)
        with torch.no_grad():  # the CPU bf16 GEMM keeps a scratch buffer of its own: made before the baseline
            torch.nn.functional.linear(hidden_states, weight)
        start = _status_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with torch.set_grad_enabled(phase == "train"):
            logits = torch.nn.functional.linear(hidden_states, weight).transpose(0, 1).contiguous()  # as GPTModel
            if phase == "forward":
                if path == "chunked":
                    token_logprobs(logits, labels, chunk)
                else:
                    previous_terms(logits, labels, False)
            else:
                if path == "chunked":
                    total, _ = grpo_token_loss(logits, mb, loss)
                else:
                    logp, ent = previous_terms(logits, labels, entropy_coef > 0)
                    tok, _ = policy_loss(logp, mb.old_logp, mb.advantages, mask)
                    total = tok + 1e-3 * kl_penalty(logp, mb.ref_logp) - entropy_coef * ent
                del logits
                masked_sum(total, mask).backward()
        return _status_kib("VmHWM") * 1024 - start


def main() -> None:
    p = argparse.ArgumentParser(description="peak memory of the policy loss over the logits: chunked vs previous")
    p.add_argument("--tokens", type=int, default=2048, help="positions in the micro-batch")
    p.add_argument("--rows", type=int, default=4, help="rows of the micro-batch")
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=8, help="the output layer's input width (small: logits dominate)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--chunk", type=int, default=None, help="train.logprob_chunk_tokens (default: the trainer's)")
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--paths", default="previous,chunked", help="which paths to measure (comma-separated)")
    p.add_argument("--phases", default="forward,train", help="which passes to measure (comma-separated)")
    p.add_argument("--json", default=None, help="also write the figures as JSON here")
    p.add_argument("--one", nargs=2, metavar=("PATH", "PHASE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    from cooper_mcore.algo.vocab import DEFAULT_CHUNK_TOKENS

    chunk = args.chunk or DEFAULT_CHUNK_TOKENS
    shape = (args.tokens, args.rows, args.vocab, args.hidden, args.dtype, chunk, args.entropy_coef)
    if args.one:  # a child process: one measurement
        print(json.dumps(measure(*args.one, *shape)))
        return
    if not peak_tracking_available():
        sys.exit("logits_memory.py needs Linux's /proc/self/clear_refs (the resident-set high-water mark)")
    from cooper_mcore.models.arch import ArchSpec
    from cooper_mcore.planner.sizes import logits_bytes

    arch = ArchSpec(family="qwen2", model_type="causal_lm", num_layers=1, hidden_size=args.hidden,
                    ffn_hidden_size=4 * args.hidden, num_attention_heads=1, num_query_groups=1, head_dim=args.hidden,
                    vocab_size=args.vocab, max_position_embeddings=args.tokens, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, qkv_bias=False, qk_norm=False)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS="1")
    d = 4 if args.dtype == "float32" else 2
    rows, results = [], {}
    for phase in args.phases.split(","):
        plan = logits_bytes(arch, args.tokens, d, 1, phase == "train", chunk, args.entropy_coef > 0)
        for path in args.paths.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--one", path, phase, "--tokens", str(args.tokens),
                   "--rows", str(args.rows), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                   "--dtype", args.dtype, "--chunk", str(chunk), "--entropy-coef", str(args.entropy_coef)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"{path} {phase} failed:\n{out.stderr[-3000:]}")
            peak = json.loads(out.stdout.strip().splitlines()[-1])
            results[f"{path}/{phase}"] = {"peak_bytes": peak, "planner_bytes": plan if path == "chunked" else None}
            rows.append((phase, path, peak, plan if path == "chunked" else None))
    one = args.tokens * args.vocab * 4
    print(f"\npolicy loss over the logits: {args.tokens} tokens x {args.vocab} vocabulary, {args.dtype}, chunk {chunk} "
          f"tokens, entropy_coef {args.entropy_coef}; one fp32 [tokens, vocab] copy = {one / MIB:.0f} MiB")
    print("| pass | path | measured peak MiB | fp32 copies | planner MiB |")
    print("|---|---|---|---|---|")
    for phase, path, peak, plan in rows:
        print(f"| {phase} | {path} | {peak / MIB:.0f} | {peak / one:.2f} | {plan / MIB:.0f} |" if plan is not None
              else f"| {phase} | {path} | {peak / MIB:.0f} | {peak / one:.2f} | - |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "vocab": args.vocab, "dtype": args.dtype, "chunk": chunk,
                       "entropy_coef": args.entropy_coef, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
