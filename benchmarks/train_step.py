"""Benchmark a policy training step: megatron-core (as the trainer builds it) vs plain transformers.

In one process and on one device, the same model shape (Qwen2.5-1.5B by default; tied embeddings,
GQA 12/2, 28 layers), the same random token batch and the same next-token cross-entropy are trained
for a few steps by:

* ``megatron-local``: :func:`cooper_mcore.models.builder.build_model` with the torch-native spec
  (SDPA attention), wrapped by :func:`cooper_mcore.train.step.wrap_for_training` (megatron
  DDP, distributed optimizer with fp32 main parameters, per-token loss) and stepped with
  :func:`~cooper_mcore.train.step.train_step` (gradient accumulation over micro-batches);
* ``megatron-te``: the same with Transformer Engine's spec, when TE is importable and a GPU is present;
* ``transformers``: ``AutoModelForCausalLM`` (SDPA) with fp32 parameters under bf16 autocast and
  torch's AdamW (fused on GPUs): the usual plain mixed-precision step, same micro-batches.

Prints tokens/s, ms per step, peak memory and MFU (model FLOPs per token: 6 x parameters in matmuls,
the output head included, plus 6 x layers x sequence x attention width for causal attention, against
the device's dense bf16 peak; n/a on CPU unless ``--peak-tflops`` is given).

    python benchmarks/train_step.py                      # GPU: Qwen2.5-1.5B shape, seq 4096
    python benchmarks/train_step.py --tiny               # CPU: tiny shape, seq 128, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable

import torch
from shapes import SHAPES  # benchmarks/shapes.py (scripts run from their folder)

# Dense bf16 peaks (TFLOP/s) by device-name fragment: NVIDIA's data sheets (SXM parts).
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "B200": 2250.0}


def model_flops_per_token(shape: dict, seq: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters (head included) + causal attention."""
    d, layers, vocab = shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = d // heads
    per_layer = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + 3 * d * shape["intermediate_size"]
    matmul_params = layers * per_layer + vocab * d
    attention = 6 * layers * seq * heads * head_dim  # QK^T and AV, fwd + bwd, halved by causality
    return 6.0 * matmul_params + attention


def device_peak_tflops(override: float | None) -> float | None:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def time_steps(step: Callable[[], float], warmup: int, steps: int) -> tuple[float, float]:
    """Run ``warmup`` then ``steps`` steps; return (median seconds per step, last loss)."""
    loss = float("nan")
    for _ in range(warmup):
        loss = step()
    times = []
    for _ in range(steps):
        _sync()
        t0 = time.perf_counter()
        loss = step()
        _sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], loss


def megatron_step_fn(shape: dict, batches: list[torch.Tensor], use_te: bool) -> tuple[Callable[[], float], list]:
    """A Megatron training step on ``batches`` (one optimizer step over all micro-batches)."""
    import transformers
    from lm_step import megatron_lm_step  # benchmarks/lm_step.py (imports cooper_mcore, as here only)

    from cooper_mcore.models.arch import ArchSpec
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig

    cfg = transformers.Qwen2Config(**shape)
    cfg.architectures = ["Qwen2ForCausalLM"]
    arch = ArchSpec.from_hf_config(cfg.to_dict())
    return megatron_lm_step(build_model(arch, ParallelConfig(), dtype=torch.bfloat16, use_te=use_te), batches)


def transformers_step_fn(shape: dict, batches: list[torch.Tensor]) -> tuple[Callable[[], float], list]:
    """The plain step: fp32 parameters, bf16 autocast, AdamW, gradient accumulation."""
    import transformers

    from cooper_mcore.parallel import device

    dev = device()
    cfg = transformers.Qwen2Config(**shape)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=dev.type == "cuda")
    tokens = sum(b.numel() for b in batches)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids in batches:
            ids = ids.to(dev)
            labels = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            (loss / tokens).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return total / tokens

    return step, [model, opt]


def main() -> None:
    p = argparse.ArgumentParser(description="policy training step: megatron-core vs transformers")
    p.add_argument("--tiny", action="store_true", help="tiny shape, seq 128: a CPU smoke run")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None)
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (4096; --tiny: 128)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (2; --tiny: 2)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=None, help="device bf16 peak for MFU")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    p.add_argument("--skip", default="", help="comma-separated variants to skip (megatron-local,megatron-te,"
                                              "transformers)")
    args = p.parse_args()
    shape_name = args.shape or ("tiny" if args.tiny else "qwen2.5-1.5b")
    shape = dict(SHAPES[shape_name])
    seq = args.seq or (128 if args.tiny else 4096)
    mbs = args.micro_batch or 2
    shape["max_position_embeddings"] = max(shape["max_position_embeddings"], seq)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from cooper_mcore.models.spec import te_available
    from cooper_mcore.parallel import single_process_world

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, shape["vocab_size"], (mbs, seq), generator=gen) for _ in range(args.micro_batches)]
    tokens = mbs * seq * args.micro_batches
    skip = set(filter(None, args.skip.split(",")))
    variants = [("megatron-local", lambda: megatron_step_fn(shape, batches, use_te=False))]
    if te_available():
        variants.append(("megatron-te", lambda: megatron_step_fn(shape, batches, use_te=True)))
    variants.append(("transformers", lambda: transformers_step_fn(shape, batches)))
    flops = model_flops_per_token(shape, seq) * tokens
    peak = device_peak_tflops(args.peak_tflops)
    rows = []
    with single_process_world():
        for name, make in variants:
            if name in skip:
                continue
            _reset_peak()
            torch.manual_seed(0)
            step, keep = make()
            secs, loss = time_steps(step, args.warmup, args.steps)
            rows.append((name, secs, loss, _peak_gib()))
            del step, keep
            _reset_peak()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    import megatron.core
    import transformers

    print(f"\nshape {shape_name}, bf16, {args.micro_batches} micro-batches x {mbs} x {seq} tokens = {tokens} "
          f"tokens/step; {dev}; torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
          f"transformers {transformers.__version__}; median of {args.steps} steps after {args.warmup}")
    print("| variant | ms/step | tokens/s | MFU | peak memory (GiB) | loss | vs transformers |")
    print("|---|---|---|---|---|---|---|")
    base = next((r[1] for r in rows if r[0] == "transformers"), None)
    for name, secs, loss, mem in rows:
        mfu = f"{flops / secs / (peak * 1e12):.1%}" if peak else "n/a"
        speed = f"{base / secs:.2f}x" if base else "n/a"
        mem_s = f"{mem:.2f}" if mem is not None else "n/a"
        print(f"| {name} | {secs * 1e3:.1f} | {tokens / secs:,.0f} | {mfu} | {mem_s} | {loss:.4f} | {speed} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "shape": shape_name, "seq": seq, "tokens_per_step": tokens,
                       "rows": [{"variant": n, "ms_per_step": t * 1e3, "tokens_per_s": tokens / t,
                                 "mfu": flops / t / (peak * 1e12) if peak else None, "peak_gib": m, "loss": lo}
                                for n, t, lo, m in rows]}, f, indent=2)
    print(f"model FLOPs/token {model_flops_per_token(shape, seq) / 1e9:.2f} G; peak "
          f"{f'{peak:.0f} TFLOP/s' if peak else 'unknown (MFU n/a)'}")


if __name__ == "__main__":
    main()
