"""The embedded default job (``make demo`` / ``cooper demo``).

The Cooper RL demo is not built yet (it needs the trainer). Until then this runs the smallest
real thing that exists, end to end on CPU, and says so: build tiny random Qwen2 policy and
reward models with transformers, convert them to Megatron checkpoints, load them into
megatron-core GPT models, compare logits with transformers, and export them back to HF
format bit for bit.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

logger = logging.getLogger(__name__)


def run_demo(out: str) -> dict[str, float]:
    """Run the pre-Cooper demo into ``out``; return the measured differences."""
    from safetensors.torch import load_file

    from cooper_mcore.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from cooper_mcore.convert.compare import compare_logits
    from cooper_mcore.models.tiny import save_tiny_hf_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    logger.info("NOTE: the Cooper RL demo is not built yet; running the converter check instead")
    if os.path.exists(out):
        shutil.rmtree(out)
    results: dict[str, float] = {}
    for model_type in ("causal_lm", "reward"):
        hf_dir = save_tiny_hf_model(os.path.join(out, f"hf_{model_type}"), "qwen2", model_type)
        ckpt = os.path.join(out, f"mcore_{model_type}")
        back = os.path.join(out, f"hf_{model_type}_roundtrip")
        hf_to_mcore(hf_dir, ckpt)
        with single_process_world():
            diff = compare_logits(hf_dir, ckpt, ParallelConfig())
        mcore_to_hf(ckpt, back)
        a, b = load_file(f"{hf_dir}/model.safetensors"), load_file(f"{back}/model.safetensors")
        same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        what = "logit" if model_type == "causal_lm" else "reward score"
        logger.info("%s: max |%s diff| vs transformers = %.3g; HF->mcore->HF bitwise: %s",
                    model_type, what, diff, same)
        results[f"{model_type}/max_abs_diff"] = diff
        results[f"{model_type}/roundtrip_bitwise"] = float(same)
        if not same or diff > 1e-4:
            raise RuntimeError(f"demo check failed for {model_type}: diff={diff} bitwise={same}")
    logger.info("converter check passed (the Cooper RL demo is not built yet): %s", results)
    print(f"report: {out}", flush=True)  # the job's one line of output: where its files are
    return results
