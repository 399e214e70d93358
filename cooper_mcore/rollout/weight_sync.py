"""Push the weights of a TP/PP-parallel Megatron policy into a rollout engine.

Each data-parallel replica gathers its own model one parameter at a time: tensor-parallel
shards are gathered to the stage's TP rank 0 (the fused ``linear_fc1`` per gate/up half), then
each pipeline stage broadcasts its full parameters to the replica's first rank, which maps them to
Hugging Face names with the per-parameter mapping it shares with the converter
(:mod:`cooper_mcore.models.hf_mapping`) and hands them to its engine in buckets of a configurable
size. The engine's ``weight_version`` is bumped.

With ``per_tp_rank`` (an SGLang engine with the policy's TP size, on the same GPUs) the shards are
all-gathered instead, every TP rank of the first stage holds the full tensors, makes its own
payload of each bucket, and the payloads are gathered (their handles, not the tensors) to the
replica's first rank, which hands entry ``i`` to SGLang's TP rank ``i``: each SGLang rank then reads
its weights from its own GPU, as verl and slime do, instead of every rank reading the leader's GPU
over CUDA IPC (an extra CUDA context on that GPU per SGLang rank).

A mixture-of-experts layer's experts are split over the expert-parallel group (and each expert
over the expert tensor-parallel group), which spans data-parallel replicas: they are all-gathered
over those groups instead of TP and named with global expert numbers.

Collective: every rank of the model's TP and PP groups calls :func:`sync_weights`, and for a
mixture-of-experts model every rank of its expert groups (so every replica sharing the experts);
only the replica's first rank (TP rank 0, PP rank 0) passes an engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cooper_mcore.collectives import any_rank
from cooper_mcore.models.arch import ArchSpec
from cooper_mcore.models.forward import unwrap
from cooper_mcore.models.hf_mapping import (
    canonical_mcore_name,
    expert_linear,
    is_expert_param,
    mapping_tensors,
    param_mappings,
    to_hf,
)
from cooper_mcore.rollout.base import RolloutEngine, bucketize
from cooper_mcore.rollout.sglang_payload import gather_rank_payloads, rank_payload

logger = logging.getLogger(__name__)


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this pipeline stage's first transformer layer."""
    layers = unwrap(model).decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def _gather_tp(name: str, param: torch.Tensor, tp_group, everywhere: bool = False) -> Optional[torch.Tensor]:
    """The full tensor of a (possibly) tensor-parallel parameter, on TP rank 0 (None elsewhere), or
    on every TP rank when ``everywhere``. The split dimension is the parameter's ``partition_dim``."""
    tp = dist.get_world_size(tp_group)
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    if everywhere:
        shards = [torch.empty_like(param) for _ in range(tp)]
        dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
    else:
        root = dist.get_process_group_ranks(tp_group)[0]
        shards = [torch.empty_like(param) for _ in range(tp)] if dist.get_rank() == root else None
        dist.gather(param.detach().contiguous(), shards, dst=root, group=tp_group)
        if shards is None:
            return None
    return _join_shards(shards, param.partition_dim, name.endswith(".linear_fc1.weight"))


def _join_shards(shards: list[torch.Tensor], dim: int, gate_up: bool) -> torch.Tensor:
    """Tensor-parallel shards joined along ``dim``; a gated fc1's shards are each ``[gate_r; up_r]``."""
    if gate_up:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


def expert_split_dim(name: str) -> int:
    """The dimension of one expert's 2-D weight that the expert tensor-parallel group splits: fc1 is
    column-parallel (its rows, 0), fc2 row-parallel (its columns, 1).

    Taken from what the layer is, not from the parameter's ``partition_dim``: megatron builds the
    experts' Transformer Engine linears with ``parallel_mode=None`` under ETP, and TE then marks
    ``partition_dim=0`` on fc2 too.
    """
    return 0 if expert_linear(name) == "linear_fc1" else 1


def _gather_experts(name: str, weight: torch.Tensor, ep_group, etp_group) -> list[torch.Tensor]:
    """One local expert weight's full tensor from every EP rank, in EP-rank order, on every rank.

    Expert weights are split over the expert-parallel group (whole experts) and, within one expert,
    over the expert tensor-parallel group (every expert weight, whatever its attributes say), not the
    TP group. Every EP rank may be some data-parallel replica's first rank (at TP=PP=1 each rank is a
    replica), so the experts are all-gathered.
    """
    full = weight.detach()
    etp = dist.get_world_size(etp_group)
    if etp > 1:
        shards = [torch.empty_like(full) for _ in range(etp)]
        dist.all_gather(shards, full.contiguous(), group=etp_group)
        full = _join_shards(shards, expert_split_dim(name), expert_linear(name) == "linear_fc1")
    ep = dist.get_world_size(ep_group)
    if ep == 1:
        return [full]
    out = [torch.empty_like(full) for _ in range(ep)]
    dist.all_gather(out, full.contiguous(), group=ep_group)
    return out


@dataclass(frozen=True)
class _Local:
    """One tensor of this stage and the global names of the full tensors it gathers into.

    Attributes:
        param: the local tensor (a parameter's shard, or one expert's view of stacked expert weights).
        names: one mapping name, or for an expert weight one per EP rank (global expert numbers).
        shape: the full tensor's shape (each of ``names``).
        expert: whether it is an expert weight (gathered over EP/ETP, not TP).
    """

    param: torch.Tensor
    names: tuple[str, ...]
    shape: tuple[int, ...]
    expert: bool


def _local_params(inner: torch.nn.Module, tp: int, ep: int, etp: int) -> list[_Local]:
    """This stage's tensors with their global names and full shapes (no collectives); a stacked expert
    weight is one entry per local expert."""
    offset = layer_offset(inner)
    local_experts = (inner.config.num_moe_experts or 0) // ep
    out = []
    for n, p in inner.named_parameters():
        if not is_expert_param(n):
            out.append(_Local(p, (canonical_mcore_name(n, offset),), _full_shape(p, tp), False))
            continue
        per_rank = [mapping_tensors(n, p, offset, r * local_experts) for r in range(ep)]
        for i, (name, t) in enumerate(per_rank[0]):
            shape = list(t.shape)
            shape[expert_split_dim(name)] *= etp
            out.append(_Local(t, tuple(pr[i][0] for pr in per_rank), tuple(shape), True))
    return out


#: what a pipeline stage tells the others before its weights: each tensor's mapping names, full shape, dtype
StageMeta = list[tuple[tuple[str, ...], tuple[int, ...], torch.dtype]]


def _stage_meta(local: list[_Local]) -> StageMeta:
    return [(x.names, x.shape, x.param.dtype) for x in local]


def stage_metadata(model: torch.nn.Module, tp: int, ep: int = 1, etp: int = 1) -> StageMeta:
    """What this pipeline stage broadcasts to the others before its weights in :func:`gathered_params`
    (no collectives; ``tp``/``ep``/``etp`` are the group sizes)."""
    return _stage_meta(_local_params(unwrap(model), tp, ep, etp))


def gathered_params(model: torch.nn.Module, tp_group, pp_group, every_tp_rank: bool = False,
                    ep_group=None, etp_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(mapping name, full tensor)`` of every parameter of the whole pipeline, on the
    replica's first rank (on every TP rank of the first stage with ``every_tp_rank``); other ranks
    take part in the collectives and yield nothing.

    TP shards are gathered to TP rank 0 of each stage (all-gathered with ``every_tp_rank``); the
    experts of a mixture-of-experts layer are all-gathered over the expert tensor-parallel and then
    the expert-parallel group (:func:`_gather_experts`), named with global expert numbers. The
    stages' TP-rank-0 processes (every TP rank's) then broadcast along their pipeline group, which
    contains the first stage's rank of the same TP rank.

    Args:
        ep_group / etp_group: the expert-parallel and expert tensor-parallel groups; needed when the
            model has experts.
    """
    inner = unwrap(model)
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    tp_root = every_tp_rank or dist.get_rank(tp_group) == 0
    receiver = tp_root and pp_rank == 0
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    etp = dist.get_world_size(etp_group) if etp_group is not None else 1
    local = _local_params(inner, dist.get_world_size(tp_group), ep, etp)
    assert ep_group is not None or not any(x.expert for x in local), "a model with experts needs ep_group"
    pp_ranks = dist.get_process_group_ranks(pp_group)
    device = next(inner.parameters()).device
    for stage in range(pp_size):
        if stage == pp_rank:
            meta: list[Optional[StageMeta]] = [_stage_meta(local)]
        else:
            meta = [None]
        if pp_size > 1 and tp_root:
            dist.broadcast_object_list(meta, src=pp_ranks[stage], group=pp_group)
        if stage != pp_rank and not tp_root:
            continue  # only TP rank 0 of each stage joins the pipeline broadcasts
        for i, (names, shape, dtype) in enumerate(meta[0]):
            fulls: list[Optional[torch.Tensor]] = [None] * len(names)
            if stage == pp_rank:
                x = local[i]
                fulls = (_gather_experts(names[0], x.param, ep_group, etp_group) if x.expert
                         else [_gather_tp(names[0], x.param, tp_group, every_tp_rank)])
            if not tp_root:
                continue
            for name, full in zip(names, fulls):
                if full is None:
                    full = torch.empty(shape, dtype=dtype, device=device)
                assert tuple(full.shape) == shape, (name, full.shape, shape)
                if pp_size > 1:
                    full = full.contiguous()
                    dist.broadcast(full, src=pp_ranks[stage], group=pp_group)
                if receiver:
                    yield name, full


def _full_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    """Shape of a parameter once its shards over a tensor-parallel group of size ``tp`` are gathered."""
    shape = list(param.shape)
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def hf_named_tensors(
    model: torch.nn.Module, arch: ArchSpec, tp_group, pp_group, every_tp_rank: bool = False,
    ep_group=None, etp_group=None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for the whole model on the replica's first rank (every TP rank of
    the first stage with ``every_tp_rank``). ``ep_group``/``etp_group``: the expert groups (a
    mixture-of-experts model; default megatron-core's)."""
    if arch.moe is not None:
        ep_group = ep_group or parallel_state.get_expert_model_parallel_group()
        etp_group = etp_group or parallel_state.get_expert_tensor_parallel_group()
    by_name = {m.mcore: m for m in param_mappings(arch)}
    for name, full in gathered_params(model, tp_group, pp_group, every_tp_rank, ep_group, etp_group):
        m = by_name.get(name)
        if m is None:
            if name == "output_layer.weight" and arch.tie_word_embeddings:
                continue  # the last stage's copy of tied embeddings
            raise ValueError(f"Megatron parameter {name!r} has no Hugging Face mapping")
        yield from ((n, t.contiguous()) for n, t in zip(m.hf, to_hf(m, full, arch)))


def sync_weights(
    model: torch.nn.Module,
    arch: ArchSpec,
    engine: Optional[RolloutEngine],
    version: int,
    bucket_bytes: int = 512 * 2**20,
    tp_group=None,
    pp_group=None,
    per_tp_rank: bool = False,
    ep_group=None,
    etp_group=None,
) -> dict[str, float]:
    """Push the model's weights into ``engine`` (given on the replica's first rank only).

    Args:
        model: this rank's stage of the policy (DDP/Float16 wrappers allowed).
        arch: its architecture.
        engine: the rollout engine on the replica's first rank; None elsewhere.
        version: the new weight version.
        bucket_bytes: size of the buckets handed to the engine.
        tp_group / pp_group: the model's groups; default: megatron-core's global groups.
        ep_group / etp_group: the expert-parallel and expert tensor-parallel groups of a
            mixture-of-experts model; default: megatron-core's.
        per_tp_rank: one payload per TP rank, made on that rank's device (an engine with
            ``update_weights_from_payloads`` and the model's TP size: SGLang on the same GPUs);
            ignored at TP=1.

    Returns:
        ``{"seconds", "bytes", "buckets"}`` (bytes and buckets on the first rank).

    Raises:
        ValueError: the first rank passes no engine, or with ``per_tp_rank`` an engine that
            cannot take one payload per TP rank (on every rank of the TP group).
    """
    tp_group = tp_group or parallel_state.get_tensor_model_parallel_group()
    pp_group = pp_group or parallel_state.get_pipeline_model_parallel_group()
    first = dist.get_rank(tp_group) == 0 and dist.get_rank(pp_group) == 0
    if first and engine is None:
        raise ValueError("sync_weights: the replica's first rank must pass its rollout engine")
    per_tp_rank = per_tp_rank and dist.get_world_size(tp_group) > 1
    if per_tp_rank:
        _check_per_rank_engine(engine if first else None, tp_group)
    t0 = time.perf_counter()
    stats = {"bytes": 0.0, "buckets": 0.0}
    receiver = dist.get_rank(pp_group) == 0 and (per_tp_rank or first)

    def counted():
        for name, t in hf_named_tensors(model, arch, tp_group, pp_group, per_tp_rank, ep_group, etp_group):
            stats["bytes"] += t.numel() * t.element_size()
            yield name, t

    def tally(buckets):
        for b in buckets:
            stats["buckets"] += 1
            yield b

    with torch.no_grad():
        if per_tp_rank and receiver:
            _push_per_tp_rank(tally(bucketize(counted(), bucket_bytes)), engine if first else None, version,
                              tp_group)
        elif receiver:
            engine.update_weights(tally(bucketize(counted(), bucket_bytes)), version)
        else:
            for _ in counted():
                pass
    if torch.cuda.is_available():
        # A CUDA tensor shared over CUDA IPC (each bucket of an SGLang payload) is not freed when this
        # process drops it while a receiver may still hold it: torch parks it in its IPC limbo, which is
        # emptied only when another shared block is freed or on a collect. Each bucket goes when the next
        # one is dropped, but the last (up to bucket_bytes) would stay allocated through generation. The
        # engine has loaded every bucket by now, so collect it.
        torch.cuda.ipc_collect()
    stats["seconds"] = time.perf_counter() - t0
    logger.debug("weight sync v%d: %.0f MB in %.2fs", version, stats["bytes"] / 2**20, stats["seconds"])
    return stats


def _check_per_rank_engine(engine: Optional[Any], tp_group) -> None:
    """Raise on every TP rank when the first rank's engine cannot take one payload per TP rank."""
    tp = dist.get_world_size(tp_group)
    bad = engine is not None and not (hasattr(engine, "update_weights_from_payloads")
                                      and getattr(engine, "tp_size", None) == tp)
    if any_rank(bad, tp_group):
        raise ValueError(f"sync_weights(per_tp_rank=True) needs an engine with update_weights_from_payloads and "
                         f"tp_size {tp} (the model's TP size); the replica's first rank has one that has not")


def _push_per_tp_rank(buckets: Iterable[list[tuple[str, torch.Tensor]]], engine: Optional[Any], version: int,
                      tp_group) -> None:
    """Every TP rank of the first stage: pickle a payload of each bucket from its own device and
    gather the payloads on TP rank 0, which hands them to ``engine`` (collective over ``tp_group``).

    A rank keeps each bucket alive until the next gather, which TP rank 0 reaches only after the
    engine has loaded the bucket; the barrier at the end covers the last one.
    """
    def per_bucket() -> Iterator[Optional[list[Any]]]:
        for bucket in buckets:
            yield gather_rank_payloads(rank_payload(bucket, as_base64=False), tp_group, dst=0)

    if engine is not None:
        engine.update_weights_from_payloads(per_bucket(), version)
    else:
        for _ in per_bucket():
            pass
    dist.barrier(group=tp_group)
