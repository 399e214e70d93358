"""Compare a Megatron checkpoint's logits with its Hugging Face original.

Run under torchrun, e.g.::

    torchrun --nproc_per_node 4 tools/compare_logits.py --hf-dir HF --ckpt CKPT --tp 2 --pp 2
    torchrun --nproc_per_node 4 tools/compare_logits.py --hf-dir HF --ckpt CKPT --tp 2 --ep 2  # MoE

The last line printed is ``max_abs_logit_diff=<float>`` (for reward models: the difference of
the scalar scores at the last non-pad token).
"""

import argparse
import logging

import torch.distributed as dist

from cooper_mcore.convert.compare import compare_logits
from cooper_mcore.parallel import ParallelConfig, destroy_distributed, init_distributed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size (mixture-of-experts models; default: tp)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    init_distributed(parallel)
    diff = compare_logits(args.hf_dir, args.ckpt, parallel, args.batch, args.seq, args.seed)
    if dist.get_rank() == 0:
        print(f"max_abs_logit_diff={diff:.6g}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
