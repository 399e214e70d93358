"""The streaming safetensors writer, read back with the safetensors library itself."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from cooper_mcore.checkpoint.safetensors_io import HFCheckpointReader, write_tensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 5, generator=g)),
            ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
            ("c", torch.arange(12, dtype=torch.int64).reshape(3, 4)),
            ("d", torch.randn(4, 4, generator=g)[:, 1])]  # non-contiguous view


def test_single_file_roundtrip(tmp_path):
    ts = _tensors()
    names = write_tensors(str(tmp_path), [(n, tuple(t.shape), t.dtype) for n, t in ts], iter(ts))
    assert names == ["model.safetensors"]
    back = load_file(str(tmp_path / "model.safetensors"))
    for n, t in ts:
        assert torch.equal(back[n], t), n
    assert not list(tmp_path.glob("*.tmp"))


def test_shards_and_index(tmp_path):
    ts = _tensors()
    names = write_tensors(str(tmp_path), [(n, tuple(t.shape), t.dtype) for n, t in ts], iter(ts),
                          max_shard_bytes=64)
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert set(index["weight_map"]) == {"a", "b", "c", "d"}
    reader = HFCheckpointReader(str(tmp_path))
    for n, t in ts:
        assert torch.equal(reader.get(n), t) and reader.shape(n) == tuple(t.shape)


def test_layout_mismatch_is_an_error(tmp_path):
    ts = _tensors()
    with pytest.raises(ValueError, match="'a' .*does not match the planned 'a' \\(3, 4\\)"):
        write_tensors(str(tmp_path), [("a", (3, 4), torch.float32)], iter(ts[:1]))
    assert not os.path.exists(tmp_path / "model.safetensors")


def test_reader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        HFCheckpointReader(str(tmp_path))
    ts = _tensors()[:1]
    write_tensors(str(tmp_path), [("a", (3, 5), torch.float32)], iter(ts))
    with pytest.raises(KeyError, match="'zzz' not found"):
        HFCheckpointReader(str(tmp_path)).get("zzz")
