"""Worker: packed rows against the same sequences unpacked, at one TP/PP layout.

Compares, on every rank, the packed path (cooper_mcore.micro_batching.runner: PackedSeqParams, one
packed row per micro-batch, micro-batches of different widths so that pipeline stages exchange shapes)
with the right-padded path at the same layout:

* ``logits``: full-vocabulary logits (TP-gathered) of every real token;
* ``logprobs``: :func:`compute_logprobs` on packed micro-batches against a log-softmax of the unpacked logits;
* ``scores``: :func:`rm_scores` of the reward model on packed micro-batches against ``forward_only`` scores;
* ``grads``: gradients of a token-mean loss through megatron's training schedule (2 micro-batches
  either way), relative to the largest gradient entry (``grad_scale``).

Prints one JSON line of maximum differences (over all ranks) on rank 0.
"""

import argparse
import json

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.micro_batching.packing import pack_micro_batches, right_pad, round_up
from cooper_mcore.micro_batching.runner import MicroBatching, forward_packed
from cooper_mcore.models.forward import (
    forward_only,
    position_ids_for,
    run_schedule,
    sequence_multiple,
    shifted_labels,
)
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, device, init_distributed
from cooper_mcore.train.reward_model import rm_scores
from cooper_mcore.train.tokens import TokenBatch, compute_logprobs, token_logprobs

LENGTHS = [9, 3, 16, 1, 12, 5]
MICRO = [[2, 3, 0], [5, 1, 4]]  # packs of 26 and 20 tokens
#: what the trainer's passes get for these lengths: packs by a 26-token budget
PACKED = MicroBatching(3, max_tokens=26, pack=True)


def _sequences(vocab, seed, pad_id, multiple):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=g) for n in LENGTHS]
    ids, lengths = right_pad(seqs, pad_id, multiple)
    return ids, lengths


def _max_all(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _packed_logits(model, packs):
    def step(it, m):
        pack = next(it)

        def collect(out):
            out = tensor_parallel.gather_from_tensor_model_parallel_region(out, group=m.pg_collection.tp)
            return torch.zeros(()), {"out": out}

        return forward_packed(m, pack), collect

    with torch.no_grad():
        return run_schedule(model, step, packs, [(1, p.width) for p in packs], forward_only=True)


def _grads(model, micro, shapes, step_fn):
    model.train()
    model.zero_grad(set_to_none=True)
    run_schedule(model, step_fn, micro, shapes, forward_only=False)
    tp = model.pg_collection.tp
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "sequence_parallel", False) and tp.size() > 1:  # partial over this rank's tokens
            dist.all_reduce(g, group=tp)
        out[name] = g
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--rm", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    args = p.parse_args()
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, sequence_parallel=args.sp)
    init_distributed(parallel)
    report = {}

    model, arch = load_checkpoint_model(args.policy, parallel)
    mult = sequence_multiple(model)
    ids, lengths = _sequences(arch.vocab_size, 11, 0, mult)
    packs = pack_micro_batches(ids, lengths, MICRO, pad_id=0, multiple_of=mult)
    report["widths"] = [pk.width for pk in packs]
    ref = forward_only(model, ids)
    results = _packed_logits(model, packs)
    logits = logprobs = 0.0
    if results:  # the last stage
        for pk, r in zip(packs, results):
            back = pk.unpack(r["out"])
            for i, row in enumerate(pk.rows.tolist()):
                n = int(lengths[row])
                logits = max(logits, float((back[i, :n] - ref[row, :n]).abs().max()))
    logp = compute_logprobs(model, TokenBatch(ids, torch.zeros(ids.shape), lengths=lengths), PACKED)
    mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    if ref is not None:
        want = torch.log_softmax(ref.double(), -1).gather(-1, shifted_labels(ids)[..., None])[..., 0]
        logprobs = float((logp.double() - want)[mask].abs().max())
    report["logits"] = _max_all(logits)
    report["logprobs"] = _max_all(logprobs)
    report["logprob_zeros_outside"] = bool((logp[~mask] == 0).all())

    # gradients of sum_t w_t * logp_t * mask_t / sum(mask), over the same two micro-batches
    labels = shifted_labels(ids)
    g = torch.Generator().manual_seed(12)
    loss_mask = (torch.arange(ids.shape[1])[None, :] < (lengths[:, None] - 1)).float()
    weight = torch.randn(ids.shape, generator=g)
    total = loss_mask.sum()
    dev = device()

    def padded_step(it, m):
        rows = next(it)
        width = round_up(int(lengths[rows].max()), mult)
        x = ids[rows, :width].to(dev)
        out = m(x, position_ids_for(x), None)

        def loss(o):
            lp = token_logprobs(o, labels[rows, :width].to(dev))
            return (weight[rows, :width].to(dev) * lp * loss_mask[rows, :width].to(dev)).sum() / total, {}

        return out, loss

    def packed_step(it, m):
        pk = next(it)

        def loss(o):
            lp = token_logprobs(o, pk.pack(labels).to(dev))
            return (pk.pack(weight).to(dev) * lp * pk.pack(loss_mask).to(dev)).sum() / total, {}

        return forward_packed(m, pk), loss

    rows = [torch.tensor(mb) for mb in MICRO]
    shapes = [(len(mb), round_up(int(lengths[mb].max()), mult)) for mb in MICRO]
    a = _grads(model, rows, shapes, padded_step)
    b = _grads(model, packs, [(1, pk.width) for pk in packs], packed_step)
    scale = max(float(v.abs().max()) for v in a.values())
    report["grad_scale"] = _max_all(scale)
    report["grads"] = _max_all(max(float((a[k] - b[k]).abs().max()) for k in a)) / report["grad_scale"]
    del model

    rm, rm_arch = load_checkpoint_model(args.rm, parallel)
    pad = rm_arch.pad_token_id or 0
    ids, lengths = _sequences(rm_arch.vocab_size, 13, pad, mult)
    want = forward_only(rm, ids, sequence_lengths=lengths)
    got = rm_scores(rm, ids, lengths, batching=PACKED)
    report["scores"] = _max_all(0.0 if want is None else float((got - want.float()).abs().max()))
    report["score_scale"] = _max_all(0.0 if want is None else float(want.abs().min()))
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
