"""Worker: offload/onload of a DP-sharded distributed optimizer, and the reference swap, on every rank.

Two identical policies (A and B) are loaded and stepped; A goes through offload/onload cycles, then
both take a second step and must agree bit for bit. Rank 0 prints one JSON line with every rank's
findings (``all_gather_object``).
"""

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.models.forward import forward_only, position_ids_for
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.train.offload import ModelOffloader, ReferenceSwap
from cooper_mcore.train.step import OptimConfig, train_step, wrap_for_training


def setup(ckpt):
    model, arch = load_checkpoint_model(ckpt, ParallelConfig())
    ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-2, distributed_optimizer=True))
    return ddp, opt, arch


def step(ddp, opt, vocab, seed):
    """One step on this rank's share of a global batch of 4 sequences."""
    tokens = torch.randint(0, vocab, (4, 13), generator=torch.Generator().manual_seed(seed))
    share = tokens.chunk(dist.get_world_size())[dist.get_rank()]

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        ids, labels = batch[:, :-1], batch[:, 1:]
        out = m(ids, position_ids_for(ids), None)
        return out, lambda o: (F.cross_entropy(o.reshape(-1, o.shape[-1]).float(), labels.reshape(-1)), {})

    train_step(ddp, opt, forward_step, iter(share.split(1)), num_microbatches=share.shape[0],
               seq_length=12, micro_batch_size=1)


def live(ddp, opt):
    out = {}
    for i, b in enumerate(ddp.buffers):
        out[f"param_data{i}"], out[f"grad_data{i}"] = b.param_data, b.grad_data
    for j, sub in enumerate(opt.chained_optimizers):
        for gi, group in enumerate(sub.optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"main_param{j}.{gi}.{k}"] = p
                for key, v in sub.optimizer.state[p].items():
                    out[f"state{j}.{gi}.{k}.{key}"] = v
    return out


def snapshot(ddp, opt):
    return {k: v.detach().clone() for k, v in live(ddp, opt).items()}


def mismatches(a, b):
    return sorted(k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    args = p.parse_args()
    init_distributed(ParallelConfig())
    a_ddp, a_opt, arch = setup(args.ckpt)
    b_ddp, b_opt, _ = setup(args.ckpt)
    ref = ReferenceSwap(a_ddp)
    for ddp, opt in ((a_ddp, a_opt), (b_ddp, b_opt)):
        step(ddp, opt, arch.vocab_size, seed=1)
    report = {"rank": dist.get_rank()}
    model_numel = sum(p.numel() for p in a_ddp.module.parameters())
    report["exp_avg_numel"] = sum(v.numel() for k, v in live(a_ddp, a_opt).items() if k.endswith(".exp_avg"))
    report["model_numel"] = model_numel

    before = snapshot(a_ddp, a_opt)
    report["equal_before"] = mismatches(before, snapshot(b_ddp, b_opt))
    off = ModelOffloader(a_ddp, a_opt)
    report["cycles"] = []
    for _ in range(2):
        stats = off.offload()
        held = sorted(k for k, v in live(a_ddp, a_opt).items() if v.untyped_storage().nbytes())
        back = off.onload()
        report["cycles"].append({"offload_bytes": stats.bytes, "onload_bytes": back.bytes, "still_held": held,
                                 "mismatches": mismatches(before, snapshot(a_ddp, a_opt))})

    ids = torch.randint(0, arch.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    fresh, _ = load_checkpoint_model(args.ckpt, ParallelConfig())
    policy_logits = forward_only(a_ddp.module, ids)
    with ref.swapped():
        report["swap_equals_reference"] = torch.equal(forward_only(a_ddp.module, ids), forward_only(fresh, ids))
    report["policy_differs"] = not torch.equal(policy_logits, forward_only(fresh, ids))
    report["policy_restored"] = torch.equal(forward_only(a_ddp.module, ids), policy_logits)

    for ddp, opt in ((a_ddp, a_opt), (b_ddp, b_opt)):
        step(ddp, opt, arch.vocab_size, seed=2)
    after = snapshot(a_ddp, a_opt)
    report["equal_after"] = mismatches(after, snapshot(b_ddp, b_opt))
    report["moved"] = not torch.equal(after["param_data0"], before["param_data0"])

    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        print(json.dumps(reports), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
