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
