"""Worker: the memory megatron-core really allocates for tiny models, per rank, at several layouts.

For each ``tp x pp`` layout given (data parallelism is the rest of the world), builds the models
of ``--archs`` (a JSON list of ``ArchSpec`` dicts) in bf16 with random weights, wraps each for
training (DDP with fp32 grad buffers and the distributed optimizer, as the trainer does) and
records on every rank: the parameter count and tensor count, and the bytes of device storage
that ``ModelOffloader`` finds for params (DDP's param buffer), grads (DDP's grad buffer) and the
optimizer (fp32 main-param shards, Adam moments, step counters). Rank 0 prints one JSON line with every
rank's records (``all_gather_object``).
"""

import argparse
import json

import torch
import torch.distributed as dist

from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.train.offload import ModelOffloader
from cooper_mcore.train.step import OptimConfig, wrap_for_training


def measure(arch: ArchSpec, parallel: ParallelConfig) -> dict:
    from megatron.core import parallel_state as ps

    model = build_model(arch, parallel, dtype=torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    ddp, opt = wrap_for_training(model, OptimConfig(distributed_optimizer=True))
    offloader = ModelOffloader(ddp, opt)
    return {"rank": dist.get_rank(), "tp": parallel.tp, "pp": parallel.pp, "dp": ps.get_data_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "family": arch.family, "model_type": arch.model_type,
            "numel": numel, "tensors": tensors, "param_bytes": offloader.device_bytes("params"),
            "grad_bytes": offloader.device_bytes("grads"), "optimizer_bytes": offloader.device_bytes("optimizer")}


def main():
    from megatron.core import parallel_state as ps

    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True, help="e.g. 2x2,1x2 (tp x pp)")
    p.add_argument("--archs", required=True, help="JSON list of ArchSpec.to_dict() documents")
    args = p.parse_args()
    archs = [ArchSpec.from_dict(d) for d in json.loads(args.archs)]
    records = []
    for layout in args.layouts.split(","):
        tp, pp = (int(x) for x in layout.split("x"))
        parallel = ParallelConfig(tp=tp, pp=pp)
        init_distributed(parallel)
        for arch in archs:
            records.append(measure(arch, parallel))
        ps.destroy_model_parallel()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        print(json.dumps([r for rank_records in gathered for r in rank_records]), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
