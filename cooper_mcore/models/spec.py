"""Transformer layer specs: Transformer Engine when importable, else torch-native with SDPA.

The torch-native spec is megatron-core's local spec (column/row-parallel linears, RMSNorm via
torch) with its core attention replaced by :class:`SDPAttention`, which calls
``torch.nn.functional.scaled_dot_product_attention`` (flash/memory-efficient kernels on GPUs,
exact math on CPU). Both specs write the same dist-checkpoint keys (megatron-core maps the local
spec's norm names onto TE's fused names), so checkpoints move between them.

Packed sequences (megatron's ``thd`` format, ``PackedSeqParams(qkv_format="thd", cu_seqlens_q=...)``,
see :mod:`cooper_mcore.micro_batching.packing`): megatron's ``Attention`` squeezes the batch dimension of
one packed row, applies the rotary embedding per segment (positions restart at 0 in each,
``rope_utils._apply_rotary_pos_emb_thd``) and hands ``[t, heads, head_dim]`` tensors to the core
attention. :class:`SDPAttention` then attends within each segment only: on CUDA in half precision
with torch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``) when
torch has it, else one ``scaled_dot_product_attention`` call per segment (``sum L_i^2`` work instead of
the ``T^2`` of a block-diagonal mask; 4-D, so that torch's fused kernels take it). With Transformer Engine,
``TEDotProductAttention`` takes the same ``PackedSeqParams``.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from cooper_mcore.models.experts import GroupedExperts
from cooper_mcore.models.norms import RMSNorm

try:  # torch >= 2.9: variable-length flash attention (CUDA only)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - older torch
    varlen_attn = None


def te_available() -> bool:
    """Whether Transformer Engine can be used (importable and a GPU present)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


class SDPAttention(MegatronModule):
    """Core attention on ``scaled_dot_product_attention``, a drop-in for DotProductAttention.

    Takes query ``[sq, b, np, hn]`` and key/value ``[sk, b, ng, hn]`` (this rank's heads and
    query groups) and returns ``[sq, b, np * hn]``; with ``packed_seq_params`` (``thd``) takes
    ``[t, np, hn]`` / ``[t, ng, hn]`` and returns ``[t, np * hn]``, attending within each
    ``cu_seqlens`` segment only (causally, for the causal mask type).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise ValueError("SDPAttention: packed sequences take no attention_mask (cu_seqlens delimit them)")
            return self._packed(query, key, value, packed_seq_params, mask_type == AttnMaskType.causal)
        sq, b, np_, hn = query.shape
        q = query.permute(1, 2, 0, 3)
        k = _repeat_groups(key.permute(1, 2, 0, 3), np_, dim=1)
        v = _repeat_groups(value.permute(1, 2, 0, 3), np_, dim=1)
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None if attention_mask is None else ~attention_mask  # megatron: True = masked out
        if causal:
            assert sq == k.shape[2], "causal SDPA expects equal query and key lengths"
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                params: PackedSeqParams, causal: bool) -> torch.Tensor:
        """Attention within each segment of packed ``[t, heads, head_dim]`` tensors -> ``[t, heads * head_dim]``."""
        cu = _self_attention_cu_seqlens(params)
        t, np_, hn = query.shape
        dropout = self.dropout_p if self.training else 0.0
        if _use_varlen(query, dropout):
            kwargs = _varlen_kwargs(causal, self.softmax_scale, hn, key.shape[1] != np_)
            if kwargs is not None:
                if "enable_gqa" not in kwargs:
                    key, value = _repeat_groups(key, np_, dim=1), _repeat_groups(value, np_, dim=1)
                cu32 = cu.to(device=query.device, dtype=torch.int32)
                max_len = int(params.max_seqlen_q) if params.max_seqlen_q else int((cu[1:] - cu[:-1]).max())
                out = varlen_attn(query, key, value, cu32, cu32, max_len, max_len, **kwargs)
                return out.reshape(t, np_ * hn)
        bounds = cu.tolist()
        if bounds[0] != 0 or bounds[-1] != t:
            raise ValueError(f"SDPAttention: cu_seqlens {bounds} must run from 0 to the packed row's {t} tokens")
        k = _repeat_groups(key, np_, dim=1)
        v = _repeat_groups(value, np_, dim=1)
        parts = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            # [1, heads, L, head_dim]: 4-D inputs take torch's fused kernels (on CPU its flash attention,
            # which keeps no [L, L] score matrix, as the GPU's does); 3-D ones only the exact math path
            part = F.scaled_dot_product_attention(
                *(x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, k, v)),
                is_causal=causal, dropout_p=dropout, scale=self.softmax_scale,
            )
            parts.append(part.squeeze(0).transpose(0, 1))
        return torch.cat(parts).reshape(t, np_ * hn)


def _repeat_groups(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Grouped-query attention: repeat each key/value group for its query heads."""
    groups = x.shape[dim]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=dim)


def _self_attention_cu_seqlens(params: PackedSeqParams) -> torch.Tensor:
    """The one segment layout of packed self-attention, checked."""
    if params.qkv_format != "thd":
        raise ValueError(f"SDPAttention supports packed sequences in qkv_format 'thd' only, got {params.qkv_format!r}")
    cu = params.cu_seqlens_q
    if cu is None:
        raise ValueError("SDPAttention: PackedSeqParams.cu_seqlens_q is missing")
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(params, name)
        if other is not None and other is not cu and not torch.equal(other.to(cu.device), cu):
            raise ValueError(f"SDPAttention: {name} must be None or equal cu_seqlens_q (self-attention, no "
                             f"per-sequence padding; pad a packed row with a trailing segment instead)")
    return cu


def _varlen_kwargs(causal: bool, scale: float, head_dim: int, gqa: bool) -> Optional[dict]:
    """Keyword arguments of this torch's ``varlen_attn`` for our call, or None if it cannot make it.

    Its signature changed across torch releases: 2.9-2.10 take ``is_causal`` (and no scale or
    grouped-query attention), later ones ``scale``, ``window_size`` and ``enable_gqa``.
    """
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in params:
        kwargs["is_causal"] = causal
    else:
        return None
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, head_dim**-0.5):
        return None
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def _use_varlen(query: torch.Tensor, dropout: float) -> bool:
    """torch's variable-length flash attention: CUDA, half precision, no dropout, torch >= 2.9."""
    return (varlen_attn is not None and query.is_cuda and dropout == 0.0
            and query.dtype in (torch.float16, torch.bfloat16))


def layer_spec(qk_norm: bool, use_te: bool | None = None, num_experts: int | None = None,
               grouped_experts: bool = True) -> ModuleSpec:
    """The decoder layer spec.

    Args:
        qk_norm: RMSNorm on queries and keys per head (Qwen3).
        use_te: force Transformer Engine on/off; default: on when available.
        num_experts: routed experts of a mixture-of-experts layer (None: a dense MLP).
        grouped_experts: compute the experts with grouped matrix multiplies: megatron's ``TEGroupedMLP``
            with Transformer Engine, :class:`~cooper_mcore.models.experts.GroupedExperts` without; False
            gives megatron's ``SequentialMLP`` (one expert after another). All write the same checkpoint.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = te_available()
    grouped = num_experts is not None and grouped_experts
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=grouped,
                                                                 qk_layernorm=qk_norm)
    spec = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm,
                                          normalization="RMSNorm")
    if grouped:
        spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    # norms in the model's dtype that support sequence parallelism (megatron's torch fallback
    # builds fp32 norms and refuses it); the checkpoint keys stay the same
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if qk_norm:
        spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    return spec
