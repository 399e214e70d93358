"""Tiny, self-made assets for CPU runs: math prompts, a sentencepiece tokenizer, a random tiny
Qwen2 policy and reward model (HF folders with the tokenizer) and their Megatron checkpoints.

``cooper tiny-assets --out DIR`` writes them; ``examples/tiny_cpu.yaml`` points at them. The
policy here is untrained (the demo pre-trains one); the assets exist to exercise the whole
trainer on any laptop.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from cooper_mcore.convert.checkpoint import hf_to_mcore
from cooper_mcore.data.datasets import write_prompts
from cooper_mcore.data.mathgen import generate_prompts, tokenizer_corpus
from cooper_mcore.data.tokenizer import train_tiny_tokenizer
from cooper_mcore.models.tiny import save_tiny_hf_model

logger = logging.getLogger(__name__)


def build_tiny_assets(out: str, n_train: int = 512, n_eval: int = 64, seed: int = 0,
                      hidden_size: int = 64, num_layers: int = 2) -> dict[str, str]:
    """Write the tiny assets under ``out`` (existing pieces are reused); return their paths."""
    paths = {k: os.path.join(out, v) for k, v in {
        "train": "train.jsonl", "eval": "eval.jsonl", "tokenizer": "tokenizer", "policy_hf": "policy_hf",
        "policy_ckpt": "policy_mcore", "rm_hf": "rm_hf", "rm_ckpt": "rm_mcore"}.items()}
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(paths["train"]):
        write_prompts(generate_prompts(n_train, split="train", seed=seed), paths["train"])
        write_prompts(generate_prompts(n_eval, split="test", seed=seed), paths["eval"])
    tok = train_tiny_tokenizer(tokenizer_corpus(2000, seed=seed), paths["tokenizer"], vocab_size=128)
    size = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                vocab_size=-(-len(tok) // 8) * 8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                max_position_embeddings=512)
    for kind, hf_key, ckpt_key in (("causal_lm", "policy_hf", "policy_ckpt"), ("reward", "rm_hf", "rm_ckpt")):
        if os.path.exists(paths[ckpt_key]):
            continue
        save_tiny_hf_model(paths[hf_key], "qwen2_tied" if kind == "causal_lm" else "qwen2", kind,
                           seed=seed + (kind == "reward"), dtype=torch.float32, **size)
        # copy the files as trained: save_pretrained would rewrite tokenizer_class, and transformers 5
        # would then load a Qwen2Tokenizer next to the qwen2 config (different tokenization)
        shutil.copytree(paths["tokenizer"], paths[hf_key], dirs_exist_ok=True)
        hf_to_mcore(paths[hf_key], paths[ckpt_key])
    logger.info("tiny assets in %s", out)
    return paths
