"""Streaming safetensors I/O for Hugging Face checkpoint folders.

:class:`HFCheckpointReader` opens a folder with ``model.safetensors`` or a sharded
``model.safetensors.index.json`` and reads one tensor at a time, optionally straight into a
model parameter.
:func:`write_tensors` streams tensors one at a time into shards plus an index, so the whole
model never needs to be in memory twice (the library's ``save_file`` serialises every tensor to
bytes first).
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterable

import torch

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


_FROM_NAME = {v: k for k, v in _DTYPES.items()}


class HFCheckpointReader:
    """Lazy access to the tensors of an HF safetensors checkpoint folder.

    Reads with plain positional reads into tensors it allocates (or the caller's, with
    :meth:`read_into`): no memory map, so the process holds no file pages beyond the tensor
    being read, and a tensor can land directly in a model parameter.
    """

    def __init__(self, hf_dir: str) -> None:
        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {hf_dir!r} "
                "(only safetensors checkpoints are read)"
            )
        self._entries: dict[str, tuple[str, torch.dtype, tuple[int, ...], int, int]] = {}
        for fname in files:
            path = os.path.join(hf_dir, fname)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"shard {path!r} named in the index is missing")
            for name, entry in _read_header(path).items():
                self._entries[name] = (path, *entry)

    @property
    def weight_map(self) -> dict[str, str]:
        return {k: os.path.basename(v[0]) for k, v in self._entries.items()}

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[2]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[1]

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into a fresh CPU tensor."""
        _, dtype, shape, _, _ = self._entry(name)
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Read one tensor into ``out`` (contiguous CPU, same shape and dtype)."""
        path, dtype, shape, start, end = self._entry(name)
        assert out.is_contiguous() and out.device.type == "cpu"
        assert tuple(out.shape) == shape and out.dtype == dtype, (name, out.shape, out.dtype)
        if end == start:
            return
        buf = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            got = 0
            while got < len(buf):
                n = f.readinto(buf[got:])
                if not n:
                    raise ValueError(f"{path!r} is truncated: expected at least {start + len(buf)} bytes, found "
                                     f"{os.path.getsize(path)} (tensor {name!r} is cut off)")
                got += n

    def _entry(self, name: str):
        if name not in self._entries:
            raise KeyError(f"tensor {name!r} not found in the checkpoint {self.hf_dir!r}")
        return self._entries[name]


def _read_header(path: str) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """Parse a safetensors header: name -> (dtype, shape, absolute start, absolute end)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path!r} is not a safetensors file (too short)")
        n = struct.unpack("<Q", raw)[0]
        if n > size - 8:
            raise ValueError(f"{path!r} is truncated or not a safetensors file: its header needs {8 + n} bytes, "
                             f"the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ValueError(f"{path!r} is not a safetensors file (unreadable header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path!r} is not a safetensors file (header is not a JSON object)")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path!r}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if dtype_name not in _FROM_NAME:
            raise ValueError(f"{path!r}: tensor {name!r} has unsupported dtype {dtype_name}")
        dtype = _FROM_NAME[dtype_name]
        if end - start != _numel(shape) * _itemsize(dtype) or start < 0:
            raise ValueError(f"{path!r}: tensor {name!r} of shape {shape} {dtype_name} needs "
                             f"{_numel(shape) * _itemsize(dtype)} bytes but its data offsets span {end - start}")
        if 8 + n + end > size:
            raise ValueError(f"{path!r} is truncated: expected at least {8 + n + end} bytes, found {size} "
                             f"(tensor {name!r} is cut off)")
        out[name] = (dtype, shape, 8 + n + start, 8 + n + end)
    return out


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
        with open(tmp, "wb", buffering=0) as f:
            _write_all(f, struct.pack("<Q", len(raw)))
            _write_all(f, raw)
            for name, shape, dtype, _ in shard:
                got_name, t = next(it)
                if got_name != name or tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(
                        f"tensor {got_name!r} {tuple(t.shape)} {t.dtype} does not match the "
                        f"planned {name!r} {shape} {dtype}"
                    )
                _write_all(f, _tensor_bytes(t.detach().to("cpu").contiguous()))
        os.replace(tmp, os.path.join(out_dir, fname))
        total += offset
    if count > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {s[0]: fname for fname, shard in zip(names, shards) for s in shard}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


def _write_all(f, data) -> None:
    """Write all of ``data`` to an unbuffered file: a raw ``write`` may write only part of it (a disk
    filling up), which would leave a short file without an error."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = f.write(view)
        if not n:
            raise OSError(errno.ENOSPC, "no bytes written (disk full?)", f.name)
        view = view[n:]


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
