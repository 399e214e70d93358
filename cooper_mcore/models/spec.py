"""Transformer layer specs: Transformer Engine when importable, else torch-native with SDPA.

The torch-native spec is megatron-core's local spec (column/row-parallel linears, RMSNorm via
torch) with its core attention replaced by :class:`SDPAttention`, which calls
``torch.nn.functional.scaled_dot_product_attention`` (flash/memory-efficient kernels on GPUs,
exact math on CPU). Both specs write the same dist-checkpoint keys (megatron-core maps the local
spec's norm names onto TE's fused names), so checkpoints move between them.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


def te_available() -> bool:
    """Whether Transformer Engine can be used (importable and a GPU present)."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


class SDPAttention(MegatronModule):
    """Core attention on ``scaled_dot_product_attention``, a drop-in for DotProductAttention.

    Takes query ``[sq, b, np, hn]`` and key/value ``[sk, b, ng, hn]`` (this rank's heads and
    query groups) and returns ``[sq, b, np * hn]``.
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
        packed_seq_params=None,
    ) -> torch.Tensor:
        assert packed_seq_params is None and attention_bias is None
        sq, b, np_, hn = query.shape
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        if k.shape[1] != np_:  # grouped-query attention: repeat each group for its heads
            rep = np_ // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None if attention_mask is None else ~attention_mask  # megatron: True = masked out
        if causal:
            assert sq == k.shape[2], "causal SDPA expects equal query and key lengths"
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal,
            dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def layer_spec(qk_norm: bool, use_te: bool | None = None) -> ModuleSpec:
    """The decoder layer spec.

    Args:
        qk_norm: RMSNorm on queries and keys per head (Qwen3).
        use_te: force Transformer Engine on/off; default: on when available.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te is None:
        use_te = te_available()
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    spec = specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
