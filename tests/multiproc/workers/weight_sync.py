"""Worker: sync a TP/PP Megatron policy into an HF engine that starts from other weights, then
compare the engine's per-token logprobs and greedy tokens with the Megatron model's.
With ``--per-tp-rank`` the engine takes one SGLang payload per TP rank (as an SGLang engine with
the policy's TP size does) and loads the last rank's. Prints one JSON line on rank 0."""

import argparse
import json
import pickle

import torch
import torch.distributed as dist

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.models.forward import forward_only
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.rollout.weight_sync import sync_weights


class PayloadEngine:
    """An HF engine behind SGLang's per-rank payload interface: every bucket must come as ``tp``
    pickled payloads with the same tensors; the last rank's are loaded."""

    def __init__(self, inner: HFEngine, tp: int) -> None:
        self.inner, self.tp_size, self.payload_pids = inner, tp, set()

    def update_weights_from_payloads(self, payloads, version: int) -> None:
        buckets = []
        for blobs in payloads:
            assert len(blobs) == self.tp_size, len(blobs)
            entries = []
            for blob in blobs:
                p = pickle.loads(blob)
                flat = p["flattened_tensor"]
                entries.append([(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).clone())
                                for m in p["metadata"]])
            for other in entries[1:]:
                assert [n for n, _ in other] == [n for n, _ in entries[0]]
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(other, entries[0]))
            buckets.append(entries[-1])
        self.inner.update_weights(buckets, version)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def megatron_logprobs(model, ids):
    """[b, s-1] log-probabilities of ids[:, 1:], on every rank."""
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.float64)
    logits = forward_only(model, ids)
    from megatron.core import parallel_state as ps

    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
        logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
        out = logp.gather(-1, ids[:, 1:, None]).squeeze(-1).double()
    dist.all_reduce(out)
    return out


def megatron_greedy(model, prompt, n, eos):
    ids = list(prompt)
    new = []
    for _ in range(n):
        logits = forward_only(model, torch.tensor([ids]))
        nxt = torch.zeros((), dtype=torch.long)
        from megatron.core import parallel_state as ps

        if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
            nxt = logits[0, -1].argmax()
        dist.all_reduce(nxt)
        ids.append(int(nxt))
        new.append(int(nxt))
        if int(nxt) == eos:
            break
    return new


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", required=True, help="JSON list of [name, ckpt, engine_hf_dir]")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--per-tp-rank", action="store_true")
    args = p.parse_args()
    parallel = ParallelConfig(tp=args.tp, pp=args.pp)
    init_distributed(parallel)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, ckpt, engine_dir in json.loads(args.pairs):
        model, arch = load_checkpoint_model(ckpt, parallel)
        engine = HFEngine.from_pretrained(engine_dir, eos_token_id=1) if rank == 0 else None
        if engine is not None and args.per_tp_rank:
            engine = PayloadEngine(engine, args.tp)
        ids = torch.randint(2, arch.vocab_size, (3, 12), generator=gen)
        ref = megatron_logprobs(model, ids)
        res = {}
        if rank == 0:
            before = torch.tensor(engine.score(ids.tolist(), [1, 1, 1]), dtype=torch.float64)
            res["before_diff"] = float((before - ref).abs().max())
        stats = sync_weights(model, arch, engine, version=7, bucket_bytes=64 * 1024, per_tp_rank=args.per_tp_rank)
        greedy_ref = megatron_greedy(model, [5, 6, 7], 8, eos=1)
        if rank == 0:
            after = torch.tensor(engine.score(ids.tolist(), [1, 1, 1]), dtype=torch.float64)
            res["after_diff"] = float((after - ref).abs().max())
            res["buckets"] = stats["buckets"]
            res["version"] = engine.weight_version
            g = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, temperature=0))[0]
            res["greedy_equal"] = g.token_ids == greedy_ref
            res["greedy_len"] = len(greedy_ref)
            out[name] = res
    if rank == 0:
        print(json.dumps(out), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
