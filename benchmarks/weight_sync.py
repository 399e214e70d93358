"""Benchmark the Megatron -> rollout-engine weight sync against a plain copy of the same bytes.

A Qwen2.5-1.5B-shaped policy (bf16) is built with megatron-core at TP=1 and TP=2 (CPU, gloo)
and pushed into the transformers engine on rank 0 with :func:`sync_weights`. In the same run,
the same bytes (the HF tensors the sync produces, prepared once) are copied into the engine's
parameters with ``copy_``; that is the floor. Prints a table; ``--shape tiny`` runs in seconds.

    python benchmarks/weight_sync.py [--shape qwen2.5-1.5b|tiny] [--tps 1,2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch
from shapes import SHAPES  # benchmarks/shapes.py (scripts run from their folder)


def worker(shape: str, tp: int, repeat: int, bucket_mb: int) -> None:
    import torch.distributed as dist
    import transformers
    from megatron.core import parallel_state as ps

    from cooper_mcore.models.arch import ArchSpec
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
    from cooper_mcore.rollout.hf_engine import HFEngine
    from cooper_mcore.rollout.weight_sync import hf_named_tensors, sync_weights

    parallel = ParallelConfig(tp=tp)
    init_distributed(parallel)
    cfg = transformers.Qwen2Config(**SHAPES[shape])
    cfg.architectures = ["Qwen2ForCausalLM"]
    arch = ArchSpec.from_hf_config(cfg.to_dict())
    model = build_model(arch, parallel, dtype=torch.bfloat16, init_weights=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    engine = None
    if dist.get_rank() == 0:
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        hf = hf.to_empty(device="cpu")
        hf.tie_weights()
        engine = HFEngine(hf)
    bucket = bucket_mb * 2**20
    sync_weights(model, arch, engine, version=0, bucket_bytes=bucket)  # warm-up: touch all pages
    source = None
    if engine is not None:  # the same bytes, prepared once, for the plain copy
        source = [(n, t.clone()) for n, t in hf_named_tensors(model, arch, ps.get_tensor_model_parallel_group(),
                                                                ps.get_pipeline_model_parallel_group())]
    else:
        for _ in hf_named_tensors(model, arch, ps.get_tensor_model_parallel_group(),
                                  ps.get_pipeline_model_parallel_group()):
            pass
    sync_s, copy_s, nbytes = [], [], 0
    for v in range(repeat):
        dist.barrier()
        stats = sync_weights(model, arch, engine, version=v + 1, bucket_bytes=bucket)
        dist.barrier()
        sync_s.append(stats["seconds"])
        if engine is not None:
            nbytes = stats["bytes"]
            params = engine._params
            t0 = time.perf_counter()
            with torch.no_grad():
                for name, t in source:
                    if name in params:
                        params[name].copy_(t)
            copy_s.append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        print(json.dumps({"tp": tp, "sync_s": min(sync_s), "copy_s": min(copy_s), "bytes": nbytes}), flush=True)
    destroy_distributed()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description="weight-sync benchmark")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--tps", default="1,2")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.shape, args.tp, args.repeat, args.bucket_mb)
        return
    rows = []
    for tp in [int(x) for x in args.tps.split(",")]:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}",
               f"--master_port={_free_port()}", os.path.abspath(__file__), "--worker", "--tp", str(tp),
               "--shape", args.shape, "--repeat", str(args.repeat), "--bucket-mb", str(args.bucket_mb)]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // tp)))
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"TP={tp} failed:\n{r.stderr[-3000:]}")
        rows.append(json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]))
    gib = 2**30
    print(f"\npolicy: {args.shape}, bf16; {os.cpu_count()} CPUs; torch {torch.__version__}; buckets of "
          f"{args.bucket_mb} MiB; best of {args.repeat}")
    print("| layout | bytes (GiB) | sync (s) | plain copy of the same bytes (s) | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| TP={r['tp']} | {r['bytes'] / gib:.2f} | {r['sync_s']:.2f} | {r['copy_s']:.2f} | "
              f"{r['sync_s'] / r['copy_s']:.2f}x |")


if __name__ == "__main__":
    main()
