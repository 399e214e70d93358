"""Worker: one GRPO update of a policy and one pairwise update of a reward model at a TP layout
(optionally with sequence parallelism); rank 0 saves every parameter's full gradient (TP shards
gathered) by mapping name, for comparison across layouts."""

import argparse

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.models.hf_mapping import canonical_mcore_name
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.rl.policy import GRPOLoss, policy_update
from cooper_mcore.rollout.weight_sync import _gather_tp
from cooper_mcore.train.reward_model import RMBatch, pairwise_train_step, wrap_reward_model
from cooper_mcore.train.step import OptimConfig, wrap_for_training
from cooper_mcore.train.tokens import build_token_batch, compute_logprobs


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's ``main_grad``, TP shards gathered on TP rank 0 (empty elsewhere)."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    out = {}
    for name, p in model.named_parameters():
        g = p.main_grad.detach().clone()
        g.tensor_model_parallel = getattr(p, "tensor_model_parallel", False)
        g.partition_dim = getattr(p, "partition_dim", 0)
        full = _gather_tp(canonical_mcore_name(name), g, tp_group)
        if full is not None:
            out[canonical_mcore_name(name)] = full.cpu()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--rm", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    parallel = ParallelConfig(tp=args.tp, sequence_parallel=args.sp)
    init_distributed(parallel)
    g = torch.Generator().manual_seed(0)
    result = {}

    model, arch = load_checkpoint_model(args.policy, parallel)
    ddp, opt = wrap_for_training(model, OptimConfig(lr=0.0, clip_grad=0.0), per_token_loss=True)
    prompts = [torch.randint(1, arch.vocab_size, (int(n),), generator=g).tolist() for n in (3, 5, 4, 2)]
    responses = [torch.randint(1, arch.vocab_size, (int(n),), generator=g).tolist() for n in (4, 2, 6, 3)]
    batch = build_token_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    noise = 0.1 * torch.randn(batch.input_ids.shape, generator=g)
    batch.old_logp = compute_logprobs(model, batch, MicroBatching(2)) + noise
    # an entropy bonus, and chunks of 5 positions that cut the 2-row micro-batches: the chunked
    # log-probabilities and entropy over the vocabulary split at TP=2 give TP=1's gradient
    m = policy_update(ddp, opt, batch, MicroBatching(2), GRPOLoss(clip_low=0.2, clip_high=0.2, entropy_coef=0.01,
                                                                   chunk_tokens=5))
    result["policy"] = full_grads(model)
    result["policy_loss"] = m.loss

    rm, rm_arch = load_checkpoint_model(args.rm, parallel)
    rm_ddp, rm_opt = wrap_reward_model(rm, OptimConfig(lr=0.0, clip_grad=0.0))
    ids = torch.randint(1, rm_arch.vocab_size, (6, 12), generator=g)
    lengths = torch.tensor([12, 9, 7, 12, 10, 5])
    chosen, rejected = RMBatch(ids[:3], lengths[:3]), RMBatch(ids[3:], lengths[3:])
    m = pairwise_train_step(rm_ddp, rm_opt, chosen, rejected, torch.ones(3, dtype=torch.bool), 2)
    result["rm"] = full_grads(rm)
    result["rm_loss"] = m["loss"]
    if dist.get_rank() == 0:
        torch.save(result, args.out)
    destroy_distributed()


if __name__ == "__main__":
    main()
