"""Tiny random Hugging Face models of every supported family, built offline from configs.

Used by the tests, the benchmarks and the pre-demo ``cooper demo``: no hub access is needed.
"""

from __future__ import annotations

import json
import os

import tokenizers
import torch
import transformers

FAMILIES = ("qwen2", "qwen2_tied", "llama", "qwen3", "qwen3_moe")
#: config fields of the experts: overrides of these apply to the qwen3_moe family only, so that one set
#: of overrides can shape an MoE model and a dense one (a rehearsal's policy and RM)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")


def tiny_hf_config(family: str, model_type: str = "causal_lm", **overrides):
    """A small transformers config of ``family`` (see :data:`FAMILIES`).

    Args:
        family: "qwen2" (untied), "qwen2_tied", "llama" (Llama 3.2-style rope scaling), "qwen3" or
            "qwen3_moe" (Qwen3-MoE: 8 experts, top 2, every layer sparse but the last, so that both
            kinds of layer are covered; ``mlp_only_layers=[]`` makes all sparse).
        model_type: "causal_lm" or "reward" (``...ForSequenceClassification``, one label).
        overrides: config fields to change (e.g. hidden_size, num_hidden_layers); those of
            :data:`MOE_FIELDS` only for the qwen3_moe family (a dense family ignores them).
    """
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if family in ("qwen2", "qwen2_tied"):
        cls, prefix = transformers.Qwen2Config, "Qwen2"
        common.update(tie_word_embeddings=family == "qwen2_tied", rope_theta=10000.0)
    elif family == "llama":
        cls, prefix = transformers.LlamaConfig, "Llama"
        common.update(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "qwen3":
        cls, prefix = transformers.Qwen3Config, "Qwen3"
        common.update(head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)
    elif family == "qwen3_moe":
        cls, prefix = transformers.Qwen3MoeConfig, "Qwen3Moe"
        common.update(head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      router_aux_loss_coef=0.001)
    else:
        raise ValueError(f"unknown tiny family {family!r}; choose from {FAMILIES}")
    common.update({k: v for k, v in overrides.items() if family == "qwen3_moe" or k not in MOE_FIELDS})
    if family == "qwen3_moe" and "mlp_only_layers" not in overrides:  # the last layer of the final depth
        common["mlp_only_layers"] = [common["num_hidden_layers"] - 1]
    cfg = cls(**common)
    if model_type == "reward":
        cfg.architectures = [prefix + "ForSequenceClassification"]
        cfg.num_labels = 1
        cfg.pad_token_id = 0
        cfg.tie_word_embeddings = False
    else:
        cfg.architectures = [prefix + "ForCausalLM"]
    return cfg


def save_tiny_hf_model(out_dir: str, family: str, model_type: str = "causal_lm",
                       seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> str:
    """Build a random tiny HF model and save it (safetensors) to ``out_dir``."""
    cfg = tiny_hf_config(family, model_type, **overrides)
    torch.manual_seed(seed)
    auto = (transformers.AutoModelForSequenceClassification if model_type == "reward"
            else transformers.AutoModelForCausalLM)
    model = auto.from_config(cfg, dtype=dtype)
    with torch.no_grad():  # make norms and biases non-trivial so that mapping errors show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return out_dir


def save_tiny_tokenizer(out_dir: str, size: int = 128) -> str:
    """Save a word-level fast tokenizer with ``size`` ids (``<|pad|>``, ``<|endoftext|>``, ``<unk>``,
    then ``w3``, ``w4``, ...) to ``out_dir``: one that fits the tiny models' vocabulary of 128, or,
    larger, one that does not."""
    vocab = {"<|pad|>": 0, "<|endoftext|>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, size)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>",
                                               eos_token="<|endoftext|>", unk_token="<unk>")
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # what AutoTokenizer builds without a model type
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return out_dir
