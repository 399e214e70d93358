"""Worker (torchrun, 2 ranks, gloo): the untied tiny policy at TP=2 pushes perturbed weights into a
running SGLang server through rank 0 (``sync_weights``); then rank 1 makes a payload of the full
weights and rank 0 hands it to SGLang (``gather_rank_payloads``, ``update_weights_from_payloads``).
After each, SGLang's greedy logprobs are compared with the TP=2 Megatron policy's own. Prints one
JSON line on rank 0."""

import argparse
import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.models.forward import forward_only
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.sglang_engine import SGLangEngine
from cooper_mcore.rollout.sglang_http import SGLangHTTPClient
from cooper_mcore.rollout.sglang_payload import gather_rank_payloads, rank_payload
from cooper_mcore.rollout.weight_sync import hf_named_tensors, sync_weights

TOL = 5e-5


def logprobs(model, prompt, completion):
    """[len(completion)] log-probabilities and per-step maxima under the TP=2 policy (all ranks)."""
    logits = forward_only(model, torch.tensor([prompt + completion]))[0].double()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0], logp.max(-1).values


def perturb(model, seed):
    gen = torch.Generator().manual_seed(seed)  # same draws on both ranks: replicated params stay equal
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def check(model, engine, prompts):
    """Greedy SGLang outputs (rank 0, broadcast) against the policy: max diff and greedy agreement."""
    outs = [None]
    if dist.get_rank() == 0:
        outs = [[(o.token_ids, o.logprobs) for o in engine.generate(prompts, SamplingParams(max_new_tokens=8,
                                                                                             temperature=0.0))]]
    dist.broadcast_object_list(outs, src=0)
    diff, greedy_ok = 0.0, True
    for prompt, (ids, lps) in zip(prompts, outs[0]):
        ref, best = logprobs(model, prompt, ids)
        diff = max(diff, float((torch.tensor(lps, dtype=torch.float64) - ref).abs().max()))
        greedy_ok &= bool((ref >= best - TOL).all())
    return diff, greedy_ok, outs[0]


def stale(model, old_outs, prompts):
    """How far the previous weights' logprobs are from the current policy."""
    return max(float((torch.tensor(lps, dtype=torch.float64) - logprobs(model, p, ids)[0]).abs().max())
               for p, (ids, lps) in zip(prompts, old_outs))


def meta_versions(url, prompts):
    client = SGLangHTTPClient(url)
    outs = client.request("POST", "/generate", "generate", {"input_ids": prompts, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0.0}}, idempotent=True)
    client.close()
    return [o["meta_info"]["weight_version"] for o in outs]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token-id prompts")
    args = p.parse_args()
    prompts = json.loads(args.prompts)
    init_distributed(ParallelConfig(tp=2))
    rank = dist.get_rank()
    model, arch = load_checkpoint_model(args.ckpt, ParallelConfig(tp=2))
    engine = SGLangEngine.connect(args.url, device="cpu") if rank == 0 else None
    result = {}

    _, _, before = check(model, engine, prompts)
    perturb(model, seed=11)
    stats = sync_weights(model, arch, engine, version=9, bucket_bytes=16 * 1024)
    diff, greedy_ok, outs = check(model, engine, prompts)
    result["tp2_sync"] = {"max_diff": diff, "greedy_ok": greedy_ok, "stale_diff": stale(model, before, prompts),
                          "buckets": stats["buckets"], "version": engine.weight_version if rank == 0 else None,
                          "meta_version": meta_versions(args.url, prompts) if rank == 0 else None}

    # rank 1 makes the payload: the full HF tensors reach it from rank 0, as weight_sync would all-gather them
    perturb(model, seed=12)
    named = [list(hf_named_tensors(model, arch, ps.get_tensor_model_parallel_group(),
                                   ps.get_pipeline_model_parallel_group()))]
    dist.broadcast_object_list(named, src=0)
    bucket = [(n, t.clone()) for n, t in named[0]]  # rank 1's own copy, alive until the update is done
    payload = rank_payload(bucket, as_base64=True) if rank == 1 else None
    payloads = gather_rank_payloads(payload, group=ps.get_tensor_model_parallel_group(), dst=0)
    if rank == 0:
        engine.update_weights_from_payloads([[payloads[1]]], version=10)
    dist.barrier()
    diff, _, _ = check(model, engine, prompts)
    result["from_rank1"] = {"max_diff": diff, "stale_diff": stale(model, outs, prompts),
                            "version": engine.weight_version if rank == 0 else None}
    if rank == 0:
        print(json.dumps(result), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
