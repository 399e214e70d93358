"""The routed experts of a mixture-of-experts layer, computed with grouped matrix multiplies.

:class:`GroupedExperts` replaces megatron-core's ``SequentialMLP`` on the torch-native layer spec.
``SequentialMLP`` runs one gated MLP per expert, one after another (two small matmuls and a Python
loop step per expert and layer); here each layer's local experts are one stacked weight per linear,
and the tokens of all of them go through one grouped matrix multiply per linear:

* ``linear_fc1.weight`` ``[E_local, 2 I / etp, h]``: expert ``e``'s ``[gate; up]`` (this ETP rank's
  rows of each half), the layout of ``SequentialMLP``'s ``local_experts.{e}.linear_fc1.weight``;
* ``linear_fc2.weight`` ``[E_local, h, I / etp]``: expert ``e``'s ``down_proj`` (this rank's columns).

:func:`grouped_mm` uses ``torch._grouped_mm`` where it is known correct (:func:`grouped_mm_supported`:
CUDA bf16 on compute capability 9.x, and torch's own CPU implementation; row strides must be
multiples of 16 bytes) and otherwise one matmul per expert on the same stacked weights: the same
products, in the same order per expert. On other GPUs (Blackwell, Ampere) the per-expert path is
taken and said once in the log.

The groups of a layer's call (:class:`ExpertGroups`) are made once for both linears: for the grouped
kernel the cumulative offsets, summed where megatron's dispatcher left the counts (the host, after
its own synchronisation) and queued to the device without waiting (:func:`~cooper_mcore.models.transfer.
to_device_async`), so the layer adds no host stall; the per-expert path needs the sizes on the host,
which costs a device synchronisation only if the counts were on the device.

The distributed checkpoint is ``SequentialMLP``'s (same keys, global shapes and expert axis), so a
checkpoint saved with either loads into the other, and :mod:`cooper_mcore.convert.hf` reads both.
With Transformer Engine megatron's own ``TEGroupedMLP`` is used instead (:mod:`cooper_mcore.models.spec`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.tensor_parallel import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from cooper_mcore.models.transfer import to_device_async

logger = logging.getLogger(__name__)

#: the byte multiple torch's grouped matmul wants of every row stride of its operands
_ALIGN_BYTES = 16
#: the CUDA compute capability majors whose ``torch._grouped_mm`` is known to train experts correctly:
#: Hopper. On Blackwell (10.x) torch's CUTLASS kernel gives an expert without tokens a non-zero weight
#: gradient (pytorch#172439, open; CUTLASS fixed it upstream, and no torch release is known to carry
#: the fix); on other GPUs torch has no fast kernel and loops over the groups itself (pytorch#161407's
#: fallback, with a host synchronisation), which the per-expert path does without one.
GROUPED_MM_CAPABILITY_MAJORS = (9,)


@functools.cache
def _per_expert_notice(reason: str) -> None:
    """Say once per process (per reason) that the experts run one matmul per expert, and why."""
    logger.warning("grouped experts: one matmul per expert, not torch._grouped_mm: %s", reason)


def cuda_grouped_mm_correct(capability: tuple[int, int]) -> bool:
    """Whether torch's CUDA grouped matmul is known correct on a GPU of ``capability`` (major, minor);
    when it is not, the per-expert path is said once in the log."""
    if capability[0] in GROUPED_MM_CAPABILITY_MAJORS:
        return True
    major, minor = capability
    why = ("torch's CUTLASS kernel gives experts without tokens non-zero weight gradients there (pytorch#172439)"
           if major == 10 else "torch's fast grouped kernel is for 9.x and 10.x only (elsewhere it loops itself)")
    _per_expert_notice(f"compute capability {major}.{minor}: {why}")
    return False


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x [T, in]`` against stacked weights ``[E, out, in]`` here.

    CUDA: bf16 on a GPU where the kernel is known correct (:func:`cuda_grouped_mm_correct`: compute
    capability 9.x). CPU: torch's implementation (a loop over the groups). Both need 16-byte
    multiples of the row strides of the operands and the output.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.is_cuda:
        if x.dtype != torch.bfloat16:
            _per_expert_notice(f"torch's CUDA kernel takes bf16 only, the experts are {x.dtype}")
            return False
        if not cuda_grouped_mm_correct(torch.cuda.get_device_capability(x.device)):
            return False
    elif x.device.type != "cpu":
        return False
    size = x.element_size()
    return all(d * size % _ALIGN_BYTES == 0 for d in (weight.shape[1], weight.shape[2]))


@dataclass(frozen=True)
class ExpertGroups:
    """The consecutive row groups (one per local expert) of a layer's call, in the form its path takes:
    exactly one of ``offsets`` and ``sizes`` is set."""

    offsets: Optional[torch.Tensor] = None
    """``torch._grouped_mm``'s ``offs``: int32 ``[E]`` cumulative row counts on the rows' device."""
    sizes: Optional[list[int]] = None
    """The per-expert path's rows per group, on the host."""

    @classmethod
    def of(cls, counts: torch.Tensor, device: torch.device, grouped: bool) -> ExpertGroups:
        """The groups of ``counts`` (``[E]`` rows per group, on the host or on ``device``) for rows on
        ``device``: the grouped kernel's offsets, or the per-expert path's sizes.

        The offsets are summed where the counts are (no value is read on the host) and queued to
        ``device`` without waiting when they are on the host. The sizes are read on the host: a
        device synchronisation when the counts are on a GPU, for the per-expert path only.
        """
        assert counts.dim() == 1, counts.shape
        if grouped:
            return cls(offsets=to_device_async(torch.cumsum(counts, 0, dtype=torch.int32), device))
        return cls(sizes=[int(c) for c in counts.tolist()])

    def __len__(self) -> int:
        return len(self.offsets) if self.offsets is not None else len(self.sizes)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with row-major strides, which ``torch._grouped_mm`` checks even of an empty tensor:
    a broadcast (stride-0) gradient of a sum, or an empty one (a rank that received no tokens; torch
    calls an empty tensor contiguous whatever its strides), is copied."""
    return t if t.stride() == (t.shape[1], 1) else t.clone(memory_format=torch.contiguous_format)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """``x_e @ weight[e].T`` for consecutive row groups ``x_e`` of ``x``.

    Args:
        x: ``[T, in]`` rows sorted by group.
        weight: ``[E, out, in]`` stacked weights.
        groups: the ``E`` groups' rows (:meth:`ExpertGroups.of`, summing to ``T``): offsets for
            ``torch._grouped_mm``, or sizes for one matmul per group.

    Returns:
        ``[T, out]``.
    """
    assert x.dim() == 2 and weight.dim() == 3 and x.shape[1] == weight.shape[2], (x.shape, weight.shape)
    assert len(groups) == weight.shape[0], (len(groups), weight.shape)
    if groups.sizes is not None:
        parts = torch.split(x, groups.sizes)
        return torch.cat([p @ w.t() for p, w in zip(parts, weight)]) if parts else x.new_zeros((0, weight.shape[1]))
    out = torch._grouped_mm(_dense(x), weight.transpose(1, 2), offs=groups.offsets)
    if out.requires_grad:  # the backward's grouped matmuls check the output gradient's strides too
        out.register_hook(_dense)
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
        ``([T, h], None)``. The groups are made once for both linears (:class:`ExpertGroups`)."""
        fc1, fc2 = self.linear_fc1.weight, self.linear_fc2.weight
        grouped = grouped_mm_supported(tokens, fc1) and grouped_mm_supported(tokens, fc2)
        groups = ExpertGroups.of(torch.as_tensor(tokens_per_expert), tokens.device, grouped)
        gate_up = grouped_mm(tokens, fc1, groups)
        gate, up = torch.chunk(gate_up, 2, dim=-1)
        hidden = self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
        hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
        return grouped_mm(hidden, fc2, groups), None

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
