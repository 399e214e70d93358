"""Worker: the policy and RM of a ``model.init: random`` run built on every rank of a DP=2 world
(:func:`cooper_mcore.rl.setup.random_model`); rank 0 prints one JSON line with each rank's
per-tensor checksums, so the test can compare the replicas."""

import argparse
import json

import torch
import torch.distributed as dist

from cooper_mcore.config.model_shapes import random_init_shapes
from cooper_mcore.config.schema import CooperConfig, ModelConfig
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.rl.setup import random_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy-config", required=True)
    args = p.parse_args()
    init_distributed(ParallelConfig(), seed=1234)
    cfg = CooperConfig(model=ModelConfig(init="random", policy_config=args.policy_config))
    policy_shape, rm_shape = random_init_shapes(cfg.model, uses_rm=True)
    policy = random_model("policy", policy_shape, cfg, None, cfg.optim, 4, seed=cfg.train.seed)
    rm = random_model("rm", rm_shape, cfg, None, cfg.rm.optim, 4, seed=cfg.train.seed + 1)
    sums = {f"{m.name}.{n}": [float(t.double().sum()), float(t.double().abs().sum())]
            for m in (policy, rm) for n, t in m.module.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    if dist.get_rank() == 0:
        print(json.dumps(gathered))
    destroy_distributed()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
