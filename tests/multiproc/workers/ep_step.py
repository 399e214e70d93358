"""Worker: one GRPO update of a tiny Qwen3-MoE policy (the trainer's ``policy_update``, distributed
optimizer) and one pairwise update of a tiny Qwen3-MoE reward model (plain optimizer, so that every
rank keeps its full reduced gradients) at a TP/EP/ETP layout (sequence parallelism with TP), with the
same data on each data-parallel rank whatever the layout. Every rank saves its parameters (updated)
and the RM's gradients under global names (expert numbers with the rank's expert offset; a tensor
split over TP or ETP keyed by its shard), the step metrics, and an offload/onload round trip of the
policy (expert buffers included); each replica's first rank also saves both models' full updated
tensors under HF names (what a weight push sends). With ``--save DIR`` the updated policy is also
written as a model checkpoint (collective).
"""
import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.checkpoint.model import load_checkpoint_model, read_meta, save_model_checkpoint
from cooper_mcore.micro_batching.runner import MicroBatching
from cooper_mcore.models.hf_mapping import is_expert_param, mapping_tensors
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.rl.policy import GRPOLoss, policy_update
from cooper_mcore.rollout.weight_sync import hf_named_tensors
from cooper_mcore.train.offload import ModelOffloader
from cooper_mcore.train.reward_model import RMBatch, pairwise_train_step, wrap_reward_model
from cooper_mcore.train.step import OptimConfig, wrap_for_training
from cooper_mcore.train.tokens import build_token_batch, compute_logprobs


def global_names(model, tensors) -> dict[str, torch.Tensor]:
    """``{global name: tensor.clone()}`` of ``tensors(param)`` for every parameter of this rank (one per
    expert of stacked expert weights); a shard of a tensor split over TP (ETP for experts) is named
    ``name#shard<rank>``, so that equal names are replicas."""
    local = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    offset = parallel_state.get_expert_model_parallel_rank() * local
    out = {}
    for n, p in model.named_parameters():
        expert = is_expert_param(n)
        group_size, rank = ((parallel_state.get_expert_tensor_parallel_world_size(),
                             parallel_state.get_expert_tensor_parallel_rank()) if expert else
                            (parallel_state.get_tensor_model_parallel_world_size(),
                             parallel_state.get_tensor_model_parallel_rank()))
        split = group_size > 1 and getattr(p, "tensor_model_parallel", False)
        for name, t in mapping_tensors(n, tensors(p), expert_offset=offset):
            out[f"{name}#shard{rank}" if split else name] = t.detach().clone().cpu()
    return out


def full_tensors(model, arch) -> dict[str, torch.Tensor]:
    """The whole model's tensors by HF name on the replica's first rank (empty elsewhere); collective."""
    tensors = hf_named_tensors(model, arch, parallel_state.get_tensor_model_parallel_group(),
                               parallel_state.get_pipeline_model_parallel_group())
    return {n: t.clone().cpu() for n, t in tensors}


def policy(args, parallel: ParallelConfig, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)  # this data-parallel rank's rows, the same at every EP
    model, arch = load_checkpoint_model(args.policy, parallel)
    ddp, opt = wrap_for_training(model, OptimConfig(lr=1e-3, clip_grad=1.0, distributed_optimizer=True),
                                 per_token_loss=True)
    prompts = [torch.randint(1, arch.vocab_size, (int(n),), generator=g).tolist() for n in (3, 5, 4, 2)]
    responses = [torch.randint(1, arch.vocab_size, (int(n),), generator=g).tolist() for n in (4, 2, 6, 3)]
    batch = build_token_batch(prompts, responses, pad_id=0)
    batch.advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    noise = 0.1 * torch.randn(batch.input_ids.shape, generator=g)
    batch.old_logp = compute_logprobs(model, batch, MicroBatching(2)) + noise
    initial = global_names(model, lambda p: p)
    m = policy_update(ddp, opt, batch, MicroBatching(2), GRPOLoss(clip_low=0.2, clip_high=0.2))
    if args.save:
        if dist.get_rank() == 0:
            os.makedirs(args.save)
        dist.barrier()
        _, hf_config, dtype = read_meta(args.policy)
        save_model_checkpoint(model, args.save, arch, hf_config, dtype)
    return {"policy_params": global_names(model, lambda p: p), "policy_initial": initial, "policy_loss": m.loss,
            "policy_grad_norm": m.grad_norm, "policy_aux": m.moe_aux_loss, "policy_full": full_tensors(model, arch),
            **offload_round_trip(ddp, opt)}


def offload_round_trip(ddp, opt) -> dict:
    """Offload the policy's params, grads and optimizer state and bring them back: the expert buffers
    (EP > 1: their own DDP buffers) are among what moves, and everything comes back bitwise."""
    before = [p.detach().clone() for p in ddp.module.parameters()]
    off = ModelOffloader(ddp, opt)
    param_bytes = off.device_bytes("params")
    off.offload()
    emptied = off.device_bytes("params")
    off.onload()
    return {"expert_buffers": len(ddp.expert_parallel_buffers), "param_bytes": param_bytes,
            "model_bytes": sum(p.numel() * p.element_size() for p in ddp.module.parameters()),
            "offloaded_bytes": emptied,
            "round_trip_equal": all(torch.equal(a, p) for a, p in zip(before, ddp.module.parameters()))}


def reward_model(args, parallel: ParallelConfig, rank: int) -> dict:
    g = torch.Generator().manual_seed(200 + rank)
    rm, arch = load_checkpoint_model(args.rm, parallel)
    ddp, opt = wrap_reward_model(rm, OptimConfig(lr=1e-3, clip_grad=0.0, distributed_optimizer=False))
    ids = torch.randint(1, arch.vocab_size, (6, 12), generator=g)
    lengths = torch.tensor([12, 9, 7, 12, 10, 5])
    chosen, rejected = RMBatch(ids[:3], lengths[:3]), RMBatch(ids[3:], lengths[3:])
    m = pairwise_train_step(ddp, opt, chosen, rejected, torch.ones(3, dtype=torch.bool), 2)
    return {"rm_grads": global_names(rm, lambda p: p.main_grad), "rm_loss": m["loss"],
            "rm_grad_norm": m["grad_norm"], "rm_aux": m["moe_aux_loss"], "rm_params": global_names(rm, lambda p: p),
            "rm_full": full_tensors(rm, arch)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--rm", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--save", default="")
    args = p.parse_args()
    parallel = ParallelConfig(tp=args.tp, ep=args.ep, etp=args.etp, sequence_parallel=args.tp > 1)
    init_distributed(parallel)
    rank = dist.get_rank()
    result = {"rank": rank, "ep": parallel_state.get_expert_model_parallel_world_size(),
              "dp_rank": parallel_state.get_data_parallel_rank()}
    result.update(policy(args, parallel, parallel_state.get_data_parallel_rank()))
    result.update(reward_model(args, parallel, parallel_state.get_data_parallel_rank()))
    torch.save(result, f"{args.out}.{rank}")
    destroy_distributed()


if __name__ == "__main__":
    main()
