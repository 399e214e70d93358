"""Per-parameter mapping between Hugging Face and Megatron names and layouts.

Pure functions on whole (unsharded) tensors, torch only. One table per architecture family
(Qwen2/Qwen2.5, Llama 3.x, Qwen3), plus the reward head. The converter and the weight sync to
rollout engines both use it.

Megatron names are those of a GPTModel built with the torch-native (local) spec, with global
layer numbers. Transformer Engine's fused norm names are mapped onto them by
:func:`canonical_mcore_name`.

Layouts:
    * ``linear_qkv`` holds, for each query group g, its ``heads_per_group`` query heads, then
      its key head, then its value head: ``[g0: q.. k v | g1: q.. k v | ...]`` along dim 0.
    * ``linear_fc1`` is ``[gate; up]`` along dim 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from cooper_mcore.models.arch import ArchSpec

_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LOCAL_TO_TE = {v: k for k, v in _TE_NAMES.items()}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter and the HF tensors it is made of.

    Attributes:
        mcore: Megatron name (local spec, global layer number).
        hf: HF names, in the order ``kind`` expects.
        kind: "copy", "qkv" (q, k, v weights or biases) or "gate_up" (gate, up).
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str = "copy"


def param_mappings(arch: ArchSpec) -> list[ParamMapping]:
    """All parameters of the model, in model order."""
    maps = [ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = h + "self_attn."
        maps.append(ParamMapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",)))
        maps.append(ParamMapping(
            m + "self_attention.linear_qkv.weight",
            (att + "q_proj.weight", att + "k_proj.weight", att + "v_proj.weight"), "qkv",
        ))
        if arch.qkv_bias:
            maps.append(ParamMapping(
                m + "self_attention.linear_qkv.bias",
                (att + "q_proj.bias", att + "k_proj.bias", att + "v_proj.bias"), "qkv",
            ))
        if arch.qk_norm:
            maps.append(ParamMapping(m + "self_attention.q_layernorm.weight", (att + "q_norm.weight",)))
            maps.append(ParamMapping(m + "self_attention.k_layernorm.weight", (att + "k_norm.weight",)))
        maps.append(ParamMapping(m + "self_attention.linear_proj.weight", (att + "o_proj.weight",)))
        maps.append(ParamMapping(
            m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)
        ))
        maps.append(ParamMapping(
            m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
            "gate_up",
        ))
        maps.append(ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",)))
    maps.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if arch.model_type == "reward":
        maps.append(ParamMapping("output_layer.weight", ("score.weight",)))
    elif not arch.tie_word_embeddings:
        maps.append(ParamMapping("output_layer.weight", ("lm_head.weight",)))
    return maps


def hf_shapes(arch: ArchSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor the mapping reads or writes."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {}
    for m in param_mappings(arch):
        for name in m.hf:
            leaf = name.split(".")[-2] + "." + name.split(".")[-1]
            shapes[name] = {
                "embed_tokens.weight": (arch.vocab_size, h),
                "lm_head.weight": (arch.vocab_size, h),
                "score.weight": (1, h),
                "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
                "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
                "o_proj.weight": (h, q),
                "q_norm.weight": (d,), "k_norm.weight": (d,),
                "gate_proj.weight": (arch.ffn_hidden_size, h),
                "up_proj.weight": (arch.ffn_hidden_size, h),
                "down_proj.weight": (h, arch.ffn_hidden_size),
            }.get(leaf, (h,))
    return shapes


def to_mcore(m: ParamMapping, tensors: list[torch.Tensor], arch: ArchSpec) -> torch.Tensor:
    """Build the Megatron tensor of mapping ``m`` from its HF tensors (in ``m.hf`` order)."""
    if m.kind == "copy":
        return tensors[0]
    if m.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    assert m.kind == "qkv", m.kind
    q, k, v = tensors
    g, d = arch.num_query_groups, arch.head_dim
    rest = q.shape[1:]
    q = q.reshape(g, arch.heads_per_group * d, *rest)
    k = k.reshape(g, d, *rest)
    v = v.reshape(g, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def to_hf(m: ParamMapping, tensor: torch.Tensor, arch: ArchSpec) -> list[torch.Tensor]:
    """Split the Megatron tensor of mapping ``m`` into its HF tensors (in ``m.hf`` order).

    The results are views where possible; call ``.contiguous()`` before serialising.
    """
    if m.kind == "copy":
        return [tensor]
    if m.kind == "gate_up":
        return list(torch.chunk(tensor, 2, dim=0))
    assert m.kind == "qkv", m.kind
    g, d, hpg = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    rest = tensor.shape[1:]
    grouped = tensor.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def canonical_mcore_name(name: str, layer_offset: int = 0) -> str:
    """Map a live model's parameter name to the mapping's name.

    Strips DDP/float16 wrappers (``module.``), renames Transformer Engine's fused norm weights,
    and adds the pipeline stage's layer offset to the layer number.
    """
    while name.startswith("module."):
        name = name[len("module."):]
    match = _LAYER_RE.match(name)
    if not match:
        return name
    idx, rest = int(match.group(1)), match.group(2)
    rest = _TE_NAMES.get(rest, rest)
    return f"decoder.layers.{idx + layer_offset}.{rest}"
