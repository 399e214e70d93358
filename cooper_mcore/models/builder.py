"""Build Megatron ``GPTModel``s (the policy) and reward models from an :class:`ArchSpec`.

The reward model is the same backbone with a bias-free linear head to one scalar, read at the
last non-pad token, as ``Qwen2ForSequenceClassification(num_labels=1)``.

Process groups are passed explicitly (``pg_collection``) so that two models (policy and RM)
can live in one process; by default megatron-core's global groups are used.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from cooper_mcore.compat import megatron_fixes  # noqa: F401  (megatron's MoE router without TE)
from cooper_mcore.models.arch import ArchSpec, rope_inv_freq
from cooper_mcore.models.norms import RMSNorm
from cooper_mcore.models.spec import layer_spec, te_available
from cooper_mcore.parallel import ParallelConfig


def transformer_config(
    arch: ArchSpec,
    parallel: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    recompute: bool = False,
) -> TransformerConfig:
    """The megatron TransformerConfig equal to the HF architecture.

    Args:
        arch: the architecture.
        parallel: TP/PP layout.
        dtype: parameter dtype (float32 or bfloat16).
        init_weights: run megatron's random init (False when weights are loaded right after).
        recompute: full activation recomputation of each layer.

    Raises:
        ValueError: a layout the architecture cannot be split into.
    """
    if arch.num_layers % parallel.pp:
        raise ValueError(f"num_layers={arch.num_layers} is not divisible by pp={parallel.pp}")
    if arch.num_query_groups % parallel.tp:
        raise ValueError(
            f"num_key_value_heads={arch.num_query_groups} is not divisible by tp={parallel.tp}"
        )
    if arch.vocab_size % parallel.tp:
        raise ValueError(f"vocab_size={arch.vocab_size} is not divisible by tp={parallel.tp}")
    cuda = torch.cuda.is_available()
    kwargs = moe_config(arch, parallel)
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not cuda,
        perform_initialization=init_weights,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=cuda,
        **kwargs,
    )


def moe_config(arch: ArchSpec, parallel: ParallelConfig) -> dict:
    """megatron's mixture-of-experts settings equal to the HF routing (none for a dense model).

    Top-k routing: with ``moe_router_pre_softmax=False`` megatron softmaxes the k largest logits,
    which is HF's ``norm_topk_prob=True``; with ``True`` it takes the k largest of the softmax over
    all experts, unrenormalised, HF's ``norm_topk_prob=False``. Router logits are kept in fp32.
    The load-balancing loss is megatron's (per sparse layer, summed over layers) with HF's coefficient.
    """
    moe = arch.moe
    if moe is None:
        if parallel.ep > 1 or (parallel.etp or 1) > 1:
            raise ValueError(f"parallel.ep={parallel.ep} / etp={parallel.etp} need a mixture-of-experts model; "
                             f"this {arch.family} model is dense")
        return {}
    if moe.num_experts % parallel.ep:
        raise ValueError(f"num_experts={moe.num_experts} is not divisible by parallel.ep={parallel.ep}")
    if moe.expert_ffn_hidden_size % parallel.expert_tp:
        raise ValueError(f"moe_intermediate_size={moe.expert_ffn_hidden_size} is not divisible by "
                         f"parallel.etp={parallel.expert_tp}")
    pattern = [int(s) for s in arch.moe_layers()]
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.experts_per_token,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_layer_freq=1 if all(pattern) else pattern,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.router_aux_loss_coef,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,  # megatron's legacy GroupedMLP; the experts module is the layer spec's
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )


def block_spec(arch: ArchSpec, config: TransformerConfig, pp_rank: int,
               use_te: Optional[bool], grouped_experts: bool = True) -> ModuleSpec | TransformerBlockSubmodules:
    """The decoder block of this pipeline stage: one layer spec, or a spec per layer where they differ.

    A dense model with Transformer Engine gets TE's layer spec (and TE's final norm); without TE
    the final norm is the layers' (``models.norms``); an MoE model gets each of its stage's layers'
    spec, dense or sparse, in the order of ``ArchSpec.moe_layers``, its experts grouped or sequential
    (:func:`~cooper_mcore.models.spec.layer_spec`).
    """
    te = te_available() if use_te is None else use_te
    n = get_num_layers_to_build(config, pp_rank=pp_rank)
    if arch.moe is None:
        spec = layer_spec(arch.qk_norm, use_te)
        return spec if te else TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=RMSNorm)
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    sparse = arch.moe_layers()[offset:offset + n]
    specs = [layer_spec(arch.qk_norm, use_te, arch.moe.num_experts if s else None, grouped_experts) for s in sparse]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=LayerNormImpl if te else RMSNorm)


class ScalarHead(MegatronModule):
    """A bias-free linear map from the hidden state to one scalar, replicated across TP ranks.

    Called like megatron's output layer: ``head(hidden, weight=None, runtime_gather_output=None)``
    returns ``(scores [s, b, 1], None)``.
    """

    def __init__(self, config: TransformerConfig, tp_group) -> None:
        super().__init__(config=config)
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(
            torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=_init_device())
        )
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight)
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # The head is replicated: every TP rank computes the same scores from the gathered
            # sequence, so the gradient of the gathered hidden state is the same on every rank and
            # each rank keeps its own sequence slice of it (output_grad=False: split). With
            # output_grad=True the backward would reduce-scatter, summing tp identical copies.
            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return F.linear(hidden, self.weight), None


class RewardGPTModel(GPTModel):
    """A GPT backbone whose output layer is a :class:`ScalarHead`.

    On the last pipeline stage ``forward`` returns:

    * with ``sequence_lengths=L`` ``[b]``: the score at position ``L - 1`` of each right-padded row
      (its last non-pad token), ``[b]``;
    * with ``score_positions=P`` ``[k]``: the scores at the flat positions ``P`` of the ``[b, s]``
      output, ``[k]``; for a packed row (``b = 1``, ``packed_seq_params``) these are the sequences'
      last tokens, ``PackedBatch.last_token_positions``;
    * with neither: the per-token scores ``[b, s]``.
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs["share_embeddings_and_output_weights"] = False
        super().__init__(*args, **kwargs)
        if self.post_process:
            self.output_layer = ScalarHead(self.config, self.pg_collection.tp)

    def forward(self, input_ids, position_ids, attention_mask, *args, sequence_lengths=None,
                score_positions=None, **kwargs):
        if sequence_lengths is not None and score_positions is not None:
            raise ValueError("RewardGPTModel.forward: pass sequence_lengths or score_positions, not both")
        out = super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        if not self.post_process:
            return out
        scores = out.squeeze(-1)
        if score_positions is not None:
            return scores.reshape(-1)[score_positions.to(scores.device)]
        if sequence_lengths is None:
            return scores
        rows = torch.arange(scores.shape[0], device=scores.device)
        return scores[rows, sequence_lengths.to(scores.device) - 1]


def _init_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_model(
    arch: ArchSpec,
    parallel: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    pg_collection: Optional[ProcessGroupCollection] = None,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    use_te: Optional[bool] = None,
    recompute: bool = False,
    grouped_experts: bool = True,
) -> GPTModel:
    """Build this rank's part of the policy (``causal_lm``) or reward model (``reward``).

    Args:
        arch: the architecture (its ``model_type`` picks policy or reward model).
        parallel: TP/PP layout; must match the initialised process groups.
        dtype: parameter dtype.
        init_weights: random-initialise (False when a checkpoint is loaded next).
        pg_collection: process groups to use; default: megatron's global groups.
        pre_process / post_process: this stage holds the embedding / the output head;
            default: from the pipeline rank.
        use_te: force the Transformer Engine spec on/off; default: on when available.
        recompute: full activation recomputation.
        grouped_experts: a mixture-of-experts model's experts in grouped matrix multiplies (False:
            megatron's ``SequentialMLP``; the checkpoints are the same).
    """
    if arch.moe is None:  # the expert layout is the MoE model's; a dense model beside it (a Cooper RM) has no experts
        parallel = dataclasses.replace(parallel, ep=1, etp=1)
    config = transformer_config(arch, parallel, dtype, init_weights, recompute)
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    assert pp_size == parallel.pp, f"pp group size {pp_size} != parallel.pp {parallel.pp}"
    if pre_process is None:
        pre_process = pp_rank == 0
    if post_process is None:
        post_process = pp_rank == pp_size - 1
    cls = RewardGPTModel if arch.model_type == "reward" else GPTModel
    model = cls(
        config=config,
        transformer_layer_spec=block_spec(arch, config, pp_rank, use_te, grouped_experts),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope.theta,
        pg_collection=pg_collection,
    )
    if not init_weights:
        _mark_tensor_parallel_weights(model)
    # megatron's torch-norm fallback (no apex/TE) builds its norms on the default device, as do
    # other modules that ignore use_cpu_initialization: put every tensor on this rank's device,
    # as megatron's own get_model() does with model.cuda(). Only when one is elsewhere: a model
    # already in place is left alone (the memory simulation's fake tensors cannot be swapped)
    device = _init_device()
    if any(t.device != device for t in itertools.chain(model.parameters(), model.buffers())):
        model.to(device)
    # Exact HF rotary frequencies (megatron hard-codes llama3 scaling's other parameters).
    inv = rope_inv_freq(arch.rope, arch.head_dim).to(model.rotary_pos_emb.inv_freq.device)
    model.rotary_pos_emb.inv_freq = inv
    return model


def _mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Set the tensor-parallel attributes megatron-core skips without random init.

    megatron-core 0.16 sets ``tensor_model_parallel``/``partition_dim`` on column/row-parallel
    weights only inside its init functions; with ``perform_initialization=False`` they are
    missing, and gradient-norm accounting and weight gathering would treat shards as
    replicated. Biases are marked either way.
    """
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
