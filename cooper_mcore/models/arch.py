"""Architecture descriptions read from Hugging Face ``config.json`` files.

:class:`ArchSpec` is the one typed description of a decoder that the model builder, the
converter mappings and the weight sync share. It is read from the plain config dict (both the
transformers 4.x ``rope_scaling``/``rope_theta`` and the 5.x ``rope_parameters`` spellings), so
nothing here needs transformers.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from cooper_mcore.files import read_json_object

# HF ``architectures`` entry -> (family, model type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2ForCausalLM": ("qwen2", "causal_lm"),
    "Qwen2ForSequenceClassification": ("qwen2", "reward"),
    "LlamaForCausalLM": ("llama", "causal_lm"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "Qwen3ForCausalLM": ("qwen3", "causal_lm"),
    "Qwen3ForSequenceClassification": ("qwen3", "reward"),
}
FAMILY_CLASS_PREFIX = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3"}
MODEL_TYPES = ("causal_lm", "reward")
_REQUIRED_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


@dataclass
class RopeSpec:
    """Rotary embedding parameters (``rope_type`` "default" or "llama3")."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class ArchSpec:
    """Everything needed to build a Megatron decoder equal to a Hugging Face one."""

    family: str
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeSpec = field(default_factory=RopeSpec)
    pad_token_id: int | None = None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchSpec:
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], model_type: str | None = None) -> ArchSpec:
        """Read an HF config dict.

        Args:
            cfg: the contents of ``config.json``.
            model_type: "causal_lm" or "reward"; default: from ``architectures``.

        Raises:
            ValueError: unknown architecture, or a feature the builder does not support.
        """
        archs = cfg.get("architectures") or []
        family = None
        if archs:
            if archs[0] not in ARCHITECTURES:
                raise ValueError(
                    f"unknown architecture {archs[0]!r}; supported: {sorted(ARCHITECTURES)}"
                )
            family, arch_type = ARCHITECTURES[archs[0]]
        else:
            family, arch_type = cfg.get("model_type"), "causal_lm"
            if family not in FAMILY_CLASS_PREFIX:
                raise ValueError(
                    f"config has no 'architectures' and unknown model_type {family!r}; "
                    f"supported model types: {sorted(FAMILY_CLASS_PREFIX)}"
                )
        model_type = model_type or arch_type
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
        if model_type == "reward" and cfg.get("num_labels", len(cfg.get("id2label") or {0: 0})) != 1:
            raise ValueError("a reward model must have num_labels=1")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if family == "llama" and cfg.get("mlp_bias", False):
            raise ValueError("llama with mlp_bias=True is not supported")
        if cfg.get("use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        missing = [k for k in _REQUIRED_KEYS if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
        if missing:
            raise ValueError(f"config has no integer {', '.join(repr(k) for k in missing)}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        if family == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(cfg.get("attention_bias", False))
        return cls(
            family=family,
            model_type=model_type,
            num_layers=cfg["num_hidden_layers"],
            hidden_size=hidden,
            ffn_hidden_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family == "qwen3",
            rope=_read_rope(cfg),
            pad_token_id=cfg.get("pad_token_id"),
        )

    def hf_architecture(self) -> str:
        suffix = "ForCausalLM" if self.model_type == "causal_lm" else "ForSequenceClassification"
        return FAMILY_CLASS_PREFIX[self.family] + suffix


def _read_rope(cfg: dict[str, Any]) -> RopeSpec:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeSpec(theta=float(theta))
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    return RopeSpec(
        theta=float(theta),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def load_hf_config(hf_dir: str) -> dict[str, Any]:
    """Read ``config.json`` from a Hugging Face model folder.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: it is not valid JSON (the message names the file, line and column) or not an object.
    """
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {hf_dir!r}")
    return read_json_object(path)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, as transformers computes them (float32)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "default":
        return inv
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
