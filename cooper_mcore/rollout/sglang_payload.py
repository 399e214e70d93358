"""SGLang's ``flattened_bucket`` weight payloads: a bucket of named tensors becomes one ``uint8``
buffer plus per-tensor metadata, pickled as SGLang's ``MultiprocessingSerializer`` does, with
shared tensors (CUDA tensors as CUDA-IPC handles naming their GPU by UUID; CPU tensors as
shared-memory file names). One payload per SGLang TP rank, possibly made by different trainer
ranks (:func:`gather_rank_payloads`). See ``docs/sglang.md``.
"""

from __future__ import annotations

import base64
import io
import types
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions on ForkingPickler)
from torch.multiprocessing import reductions

LOAD_FORMAT = "flattened_bucket"  # SGLang's load_format for these payloads


@dataclass(frozen=True)
class BucketEntry:
    """One tensor of a flattened bucket (SGLang's ``FlattenedTensorMetadata`` fields; the indices
    and ``numel`` count bytes of the ``uint8`` buffer)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class FlatBucket:
    """A bucket as one contiguous ``uint8`` buffer plus the entries to cut it back into tensors."""

    flattened_tensor: torch.Tensor
    metadata: list[BucketEntry]


def flatten_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> FlatBucket:
    """Concatenate the bytes of every tensor (any dtypes, one device) into one ``uint8`` buffer.

    Each tensor starts at a multiple of its element size (zero padding before it if needed): the
    receiver views ``buffer[start:end]`` as the dtype, which fails on a misaligned offset. Without
    padding the layout equals SGLang's own ``FlattenedTensorBucket``.
    """
    if not named_tensors:
        raise ValueError("flatten_bucket: empty bucket")
    names = [n for n, _ in named_tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"flatten_bucket: duplicate names {sorted({n for n in names if names.count(n) > 1})}")
    devices = {t.device for _, t in named_tensors}
    if len(devices) > 1:
        raise ValueError(f"flatten_bucket: tensors on several devices {sorted(map(str, devices))}")
    parts, metadata, offset = [], [], 0
    for name, t in named_tensors:
        pad = -offset % t.element_size()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            offset += pad
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        metadata.append(BucketEntry(name, t.shape, t.dtype, offset, offset + raw.numel(), raw.numel()))
        offset += raw.numel()
    return FlatBucket(torch.cat(parts), metadata)


def unflatten_bucket(bucket: FlatBucket) -> list[tuple[str, torch.Tensor]]:
    """The tensors back from a bucket (views of its buffer), as SGLang's receiver rebuilds them."""
    flat = bucket.flattened_tensor
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in bucket.metadata]


def sglang_bucket_payload(bucket: FlatBucket) -> dict[str, Any]:
    """What SGLang's ``flattened_bucket`` loader unpickles: ``{"flattened_tensor", "metadata"}``. It reads
    the metadata items' attributes; ``types.SimpleNamespace`` passes its restricted unpickler."""
    meta = [types.SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=m.dtype, start_idx=m.start_idx,
                                  end_idx=m.end_idx, numel=m.numel) for m in bucket.metadata]
    return {"flattened_tensor": bucket.flattened_tensor, "metadata": meta}


def serialize_for_sglang(obj: Any, as_base64: bool) -> Any:
    """Pickle ``obj`` as SGLang's ``MultiprocessingSerializer`` does (``ForkingPickler``; tensors are
    shared, not copied), as bytes or as a base64 string for JSON.

    CUDA tensors travel as CUDA-IPC handles naming their GPU by UUID, as SGLang's
    ``monkey_patch_torch_reductions`` sends them (its receiver maps the UUID back to a device
    index, so the server may see a different ``CUDA_VISIBLE_DEVICES``). SGLang's patch itself is
    not applied: it assumes every tensor is a CUDA tensor and fails on CPU ones.

    CPU tensors are moved to shared memory and travel by file name (torch's ``file_system``
    sharing strategy, for this call only): the default file-descriptor strategy hands descriptors
    over a socket authenticated with the multiprocessing authkey, which only this process's own
    children share, so a server launched apart (``launch``, ``connect``) or a payload made by
    another trainer rank could not open them.
    """
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_for_sglang
    pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor_for_sglang
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        pickler.dump(obj)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    data = buf.getvalue()
    return base64.b64encode(data).decode("ascii") if as_base64 else data


_CUDA_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments (SGLang's constant)


def _reduce_tensor_for_sglang(t: torch.Tensor) -> tuple[Any, tuple]:
    """torch's tensor reduction (unpatched); for CUDA tensors the device index becomes the GPU's UUID."""
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)  # SGLang may have patched it
    fn, args = reduce(t)
    if t.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_CUDA_DEVICE_ARG]).uuid)
        args = (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1:])
    return fn, args


def rank_payload(bucket: Sequence[tuple[str, torch.Tensor]], as_base64: bool) -> Any:
    """The payload one SGLang TP rank loads for ``bucket`` (full Hugging Face tensors, one device):
    flattened (:func:`flatten_bucket`), wrapped (:func:`sglang_bucket_payload`) and pickled with
    shared tensors (:func:`serialize_for_sglang`). Make one per SGLang TP rank (torch counts the
    consumers of a CUDA-IPC handle per pickling), and keep the tensors alive until SGLang has
    loaded it."""
    return serialize_for_sglang(sglang_bucket_payload(flatten_bucket(bucket)), as_base64)


def gather_rank_payloads(payload: Any, group: Optional[dist.ProcessGroup] = None, dst: int = 0) -> Optional[list[Any]]:
    """Collect one payload from every rank of ``group`` on its rank ``dst`` (collective).

    With the trainer's TP group and an engine whose TP ranks sit on the same GPUs in the same
    order, SGLang's TP rank ``i`` then reads its weights from trainer TP rank ``i``'s own GPU
    (:meth:`SGLangEngine.update_weights_from_payloads`) instead of every SGLang rank reading the
    leader's GPU. Only the pickled handles travel (a few hundred bytes per bucket), not the
    tensors; every rank must keep its bucket alive until the leader's update returns.

    Returns:
        The payloads in group-rank order on ``dst``, None elsewhere.
    """
    gathered: Optional[list[Any]] = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(payload, gathered, dst=dist.get_global_rank(group, dst) if group is not None else dst,
                       group=group)
    return gathered
