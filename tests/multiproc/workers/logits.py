"""Worker: compare every given checkpoint with transformers at one TP/PP layout, and save each
model back at that layout (to test resharding on load). Prints one JSON line on rank 0."""

import argparse
import json
import os

import torch.distributed as dist

from cooper_mcore.checkpoint.model import load_checkpoint_model, load_model_checkpoint, read_meta, save_model_checkpoint
from cooper_mcore.convert.compare import compare_logits, logits_diff
from cooper_mcore.models.builder import build_model
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", required=True, help="JSON list of [name, hf_dir, ckpt]")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--resave-dir", default=None)
    p.add_argument("--together", default=None, help="comma-separated names to hold at once")
    args = p.parse_args()
    parallel = ParallelConfig(tp=args.tp, pp=args.pp)
    init_distributed(parallel)
    out = {}
    for name, hf_dir, ckpt in json.loads(args.pairs):
        out[name] = compare_logits(hf_dir, ckpt, parallel, batch=3, seq=12)
        model, _ = load_checkpoint_model(ckpt, parallel)
        unmarked = [n for n, p in model.named_parameters()
                    if any(k in n for k in ("linear_qkv.weight", "linear_proj", "linear_fc", "word_embeddings"))
                    and not getattr(p, "tensor_model_parallel", False)]
        out[f"unmarked:{name}"] = len(unmarked)
        if args.resave_dir:
            arch, cfg, dtype = read_meta(ckpt)
            model = build_model(arch, parallel, dtype=dtype, init_weights=False)
            load_model_checkpoint(model, ckpt, arch)
            target = os.path.join(args.resave_dir, name)
            if dist.get_rank() == 0:
                os.makedirs(target)
            dist.barrier()
            save_model_checkpoint(model, target, arch, cfg, dtype)
            dist.barrier()
    # A policy and a reward model held together in one process, each given the process groups
    # explicitly, then both checked.
    if args.together:
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection.use_mpu_process_groups()
        pairs = {name: (hf, ck) for name, hf, ck in json.loads(args.pairs)}
        held = {name: load_checkpoint_model(pairs[name][1], parallel, pg_collection=groups)
                for name in args.together.split(",")}
        for name, (model, arch) in held.items():
            out[f"together:{name}"] = logits_diff(model, arch, pairs[name][0], batch=3, seq=12)
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
