"""Worker: what megatron-core really builds and allocates for a tiny Qwen3-MoE, per rank, at several
``tp x ep`` layouts, ETP=1 (data parallelism is the rest of the world; sequence parallelism with TP > 1).

For each layout, builds the model of ``--arch`` (an ``ArchSpec`` dict) in bf16, wraps it for training
as the trainer does (DDP, distributed optimizer) and records on every rank: the parameter count, the
expert parameter count (megatron marks expert parameters ``allreduce=False``), the tensor count, the
expert data-parallel size, and the device bytes ``ModelOffloader`` finds for params, grads and the
optimizer. Rank 0 prints one JSON line with every rank's records.
"""

import argparse
import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.builder import build_model
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.train.offload import ModelOffloader
from cooper_mcore.train.step import OptimConfig, wrap_for_training


def measure(arch: ArchSpec, parallel: ParallelConfig) -> dict:
    """One rank's counts and allocated bytes for ``arch`` at ``parallel``."""
    model = build_model(arch, parallel, dtype=torch.bfloat16)
    params = list(model.parameters())
    experts = sum(p.numel() for p in params if not getattr(p, "allreduce", True))
    ddp, opt = wrap_for_training(model, OptimConfig(distributed_optimizer=True))
    off = ModelOffloader(ddp, opt)
    return {"rank": dist.get_rank(), "tp": parallel.tp, "ep": parallel.ep, "dp": ps.get_data_parallel_world_size(),
            "expert_dp": ps.get_expert_data_parallel_world_size(), "numel": sum(p.numel() for p in params),
            "expert_numel": experts, "tensors": len(params), "param_bytes": off.device_bytes("params"),
            "grad_bytes": off.device_bytes("grads"), "optimizer_bytes": off.device_bytes("optimizer")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True, help="e.g. 1x1,1x2,2x2 (tp x ep)")
    p.add_argument("--arch", required=True, help="an ArchSpec.to_dict() JSON document")
    args = p.parse_args()
    arch = ArchSpec.from_dict(json.loads(args.arch))
    records = []
    for layout in args.layouts.split(","):
        tp, ep = (int(x) for x in layout.split("x"))
        parallel = ParallelConfig(tp=tp, ep=ep, etp=1, sequence_parallel=tp > 1)  # experts whole on each rank
        init_distributed(parallel)
        records.append(measure(arch, parallel))
        ps.destroy_model_parallel()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        print(json.dumps([r for rank_records in gathered for r in rank_records]), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
