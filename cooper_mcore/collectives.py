"""The collectives cooper_mcore issues itself, and the model-parallel helpers built on them.

Every tensor collective of the package goes through this module (a test checks that no other
module calls ``torch.distributed``'s tensor collectives directly, except the weight gather of
:mod:`cooper_mcore.rollout.weight_sync`, whose tensors are parameters already on the device).
Each function moves its tensor to :func:`cooper_mcore.parallel.device` before communicating:
NCCL accepts only tensors on the current GPU, and a tensor made with ``torch.zeros(n)`` lives on
the host, which gloo (CPU runs) accepts but NCCL rejects with "No backend type associated with
device type cpu". Results are returned on the device; callers that need host values call
``.cpu()``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, TypeVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.parallel import device

T = TypeVar("T")


def model_parallel_group_and_src() -> tuple[Any, int]:
    """The model-parallel group of this rank and its first (global) rank."""
    group = parallel_state.get_model_parallel_group()
    return group, dist.get_process_group_ranks(group)[0]


def is_group_leader() -> bool:
    """Whether this rank is the first of its model-parallel group (it owns the rollout engine)."""
    return dist.get_rank() == model_parallel_group_and_src()[1]


def broadcast_object_in_model_parallel_group(obj: T) -> T:
    """Send a picklable object from the model-parallel group's first rank to the others."""
    group, src = model_parallel_group_and_src()
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


#: the most dimensions :func:`broadcast_tensor_in_model_parallel_group` sends a shape of
_MAX_DIMS = 7


def broadcast_tensor_in_model_parallel_group(t: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The model-parallel group's first rank's ``t`` on every rank of the group, as tensors, not
    pickled: its shape first (one int64 tensor), then its bytes (one uint8 tensor: neither NCCL nor
    gloo reduces or broadcasts every dtype, int16 for one, and bytes are bytes).

    Args:
        t: the tensor on the group's first rank (of ``dtype``, at most 7 dimensions); None elsewhere.
        dtype: its dtype (every rank must know it).

    Returns:
        The tensor, on the device; ``t`` itself in a one-rank group.
    """
    group, src = model_parallel_group_and_src()
    if dist.get_world_size(group) == 1:
        assert t is not None, "the group's first rank holds the tensor"
        return t
    leader = dist.get_rank() == src
    header = torch.full((1 + _MAX_DIMS,), -1, dtype=torch.int64)
    if leader:
        assert t is not None and t.dtype == dtype and t.dim() <= _MAX_DIMS, (None if t is None else (t.dtype, t.shape))
        header[0] = t.dim()
        header[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    header = header.to(device())
    dist.broadcast(header, src=src, group=group)
    if leader:
        shape = list(t.shape)
        data = t.to(device()).contiguous().reshape(-1).view(torch.uint8)
    else:
        dims = header.tolist()
        shape = dims[1:1 + dims[0]]
        data = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=device())
    dist.broadcast(data, src=src, group=group)
    return data.view(dtype).reshape(shape)


def broadcast_from_last_stage(t: torch.Tensor, pp_group: Optional[Any] = None) -> torch.Tensor:
    """``t`` of the last pipeline stage on every stage of ``pp_group`` (default: this rank's).

    Every stage passes a tensor of the same shape and dtype (the non-last stages' values are
    ignored). Returns a tensor on the device.
    """
    pp_group = pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()
    t = t.to(device())
    if dist.get_world_size(pp_group) > 1:
        dist.broadcast(t, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    return t


def all_reduce(t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, group: Optional[Any] = None) -> torch.Tensor:
    """All-reduce ``t`` over ``group`` (default: the world); returns the result on the device."""
    t = t.to(device())
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather(t: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
    """Concatenate ``t`` of every rank of ``group`` along dim 0 (same shape on every rank)."""
    t = t.to(device()).contiguous()
    size = dist.get_world_size(group)
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts)


def any_rank(flag: bool, group: Optional[Any] = None) -> bool:
    """Whether ``flag`` is true on any rank of ``group`` (collective: every rank calls it)."""
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0]), dist.ReduceOp.MAX, group).item() > 0)


def gather_objects(obj: T, group: Optional[Any] = None) -> list[T]:
    """``obj`` of every rank of ``group`` (default the world), in rank order (collective: every rank
    calls it); ``[obj]`` in a world of one or without one."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
