"""``cooper eval``: held-out accuracy of a policy checkpoint (avg@k, as the paper: temperature
0.7, top-p 0.95), sampled with the transformers engine and checked by the rule verifier.

A Megatron checkpoint (a converted model or a trainer checkpoint's ``policy/`` folder) is first
exported to a temporary HF folder with the converter.
"""

from __future__ import annotations

import logging
import os
import tempfile

import torch

from cooper_mcore.checkpoint.model import EXTRA_DIR, META_FILE, is_model_checkpoint, read_meta, refuse_unfinished
from cooper_mcore.checkpoint.tokenizer import tokenizer_folder
from cooper_mcore.convert.hf import mcore_to_hf
from cooper_mcore.data.datasets import read_prompts
from cooper_mcore.data.templates import template_prompts
from cooper_mcore.data.tokenizer import check_tokenizer_fits, load_tokenizer
from cooper_mcore.rollout.base import SamplingParams
from cooper_mcore.rollout.hf_engine import HFEngine
from cooper_mcore.verify.rule import RuleVerifier

logger = logging.getLogger(__name__)


def _check_checkpoint_tokenizer(ckpt: str) -> None:
    """A checkpoint's ``hf_extra/`` must hold a tokenizer that fits its vocabulary (ValueError otherwise)."""
    extra = tokenizer_folder(ckpt)
    if extra is None:
        raise ValueError(f"{ckpt!r} has no tokenizer files (in {EXTRA_DIR}/); evaluation needs one")
    check_tokenizer_fits(load_tokenizer(extra), read_meta(ckpt)[0].vocab_size, ckpt, tokenizer_path=extra)


def evaluate_policy(model_dir: str, data_path: str, k: int = 8, temperature: float = 0.7, top_p: float = 0.95,
                    max_new_tokens: int = 512, template: str = "{question}", use_chat_template: bool = False,
                    limit: int = 0, seed: int = 0, verifier_workers: int = 2, timeout_s: float = 5.0) -> dict:
    """avg@k accuracy of a policy on a prompt file.

    Args:
        model_dir: an HF folder, or a cooper_mcore model checkpoint (exported on the fly).
        data_path: JSONL/Parquet prompts with ``question`` and ``answer``.
        k: samples per prompt.
        limit: use the first ``limit`` prompts (0 = all).

    Returns:
        ``{"acc", "prompts", "samples", "unverifiable", "pass@k"}``.
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder not found: {model_dir} (an HF folder or a cooper_mcore checkpoint)")
    refuse_unfinished(model_dir)  # a checkpoint its writer never finished, with or without its cooper_model.json
    if not is_model_checkpoint(model_dir) and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ValueError(f"--model {model_dir!r} is neither an HF model folder (no config.json) nor a cooper_mcore "
                         f"checkpoint (no {META_FILE})")
    prompts, _ = read_prompts(data_path)  # a bad --data fails before any model is loaded
    if limit:
        prompts = prompts[:limit]
    with tempfile.TemporaryDirectory(prefix="cooper-eval-") as tmp:
        hf_dir = model_dir
        if is_model_checkpoint(model_dir):
            _check_checkpoint_tokenizer(model_dir)  # before the export
            hf_dir = os.path.join(tmp, "hf")
            mcore_to_hf(model_dir, hf_dir)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        engine = HFEngine.from_pretrained(hf_dir, device=device)
        if engine.tokenizer is None:
            raise ValueError(f"{model_dir!r} has no tokenizer files; evaluation needs one")
        template_prompts(prompts, template, engine.tokenizer, use_chat_template, tokenize=True)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        outs = engine.generate([p.token_ids for p in prompts for _ in range(k)], params)
        with RuleVerifier(timeout_s=timeout_s, num_workers=verifier_workers) as verifier:
            verdicts = verifier.verify_batch([p.answer for p in prompts for _ in range(k)], [o.text for o in outs])
    correct = [bool(v.correct) for v in verdicts]
    per_prompt = [any(correct[i * k:(i + 1) * k]) for i in range(len(prompts))]
    result = {"acc": sum(correct) / max(len(correct), 1), "pass@k": sum(per_prompt) / max(len(prompts), 1),
              "prompts": len(prompts), "samples": len(correct),
              "unverifiable": sum(v.correct is None for v in verdicts)}
    logger.info("eval %s on %s: avg@%d %.4f", model_dir, data_path, k, result["acc"])
    return result
