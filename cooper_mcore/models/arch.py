"""Architecture descriptions read from Hugging Face ``config.json`` files.

:class:`ArchSpec` is the one typed description of a decoder that the model builder, the
converter mappings and the weight sync share. It is read from the plain config dict (both the
transformers 4.x ``rope_scaling``/``rope_theta`` and the 5.x ``rope_parameters`` spellings), so
nothing here needs transformers.

Mixture-of-experts decoders (Qwen3-MoE) are read into the same record, with their experts in
:class:`MoeSpec` (``ArchSpec.moe``, None for dense models); building and converting them is not
done yet, and :meth:`ArchSpec.require_dense` refuses them where a dense model is needed.
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
    "Qwen3MoeForCausalLM": ("qwen3_moe", "causal_lm"),
    "Qwen3MoeForSequenceClassification": ("qwen3_moe", "reward"),
}
FAMILY_CLASS_PREFIX = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
MOE_FAMILIES = ("qwen3_moe",)
#: config keys of shared experts (Qwen2-MoE, DeepSeek); Qwen3-MoE has none and none are supported
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
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
class MoeSpec:
    """The routed experts of a mixture-of-experts decoder (no shared experts).

    Attributes:
        num_experts: routed experts per sparse layer (``num_experts``, or ``num_local_experts``).
        experts_per_token: experts each token is routed to (``num_experts_per_tok``).
        expert_ffn_hidden_size: each expert's FFN size (``moe_intermediate_size``).
        norm_topk_prob: the top-k routing weights are renormalised to sum to 1.
        decoder_sparse_step: every ``decoder_sparse_step``-th layer is sparse (see :func:`sparse_layers`).
        mlp_only_layers: layers that stay dense whatever the step.
        router_aux_loss_coef: weight of the router's load-balancing loss.
    """

    num_experts: int
    experts_per_token: int
    expert_ffn_hidden_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        self.mlp_only_layers = tuple(self.mlp_only_layers)  # a list after a JSON round trip


def sparse_layers(num_layers: int, decoder_sparse_step: int, mlp_only_layers: tuple[int, ...] = ()) -> list[bool]:
    """Which decoder layers are sparse (mixture of experts), as transformers' Qwen3-MoE decides.

    Layer ``i`` (0-based) is sparse when it is not in ``mlp_only_layers`` and ``(i + 1)`` is a
    multiple of ``decoder_sparse_step``: step 1 makes every layer sparse, step 2 layers 1, 3, ...

    Args:
        num_layers: decoder layers.
        decoder_sparse_step: the step (>= 1).
        mlp_only_layers: 0-based indices of layers kept dense.

    Raises:
        ValueError: a step below 1.
    """
    if decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {decoder_sparse_step}")
    dense = set(mlp_only_layers)
    return [i not in dense and (i + 1) % decoder_sparse_step == 0 for i in range(num_layers)]


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
    moe: MoeSpec | None = None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def moe_layers(self) -> list[bool]:
        """Per decoder layer, whether it is sparse (all False for a dense model)."""
        if self.moe is None:
            return [False] * self.num_layers
        return sparse_layers(self.num_layers, self.moe.decoder_sparse_step, self.moe.mlp_only_layers)

    def require_dense(self, where: str) -> None:
        """Refuse a mixture-of-experts model where only dense ones are supported yet.

        Args:
            where: what cannot take it, e.g. ``"the model builder (cooper_mcore/models/builder.py)"``.

        Raises:
            ValueError: ``self`` has experts.
        """
        if self.moe is not None:
            raise ValueError(
                f"{self.hf_architecture()} is a mixture-of-experts model ({self.moe.num_experts} experts), "
                f"which {where} does not support yet: it has no MoE layers or expert-parallel groups "
                f"(docs/moe.md); only dense Qwen2/2.5, Llama 3.x and Qwen3 models can be used"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.moe is None:
            del d["moe"]  # dense records are written as before the MoE field existed
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchSpec:
        d = dict(d)
        d["rope"] = RopeSpec(**d["rope"])
        if d.get("moe") is not None:
            d["moe"] = MoeSpec(**d["moe"])
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
            qk_norm=family in ("qwen3", "qwen3_moe"),
            rope=_read_rope(cfg),
            pad_token_id=cfg.get("pad_token_id"),
            moe=_read_moe(cfg) if family in MOE_FAMILIES else None,
        )

    def hf_architecture(self) -> str:
        suffix = "ForCausalLM" if self.model_type == "causal_lm" else "ForSequenceClassification"
        return FAMILY_CLASS_PREFIX[self.family] + suffix


def _int_key(cfg: dict[str, Any], key: str, default: int | None = None, low: int = 1) -> int:
    """``cfg[key]`` as an int >= ``low``; ValueError naming the key otherwise."""
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"config key {key!r} must be an integer >= {low}, got {value!r}")
    return value


def _read_moe(cfg: dict[str, Any]) -> MoeSpec:
    """The experts of a Qwen3-MoE config (transformers' ``Qwen3MoeConfig`` keys).

    Raises:
        ValueError: a missing or invalid key, or one the model cannot represent (shared experts),
            named in the message.
    """
    for key in _SHARED_EXPERT_KEYS:
        if cfg.get(key):
            raise ValueError(f"config key {key!r}={cfg[key]!r}: shared experts are not supported")
    keys = [k for k in ("num_experts", "num_local_experts") if k in cfg]
    if not keys:
        raise ValueError("config has no 'num_experts' (or 'num_local_experts')")
    if len(keys) == 2 and cfg["num_experts"] != cfg["num_local_experts"]:
        raise ValueError(f"config keys 'num_experts'={cfg['num_experts']!r} and "
                         f"'num_local_experts'={cfg['num_local_experts']!r} disagree")
    num_experts = _int_key(cfg, keys[0])
    top_k = _int_key(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"config key 'num_experts_per_tok'={top_k} exceeds the {num_experts} experts")
    num_layers = cfg["num_hidden_layers"]
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense
    ):
        raise ValueError(f"config key 'mlp_only_layers' must list layer indices in [0, {num_layers}), got {dense!r}")
    coef = cfg.get("router_aux_loss_coef", 0.001)
    if not isinstance(coef, (int, float)) or isinstance(coef, bool) or coef < 0:
        raise ValueError(f"config key 'router_aux_loss_coef' must be a number >= 0, got {coef!r}")
    norm = cfg.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"config key 'norm_topk_prob' must be true or false, got {norm!r}")
    return MoeSpec(
        num_experts=num_experts,
        experts_per_token=top_k,
        expert_ffn_hidden_size=_int_key(cfg, "moe_intermediate_size"),
        norm_topk_prob=norm,
        decoder_sparse_step=_int_key(cfg, "decoder_sparse_step", 1),
        mlp_only_layers=tuple(sorted(set(dense))),
        router_aux_loss_coef=float(coef),
    )


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
