"""Worker: one training step of a tiny policy with megatron DDP + the distributed optimizer.

Data parallelism is the world size (TP=PP=1). The global batch (8 sequences) is the same for
every world size; each DP rank takes its share as micro-batches of 1. Rank 0 saves the updated
parameters and the loss.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cooper_mcore.checkpoint.model import load_model_checkpoint, read_meta
from cooper_mcore.models.builder import build_model
from cooper_mcore.models.forward import position_ids_for
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.train.step import OptimConfig, train_step, wrap_for_training


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    init_distributed(ParallelConfig())
    rank, world = dist.get_rank(), dist.get_world_size()
    arch, _, _ = read_meta(args.ckpt)
    model = build_model(arch, ParallelConfig(), init_weights=False)
    load_model_checkpoint(model, args.ckpt, arch)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
    ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-2, clip_grad=1.0, distributed_optimizer=True))

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, arch.vocab_size, (8, 17), generator=gen)
    share = tokens.chunk(world)[rank]
    micro = iter(share.split(1))

    def forward_step(data_iterator, m):
        batch = next(data_iterator)
        ids, labels = batch[:, :-1], batch[:, 1:]
        logits = m(ids, position_ids_for(ids), None)

        def loss_fn(output):
            from megatron.core import tensor_parallel

            full = tensor_parallel.gather_from_tensor_model_parallel_region(output)
            loss = F.cross_entropy(full.reshape(-1, full.shape[-1]).float(), labels.reshape(-1))
            return loss, {"loss": loss.detach().clone()}

        return logits, loss_fn

    result = train_step(ddp, opt, forward_step, micro, num_microbatches=share.shape[0],
                        seq_length=16, micro_batch_size=1)
    loss = torch.stack([m["loss"] for m in result.metrics]).mean()
    dist.all_reduce(loss)
    loss /= world
    if rank == 0:
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if "_extra_state" not in k}
        torch.save({"params": state, "initial": initial, "loss": loss,
                    "grad_norm": torch.tensor(result.grad_norm)}, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
