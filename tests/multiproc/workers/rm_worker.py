"""Worker: reward-model scores and one BCE and one pairwise step at several layouts of 2 processes.

Layouts run one after the other in the same world (DP=2; TP=2; PP=2). Every layout loads the same
checkpoint and the same global batch (``--data``, a torch file of chosen/rejected token ids,
lengths, a pair mask and labels); each data-parallel rank takes its contiguous share. Rank 0
prints one JSON line ``{layout: {"scores", "pair", "bce"}}``.

With ``--train DATA --out DIR``, then also ``train_rm`` and ``eval_rm`` at DP=2 (their results
under the keys ``train`` and ``eval``).
"""

import argparse
import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.train.reward_model import RMBatch, bce_train_step, pairwise_train_step, rm_scores, wrap_reward_model
from cooper_mcore.train.step import OptimConfig

# (sequence parallelism needs Transformer Engine's norms: not on the CPU)
LAYOUTS = {"dp2": ParallelConfig(), "tp2": ParallelConfig(tp=2), "pp2": ParallelConfig(pp=2)}


def run(ckpt: str, data: dict, parallel: ParallelConfig) -> dict:
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()

    def share(t):
        return t.chunk(dp)[rank]

    model, _ = load_checkpoint_model(ckpt, parallel)
    scores = rm_scores(model, share(data["chosen_ids"]), share(data["chosen_len"]), micro_batch_size=2)
    gathered = [torch.zeros_like(scores) for _ in range(dp)]
    dist.all_gather(gathered, scores, group=parallel_state.get_data_parallel_group())
    ddp, opt = wrap_reward_model(model, OptimConfig(lr=1e-4))
    pair = pairwise_train_step(ddp, opt, RMBatch(share(data["chosen_ids"]), share(data["chosen_len"])),
                               RMBatch(share(data["rejected_ids"]), share(data["rejected_len"])),
                               share(data["mask"]), micro_batch_size=1)
    model2, _ = load_checkpoint_model(ckpt, parallel)
    ddp2, opt2 = wrap_reward_model(model2, OptimConfig(lr=1e-4))
    bce = bce_train_step(ddp2, opt2, RMBatch(share(data["chosen_ids"]), share(data["chosen_len"]),
                                             share(data["labels"])), micro_batch_size=2, mask=share(data["bce_mask"]))
    return {"scores": torch.cat(gathered).tolist(), "pair": pair, "bce": bce}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--train")
    p.add_argument("--out")
    args = p.parse_args()
    data = torch.load(args.data)
    out = {}
    for name, parallel in LAYOUTS.items():
        init_distributed(parallel)
        out[name] = run(args.ckpt, data, parallel)
        parallel_state.destroy_model_parallel()
    if args.train:
        from cooper_mcore.config.schema import VerifyRMConfig, load_config
        from cooper_mcore.jobs.verify_rm import eval_rm, train_rm

        job = load_config(None, [f"ckpt={args.ckpt}", f"out={args.out}", f"data.train_path={args.train}",
                                 f"data.eval_path={args.train}", "train.epochs=2", "optim.lr=1e-3",
                                 "train.micro_batch_size=2", "train.global_batch_size=4", "train.seed=0"],
                          cls=VerifyRMConfig)
        out["train"] = train_rm(job)
        out["eval"] = eval_rm(out["train"]["final_checkpoint"], args.train, micro_batch_size=2)
    if dist.get_rank() == 0:
        print(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
