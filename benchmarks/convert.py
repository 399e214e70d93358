"""Benchmark the checkpoint converter against copying the same files.

Builds a random bf16 checkpoint with the Qwen2.5-1.5B shape (tied embeddings, GQA 12/2,
28 layers), then times, each in a fresh process as a user would run them:

* ``cp -r`` of the HF folder and of the Megatron checkpoint (the floor: same bytes, same disk),
  once until ``sync`` returns (megatron-core's writer fsyncs, so this is like for like) and
  once into the page cache only;
* ``cooper convert hf-to-mcore`` and ``cooper convert mcore-to-hf``;

and samples the peak memory of each conversion's process tree (the main process's RSS plus the
unique memory of its checkpoint-writer children). The export is checked tensor by tensor
against the source. Prints a table; ``--shape tiny`` runs in seconds.

    python benchmarks/convert.py [--shape qwen2.5-1.5b|tiny] [--workdir DIR] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
import torch
from shapes import SHAPES  # benchmarks/shapes.py (scripts run from their folder)


def make_checkpoint(out: str, shape: str) -> int:
    """Write a random bf16 Qwen2 checkpoint one tensor at a time; return its size in bytes."""
    import transformers

    from cooper_mcore.checkpoint.safetensors_io import write_tensors
    from cooper_mcore.models.arch import ArchSpec
    from cooper_mcore.models.hf_mapping import hf_shapes, param_mappings
    from cooper_mcore.models.tiny import save_tiny_tokenizer

    cfg = transformers.Qwen2Config(**SHAPES[shape], dtype="bfloat16")
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg_dict = cfg.to_dict()
    arch = ArchSpec.from_hf_config(cfg_dict)
    shapes = hf_shapes(arch)
    names = [n for m in param_mappings(arch) for n in m.hf]
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for n in names:
            yield n, (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16)

    os.makedirs(out)
    write_tensors(out, [(n, shapes[n], torch.bfloat16) for n in names], tensors(),
                  max_shard_bytes=2 * 2**30)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    save_tiny_tokenizer(out)  # an export needs a tokenizer; ids 0..127 fit any vocabulary here
    return dir_bytes(out)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def run_measured(cmd: list[str]) -> tuple[float, int]:
    """Run ``cmd``; return (wall seconds, peak bytes of the process tree)."""
    t0 = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        try:
            total = proc.memory_info().rss
            for child in proc.children(recursive=True):
                try:
                    total += child.memory_full_info().uss
                except psutil.Error:
                    pass
            peak = max(peak, total)
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return wall, peak


def timed_copy(src: str, dst: str, durable: bool) -> float:
    """Time ``cp -r``; with ``durable``, until ``sync`` has put it on disk (megatron-core's
    checkpoint writer fsyncs every file, so that is the like-for-like floor)."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", src, dst], check=True)
    if durable:
        subprocess.run(["sync"], check=True)
    return time.perf_counter() - t0


def check_export(src: str, exported: str) -> None:
    """Every tensor of the export equals the source's, bit for bit."""
    from cooper_mcore.checkpoint.safetensors_io import HFCheckpointReader

    a, b = HFCheckpointReader(src), HFCheckpointReader(exported)
    assert sorted(a.keys()) == sorted(b.keys()), "tensor names differ"
    for k in a.keys():
        assert torch.equal(a.get(k), b.get(k)), k


def main() -> None:
    p = argparse.ArgumentParser(description="converter benchmark")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    p.add_argument("--workdir", default=None, help="default: a temporary folder (removed)")
    p.add_argument("--repeat", type=int, default=2, help="runs of each timing; the best is kept")
    args = p.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="cooper-bench-convert-")
    os.makedirs(work, exist_ok=True)
    cooper = [sys.executable, "-m", "cooper_mcore"]
    try:
        hf = os.path.join(work, "hf")
        size = make_checkpoint(hf, args.shape)
        rows = []
        for direction in ("hf-to-mcore", "mcore-to-hf"):
            best_conv, peak = float("inf"), 0
            best_copy = {False: float("inf"), True: float("inf")}
            for r in range(args.repeat):
                out = os.path.join(work, f"{direction}-{r}")
                if direction == "hf-to-mcore":
                    cmd = cooper + ["convert", direction, "--hf-dir", hf, "--out", out]
                    src = hf
                else:
                    src = os.path.join(work, "hf-to-mcore-0")
                    cmd = cooper + ["convert", direction, "--ckpt", src, "--out", out,
                                    "--max-shard-gib", "2"]
                subprocess.run(["sync"], check=True)
                wall, mem = run_measured(cmd)
                best_conv, peak = min(best_conv, wall), max(peak, mem)
                for durable in (False, True):
                    dst = os.path.join(work, f"copy-{direction}-{r}")
                    best_copy[durable] = min(best_copy[durable], timed_copy(src, dst, durable))
                    shutil.rmtree(dst)
                if direction == "mcore-to-hf":
                    check_export(hf, out)
                if r > 0:
                    shutil.rmtree(out)
            rows.append((direction, best_conv, best_copy, peak))
        gib = 2**30
        print(f"\ncheckpoint: {args.shape}, bf16, {size / gib:.2f} GiB; {os.cpu_count()} CPUs; "
              f"torch {torch.__version__}")
        print("| direction | convert (s) | cp + sync (s) | ratio | cp, page cache (s) | ratio | "
              "peak memory (GiB) | peak / size |")
        print("|---|---|---|---|---|---|---|---|")
        for d, conv, copy, peak in rows:
            print(f"| {d} | {conv:.2f} | {copy[True]:.2f} | {conv / copy[True]:.2f}x | {copy[False]:.2f} | "
                  f"{conv / copy[False]:.2f}x | {peak / gib:.2f} | {peak / size:.2f}x |")
        print("convert: wall time of `cooper convert` in a fresh process (imports included; the megatron "
              "writer fsyncs). cp: the source files of that direction. Export checked bitwise.")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
