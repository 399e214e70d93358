"""Worker: the chunked log-probabilities and entropy with the vocabulary split over the TP group
(``token_logprobs_and_entropy``), against the whole vocabulary in float64 (every rank computes it)
and against the previous functions (megatron's vocab-parallel cross entropy on an fp32 copy, the
full fp32 entropy) at the same TP size: values, and each rank's slice of the gradient. Rank 0
prints the largest differences over the ranks as JSON."""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.train.tokens import token_logprobs_and_entropy

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: tests.harness
from tests.harness.previous_logprobs import previous_token_logprobs, previous_vocab_parallel_entropy  # noqa: E402

VOCAB = 384


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    init_distributed(ParallelConfig(tp=args.tp))
    rank, width = parallel_state.get_tensor_model_parallel_rank(), VOCAB // args.tp
    g = torch.Generator().manual_seed(0)
    full = 3.0 * torch.randn(3, 11, VOCAB, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (3, 11), generator=g)
    g_logp, g_ent = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    ref = full.clone().requires_grad_()
    log_p = torch.log_softmax(ref, -1)
    ref_logp, ref_ent = log_p.gather(-1, labels[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    ((g_logp.double() * ref_logp).sum() + (g_ent.double() * ref_ent).sum()).backward()
    mine = full[..., rank * width:(rank + 1) * width].float()
    out = {}
    for chunk in (4, 1024):
        x = mine.clone().requires_grad_()
        logp, ent = token_logprobs_and_entropy(x, labels, "grad", chunk)
        ((g_logp * logp).sum() + (g_ent * ent).sum()).backward()
        y = mine.clone().requires_grad_()
        prev_logp, prev_ent = previous_token_logprobs(y, labels), previous_vocab_parallel_entropy(y)
        ((g_logp * prev_logp).sum() + (g_ent * prev_ent).sum()).backward()
        errors = torch.tensor([
            (logp.double() - ref_logp).abs().max(), (ent.double() - ref_ent).abs().max(),
            (x.grad.double() - ref.grad[..., rank * width:(rank + 1) * width]).abs().max(),
            (logp - prev_logp).abs().max(), (ent - prev_ent).abs().max(), (x.grad - y.grad).abs().max()])
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        names = ("ref_logp", "ref_entropy", "ref_grad", "prev_logp", "prev_entropy", "prev_grad")
        out.update({f"chunk{chunk}/{k}": float(v) for k, v in zip(names, errors)})
    out["grad_scale"] = float(ref.grad.abs().max())
    if dist.get_rank() == 0:
        print(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
