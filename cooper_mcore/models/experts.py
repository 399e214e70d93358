"""The routed experts of a mixture-of-experts layer, computed with grouped matrix multiplies.

:class:`GroupedExperts` replaces megatron-core's ``SequentialMLP`` on the torch-native layer spec.
``SequentialMLP`` runs one gated MLP per expert, one after another (two small matmuls and a Python
loop step per expert and layer); here each layer's local experts are one stacked weight per linear,
and the tokens of all of them go through one grouped matrix multiply per linear:

* ``linear_fc1.weight`` ``[E_local, 2 I / etp, h]``: expert ``e``'s ``[gate; up]`` (this ETP rank's
  rows of each half), the layout of ``SequentialMLP``'s ``local_experts.{e}.linear_fc1.weight``;
* ``linear_fc2.weight`` ``[E_local, h, I / etp]``: expert ``e``'s ``down_proj`` (this rank's columns).

:func:`grouped_mm` uses ``torch._grouped_mm`` where it runs (CUDA with bf16 on compute capability 9.0
or newer, and torch's own CPU implementation; row strides must be multiples of 16 bytes) and otherwise
one matmul per expert on the same stacked weights: the same products, in the same order per expert.

The distributed checkpoint is ``SequentialMLP``'s (same keys, global shapes and expert axis), so a
checkpoint saved with either loads into the other, and :mod:`cooper_mcore.convert.hf` reads both.
With Transformer Engine megatron's own ``TEGroupedMLP`` is used instead (:mod:`cooper_mcore.models.spec`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.tensor_parallel import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

#: the byte multiple torch's grouped matmul wants of every row stride of its operands
_ALIGN_BYTES = 16


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x [T, in]`` against stacked weights ``[E, out, in]`` here.

    CUDA: bf16 on compute capability 9.0 or newer (Hopper, Blackwell), where torch has the kernel.
    CPU: torch's implementation (a loop over the groups). Both need 16-byte multiples of the row
    strides of the operands and the output.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    elif x.device.type != "cpu":
        return False
    size = x.element_size()
    return all(d * size % _ALIGN_BYTES == 0 for d in (weight.shape[1], weight.shape[2]))


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
               use_grouped: Optional[bool] = None) -> torch.Tensor:
    """``x_e @ weight[e].T`` for consecutive row groups ``x_e`` of ``x`` of sizes ``counts``.

    Args:
        x: ``[T, in]`` rows sorted by group.
        weight: ``[E, out, in]`` stacked weights.
        counts: ``[E]`` rows per group (any device), summing to ``T``.
        use_grouped: force ``torch._grouped_mm`` on or off (tests); default :func:`grouped_mm_supported`.

    Returns:
        ``[T, out]``.
    """
    assert x.dim() == 2 and weight.dim() == 3 and x.shape[1] == weight.shape[2], (x.shape, weight.shape)
    assert counts.numel() == weight.shape[0], (counts.shape, weight.shape)
    if use_grouped is None:
        use_grouped = grouped_mm_supported(x, weight)
    if use_grouped:
        offs = torch.cumsum(counts.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
        out = torch._grouped_mm(x.contiguous(), weight.transpose(1, 2), offs=offs)
    else:
        parts = torch.split(x, counts.tolist())
        out = torch.cat([p @ w.t() for p, w in zip(parts, weight)]) if parts else x.new_zeros((0, weight.shape[1]))
    if out.requires_grad:
        # the grouped matmul's backward needs real strides; a broadcast gradient (of a sum) has none
        out.register_hook(lambda g: g.contiguous())
    return out


class StackedLinear(torch.nn.Module):
    """One linear of every local expert: ``weight`` ``[E_local, out, in]`` (no bias).

    The parameter carries megatron's expert attributes: ``allreduce`` False under expert parallelism
    (megatron's DDP and optimizer then reduce and shard it over the expert data-parallel group),
    ``tensor_model_parallel`` with the dimension split over ETP (``partition_dim``: 1 for fc1's rows,
    2 for fc2's columns).
    """

    def __init__(self, experts: int, out_features: int, in_features: int, config: TransformerConfig,
                 partition_dim: int, expert_parallel: bool, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(experts, out_features, in_features, dtype=config.params_dtype,
                                                     device=device))
        self.weight.allreduce = not expert_parallel
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = partition_dim
        self.weight.partition_stride = 1


class GroupedExperts(MegatronModule):
    """The local experts of one MoE layer as two stacked weights and grouped matmuls.

    Built by megatron's ``MoELayer`` as its ``experts`` (``build_module(spec, num_local_experts, config,
    pg_collection=...)``) and called like ``SequentialMLP``: ``(tokens sorted by local expert,
    tokens_per_expert, their routing probabilities) -> (output, None)``. Each expert is a gated MLP
    (``act(gate) * up``, scaled by the token's probability in the activation's dtype, then
    ``down_proj``), as megatron's ``MLP`` computes it.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules=None,
                 pg_collection=None) -> None:
        super().__init__(config=config)
        if config.add_bias_linear or not config.gated_linear_unit or config.moe_apply_probs_on_input:
            raise ValueError("GroupedExperts: gated experts without bias, probabilities applied after the activation")
        if config.activation_func_clamp_value is not None:
            raise ValueError("GroupedExperts does not clamp the activation")
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        ffn = divide(config.moe_ffn_hidden_size, self.tp_group.size())
        device = (torch.device("cpu") if config.use_cpu_initialization
                  else torch.device("cuda", torch.cuda.current_device()))
        ep = config.expert_model_parallel_size > 1
        self.linear_fc1 = StackedLinear(num_local_experts, 2 * ffn, config.hidden_size, config, 1, ep, device)
        self.linear_fc2 = StackedLinear(num_local_experts, config.hidden_size, ffn, config, 2, ep, device)
        if config.perform_initialization:
            # as megatron's expert linears: the default generator when built on the host, the
            # expert-parallel stream of the CUDA RNG tracker on a GPU (other experts on each EP rank)
            rng = (contextlib.nullcontext() if config.use_cpu_initialization
                   else get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()))
            with rng:
                config.init_method(self.linear_fc1.weight.data)
                config.output_layer_init_method(self.linear_fc2.weight.data)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """``tokens [T, h]`` sorted by local expert, ``tokens_per_expert [E_local]``, ``probs [T]`` ->
        ``([T, h], None)``."""
        counts = torch.as_tensor(tokens_per_expert)
        gate_up = grouped_mm(tokens, self.linear_fc1.weight, counts)
        gate, up = torch.chunk(gate_up, 2, dim=-1)
        hidden = self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
        hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
        return grouped_mm(hidden, self.linear_fc2.weight, counts), None

    def backward_dw(self) -> None:
        """Nothing deferred (megatron calls it on every experts module)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """``SequentialMLP``'s checkpoint layout: keys ``{prefix}experts.linear_fc1.weight`` /
        ``linear_fc2.weight`` with a global expert axis after the layer axes; fc1's halves ``[gate; up]``
        stored as two row blocks when ETP splits them (megatron's swiglu layout)."""
        if (metadata or {}).get("singleton_local_shards"):
            raise ValueError("GroupedExperts does not write singleton_local_shards checkpoints")
        ep_rank, ep = self.ep_group.rank(), self.ep_group.size()
        etp_rank, etp = self.tp_group.rank(), self.tp_group.size()
        axis = len(sharded_offsets)
        replica_id = (0, 0, self.dp_group.rank())
        expert_axis = (axis, ep_rank, ep)
        fc1, fc2 = self.linear_fc1.weight, self.linear_fc2.weight
        out = {f"{prefix}linear_fc2.weight": ShardedTensor.from_rank_offsets(
            f"{prefix}experts.linear_fc2.weight", fc2, *sharded_offsets, expert_axis, (axis + 2, etp_rank, etp),
            replica_id=replica_id, prepend_axis_num=axis)}
        key = f"{prefix}experts.linear_fc1.weight"
        if etp == 1:
            out[f"{prefix}linear_fc1.weight"] = ShardedTensor.from_rank_offsets(
                key, fc1, *sharded_offsets, expert_axis, replica_id=replica_id, prepend_axis_num=axis)
            return out

        def build(key: str, t: torch.Tensor, replica_id, flattened_range):
            assert flattened_range is None, "GroupedExperts: no flattened optimizer state"
            gate, up = torch.chunk(t, 2, dim=1)
            return [ShardedTensor.from_rank_offsets(key, half, *sharded_offsets, expert_axis,
                                                    (axis + 1, block, 2 * etp), replica_id=replica_id,
                                                    prepend_axis_num=axis)
                    for half, block in ((gate, etp_rank), (up, etp + etp_rank))]

        def merge(halves: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(halves, dim=1)

        out[f"{prefix}linear_fc1.weight"] = ShardedTensorFactory(key, fc1, build, merge, replica_id)
        return out
