"""Per-parameter mapping between Hugging Face and Megatron names and layouts.

Pure functions on whole (unsharded) tensors, torch only. One table per architecture family
(Qwen2/Qwen2.5, Llama 3.x, Qwen3, Qwen3-MoE), plus the reward head. The converter and the weight
sync to rollout engines both use it.

Megatron names are those of a GPTModel built with the torch-native (local) spec, with global
layer numbers. Transformer Engine's fused norm names are mapped onto them by
:func:`canonical_mcore_name`.

Layouts:
    * ``linear_qkv`` holds, for each query group g, its ``heads_per_group`` query heads, then
      its key head, then its value head: ``[g0: q.. k v | g1: q.. k v | ...]`` along dim 0.
    * ``linear_fc1`` is ``[gate; up]`` along dim 0.
    * A sparse (mixture-of-experts) layer's MLP is megatron-core's ``MoELayer``: the router
      ``mlp.router.weight`` is HF's ``mlp.gate.weight`` ``[experts, hidden]``, and expert ``e`` is an
      MLP named ``mlp.experts.local_experts.{e}.linear_fc1/linear_fc2`` (``SequentialMLP``'s names)
      made of HF's per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (the names of the
      safetensors files, which transformers 5 fuses into ``gate_up_proj``/``down_proj`` in memory
      only), fc1 again ``[gate; up]``. The names use global expert numbers. A live model may hold
      its experts as ``SequentialMLP`` (one module per expert), as stacked weights
      ``mlp.experts.linear_fc1.weight`` ``[E_local, ...]`` (:class:`~cooper_mcore.models.experts.GroupedExperts`)
      or as Transformer Engine's per-expert ``mlp.experts.linear_fc1.weight{e}`` (``TEGroupedMLP``):
      :func:`mapping_tensors` names each expert's tensor in all three, adding an expert-parallel
      rank's offset to its local expert numbers.
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
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
#: the other two expert layouts: stacked (no number) and Transformer Engine's per-expert ``weight{e}``
_GROUPED_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d*)$")


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
    sparse = arch.moe_layers()
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
        maps.extend(moe_mappings(arch, i) if sparse[i] else _dense_mlp_mappings(m + "mlp.", h + "mlp."))
    maps.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if arch.model_type == "reward":
        maps.append(ParamMapping("output_layer.weight", ("score.weight",)))
    elif not arch.tie_word_embeddings:
        maps.append(ParamMapping("output_layer.weight", ("lm_head.weight",)))
    return maps


def _dense_mlp_mappings(mcore: str, hf: str) -> list[ParamMapping]:
    """A gated MLP: megatron's ``{mcore}linear_fc1/fc2`` from HF's ``{hf}gate/up/down_proj``."""
    return [
        ParamMapping(mcore + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), "gate_up"),
        ParamMapping(mcore + "linear_fc2.weight", (hf + "down_proj.weight",)),
    ]


def moe_mappings(arch: ArchSpec, layer: int) -> list[ParamMapping]:
    """The MLP of sparse layer ``layer``: the router, then each expert (global numbers) in order.

    Raises:
        ValueError: ``arch`` has no experts.
    """
    if arch.moe is None:
        raise ValueError(f"{arch.hf_architecture()} has no experts")
    m, h = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    maps = [ParamMapping(m + "router.weight", (h + "gate.weight",))]
    for e in range(arch.moe.num_experts):
        maps.extend(_dense_mlp_mappings(f"{m}experts.local_experts.{e}.", f"{h}experts.{e}."))
    return maps


def hf_shapes(arch: ArchSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every HF tensor the mapping reads or writes."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {}
    expert_ffn = arch.moe.expert_ffn_hidden_size if arch.moe else 0
    for m in param_mappings(arch):
        for name in m.hf:
            leaf = name.split(".")[-2] + "." + name.split(".")[-1]
            if ".mlp.experts." in name:  # an expert's gate/up/down projection
                shapes[name] = (h, expert_ffn) if leaf == "down_proj.weight" else (expert_ffn, h)
                continue
            shapes[name] = {
                "gate.weight": (arch.moe.num_experts if arch.moe else 0, h),
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


def is_expert_param(name: str) -> bool:
    """Whether a live model's parameter is an expert's weight (split over the expert-parallel group,
    numbered locally): ``SequentialMLP``'s, stacked, or Transformer Engine's."""
    match = _LAYER_RE.match(_strip_wrappers(name))
    return bool(match and (_LOCAL_EXPERT_RE.match(match.group(2)) or _GROUPED_EXPERT_RE.match(match.group(2))))


def is_stacked_expert_param(name: str) -> bool:
    """Whether a live model's parameter holds all local experts' weights of one linear (``[E_local, ...]``)."""
    match = _LAYER_RE.match(_strip_wrappers(name))
    grouped = _GROUPED_EXPERT_RE.match(match.group(2)) if match else None
    return bool(grouped and not grouped.group(2))


def expert_linear(name: str) -> str:
    """``"linear_fc1"`` or ``"linear_fc2"``: which linear of its expert a mapping or parameter name is
    (fc1 is column-parallel over the expert tensor-parallel group, fc2 row-parallel).

    Raises:
        ValueError: not an expert weight.
    """
    leaf = _strip_wrappers(name).rsplit(".", 2)
    if len(leaf) == 3 and leaf[1] in ("linear_fc1", "linear_fc2") and is_expert_param(name):
        return leaf[1]
    raise ValueError(f"{name!r} is not an expert weight")


def mapping_tensors(name: str, tensor: torch.Tensor, layer_offset: int = 0,
                    expert_offset: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The mapping names and tensors one live parameter (or state-dict entry) holds.

    Most hold one: ``(canonical_mcore_name(name, ...), tensor)``. A stacked expert weight ``[E_local, ...]``
    holds one per local expert, ``tensor[e]`` (a view) named ``...local_experts.{e + expert_offset}...``.
    """
    if not is_stacked_expert_param(name):
        return [(canonical_mcore_name(name, layer_offset, expert_offset), tensor)]
    match = _LAYER_RE.match(_strip_wrappers(name))
    layer, linear = int(match.group(1)) + layer_offset, _GROUPED_EXPERT_RE.match(match.group(2)).group(1)
    return [(f"decoder.layers.{layer}.mlp.experts.local_experts.{e + expert_offset}.{linear}.weight", t)
            for e, t in enumerate(tensor.unbind(0))]


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def canonical_mcore_name(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Map a live model's parameter name to the mapping's name.

    Strips DDP/float16 wrappers (``module.``), renames Transformer Engine's fused norm weights and
    its per-expert ``mlp.experts.linear_fc1.weight{e}`` to ``SequentialMLP``'s names, adds the pipeline
    stage's layer offset to the layer number and the expert-parallel rank's expert offset (its first
    global expert) to an expert's local number. A stacked expert weight keeps its name (it is many
    mappings: :func:`mapping_tensors`).
    """
    name = _strip_wrappers(name)
    match = _LAYER_RE.match(name)
    if not match:
        return name
    idx, rest = int(match.group(1)), match.group(2)
    rest = _TE_NAMES.get(rest, rest)
    expert = _LOCAL_EXPERT_RE.match(rest)
    te_expert = _GROUPED_EXPERT_RE.match(rest)
    if expert:
        rest = f"mlp.experts.local_experts.{int(expert.group(1)) + expert_offset}.{expert.group(2)}"
    elif te_expert and te_expert.group(2):
        rest = f"mlp.experts.local_experts.{int(te_expert.group(2)) + expert_offset}.{te_expert.group(1)}.weight"
    return f"decoder.layers.{idx + layer_offset}.{rest}"
