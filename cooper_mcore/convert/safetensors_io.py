"""Streaming safetensors I/O for Hugging Face checkpoint folders.

:class:`HFCheckpointReader` opens a folder with ``model.safetensors`` or a sharded
``model.safetensors.index.json`` and hands out one tensor at a time.
:func:`write_tensors` streams tensors one at a time into shards plus an index, so the whole
model never needs to be in memory twice (the library's ``save_file`` serialises every tensor to
bytes first).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable

import torch
from safetensors import safe_open

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


class HFCheckpointReader:
    """Lazy access to the tensors of an HF safetensors checkpoint folder."""

    def __init__(self, hf_dir: str) -> None:
        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {hf_dir!r} "
                "(only safetensors checkpoints are read)"
            )
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def _handle(self, fname: str):
        if fname not in self._handles:
            path = os.path.join(self.hf_dir, fname)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"shard {path!r} named in the index is missing")
            self._handles[fname] = safe_open(path, framework="pt")
        return self._handles[fname]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file(name)).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a fresh CPU tensor)."""
        return self._handle(self._file(name)).get_tensor(name)

    def _file(self, name: str) -> str:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in the checkpoint {self.hf_dir!r}")
        return self.weight_map[name]


def write_tensors(
    out_dir: str,
    layout: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Stream tensors into an HF safetensors checkpoint (shards plus index when needed).

    The layout (name, shape, dtype of every tensor, in order) is known up front, so each
    shard's header is written first and every tensor goes to disk as soon as it is produced:
    only one tensor is held at a time. With one shard the file is ``model.safetensors`` and no
    index is written, as transformers does. Files appear under their final names only when
    complete.

    Args:
        out_dir: output folder (created).
        layout: ``(name, shape, dtype)`` of each tensor, in the order ``tensors`` yields them.
        tensors: ``(name, tensor)`` pairs.
        max_shard_bytes: start a new shard when this would be exceeded.

    Returns:
        The shard file names.
    """
    os.makedirs(out_dir, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
    size = 0
    for name, shape, dtype in layout:
        n = _numel(shape) * _itemsize(dtype)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(shape), dtype, n))
        size += n
    count = len(shards)
    names = (["model.safetensors"] if count == 1 else
             [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
    it = iter(tensors)
    total = 0
    for fname, shard in zip(names, shards):
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype, n in shard:
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        tmp = os.path.join(out_dir, fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, shape, dtype, _ in shard:
                got_name, t = next(it)
                if got_name != name or tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(
                        f"tensor {got_name!r} {tuple(t.shape)} {t.dtype} does not match the "
                        f"planned {name!r} {shape} {dtype}"
                    )
                f.write(_tensor_bytes(t.detach().to("cpu").contiguous()))
        os.replace(tmp, os.path.join(out_dir, fname))
        total += offset
    if count > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {s[0]: fname for fname, shard in zip(names, shards) for s in shard}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
