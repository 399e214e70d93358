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
from typing import Optional

import torch

from cooper_mcore.convert.checkpoint import hf_to_mcore
from cooper_mcore.data.datasets import write_prompts
from cooper_mcore.data.mathgen import MathTaskConfig, generate_prompts, tokenizer_corpus
from cooper_mcore.data.templates import rm_input
from cooper_mcore.data.tokenizer import train_tiny_tokenizer
from cooper_mcore.models.tiny import save_tiny_hf_model

logger = logging.getLogger(__name__)


def build_tiny_assets(out: str, n_train: int = 512, n_eval: int = 64, seed: int = 0,
                      hidden_size: int = 64, num_layers: int = 2, task: Optional[MathTaskConfig] = None,
                      rm_hidden_size: Optional[int] = None, rm_num_layers: Optional[int] = None,
                      vocab_size: int = 128, max_positions: int = 512) -> dict[str, str]:
    """Write the tiny assets under ``out`` (existing pieces are reused); return their paths.

    Args:
        out: the folder.
        n_train / n_eval: train and held-out prompts (disjoint by construction).
        seed: problems, tokenizer corpus and model initialisation.
        hidden_size / num_layers: the policy's size (and the RM's unless given separately).
        task: the arithmetic problem family (default :class:`MathTaskConfig`).
        rm_hidden_size / rm_num_layers: the reward model's size.
        vocab_size: the tokenizer's target vocabulary (the models' is padded to a multiple of 8).
        max_positions: the models' ``max_position_embeddings``.
    """
    paths = {k: os.path.join(out, v) for k, v in {
        "train": "train.jsonl", "eval": "eval.jsonl", "tokenizer": "tokenizer", "policy_hf": "policy_hf",
        "policy_ckpt": "policy_mcore", "rm_hf": "rm_hf", "rm_ckpt": "rm_mcore"}.items()}
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(paths["train"]):
        write_prompts(generate_prompts(n_eval, task, split="test", seed=seed), paths["eval"])
        tmp = os.path.join(out, "train.tmp.jsonl")
        write_prompts(generate_prompts(n_train, task, split="train", seed=seed), tmp)
        os.replace(tmp, paths["train"])  # written last and renamed: its presence marks both files complete
    corpus = tokenizer_corpus(2000, config=task, seed=seed)
    # the VerifyRM template's tags too, so that each is a few tokens rather than one <unk> per letter
    corpus += [rm_input(q, "0", c) for q, c in zip(corpus[0::3], corpus[1::3])][:200]
    tok = train_tiny_tokenizer(corpus, paths["tokenizer"], vocab_size=vocab_size)
    common = dict(vocab_size=-(-len(tok) // 8) * 8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  max_position_embeddings=max_positions)
    sizes = {"causal_lm": (hidden_size, num_layers),
             "reward": (rm_hidden_size or hidden_size, rm_num_layers or num_layers)}
    for kind, hf_key, ckpt_key in (("causal_lm", "policy_hf", "policy_ckpt"), ("reward", "rm_hf", "rm_ckpt")):
        if os.path.exists(paths[ckpt_key]):
            continue
        hidden, layers = sizes[kind]
        save_tiny_hf_model(paths[hf_key], "qwen2_tied" if kind == "causal_lm" else "qwen2", kind,
                           seed=seed + (kind == "reward"), dtype=torch.float32, hidden_size=hidden,
                           intermediate_size=2 * hidden, num_hidden_layers=layers, **common)
        # copy the files as trained: save_pretrained would rewrite tokenizer_class, and transformers 5
        # would then load a Qwen2Tokenizer next to the qwen2 config (different tokenization)
        shutil.copytree(paths["tokenizer"], paths[hf_key], dirs_exist_ok=True)
        hf_to_mcore(paths[hf_key], paths[ckpt_key])
    logger.info("tiny assets in %s", out)
    return paths
