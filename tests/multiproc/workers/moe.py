"""Worker: load converted tiny Qwen3-MoE checkpoints at one TP/PP/EP/ETP layout; for each, the
largest |logit| (RM: score) difference from transformers and, for causal LMs, what a weight sync
pushes compared with the HF checkpoint's tensors. Prints one JSON line on rank 0.

``--te-expert-attrs`` gives the expert weights, before the push, the attributes Transformer Engine
gives megatron's expert linears under ETP (``parallel_mode=None``: ``tensor_model_parallel`` with
``partition_dim=0``, on the row-parallel fc2 too), a CPU model of the TE spec's weights."""

import argparse
import json

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from cooper_mcore.checkpoint.model import load_checkpoint_model
from cooper_mcore.convert.compare import logits_diff
from cooper_mcore.models.hf_mapping import is_expert_param, mapping_tensors
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed
from cooper_mcore.rollout.weight_sync import sync_weights


class RecordingEngine:
    """Keeps every (name, tensor) pushed to it, as a rollout engine would load them."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.repeated: list[str] = []
        self.weight_version = 0

    def update_weights(self, buckets, version: int) -> None:
        for bucket in buckets:
            for name, t in bucket:
                if name in self.tensors:
                    self.repeated.append(name)
                self.tensors[name] = t.detach().cpu().clone()
        self.weight_version = version


def compare_pushed(pushed: RecordingEngine, hf_dir: str) -> dict:
    """Names missing from / extra to the push, and names whose tensor differs in any bit or dtype."""
    ref = load_file(f"{hf_dir}/model.safetensors")
    common = set(ref) & set(pushed.tensors)
    return {"missing": sorted(set(ref) - common), "extra": sorted(set(pushed.tensors) - common),
            "unequal": sorted(k for k in common if not (ref[k].dtype == pushed.tensors[k].dtype
                                                        and torch.equal(ref[k], pushed.tensors[k]))),
            "repeated": pushed.repeated, "count": len(pushed.tensors)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", required=True, help="JSON list of [name, hf_dir, ckpt]")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--te-expert-attrs", action="store_true")
    args = p.parse_args()
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    init_distributed(parallel)
    from megatron.core import parallel_state as ps

    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    out = {}
    for name, hf_dir, ckpt in json.loads(args.pairs):
        model, arch = load_checkpoint_model(ckpt, parallel)
        res = {"logits": logits_diff(model, arch, hf_dir, batch=3, seq=12),
               "local_experts": {name: list(t.shape) for n, p in model.named_parameters() if is_expert_param(n)
                                 for name, t in mapping_tensors(n, p) if name.endswith("linear_fc1.weight")}}
        if args.te_expert_attrs:
            for n, p in model.named_parameters():
                if is_expert_param(n):
                    p.tensor_model_parallel, p.partition_dim = True, 0
        if arch.model_type == "causal_lm":
            engine = RecordingEngine() if first else None
            stats = sync_weights(model, arch, engine, version=3, bucket_bytes=64 * 1024)
            if first:  # every data-parallel replica's first rank pushes its own engine
                res["sync"] = {**compare_pushed(engine, hf_dir), "version": engine.weight_version,
                               "buckets": stats["buckets"]}
            synced = [None] * dist.get_world_size()
            dist.all_gather_object(synced, res.get("sync"))
            res["sync_by_rank"] = {r: s for r, s in enumerate(synced) if s is not None}
            res.pop("sync", None)
        out[name] = res
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
