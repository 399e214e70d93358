"""The converter refuses truncated or inconsistent checkpoint files with a message naming the file,
the expected and actual size (truncation) or the tensor and its shapes (mismatch), instead of
megatron-core's bare ``EOFError`` or a silently wrong tensor."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest

from cooper_mcore.convert.checkpoint import hf_to_mcore, load_model_checkpoint, mcore_to_hf, read_meta
from cooper_mcore.models.tiny import save_tiny_hf_model


def _truncate(path, keep):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(keep)
    return size


def test_truncated_dist_checkpoint_shard_is_named_with_sizes(tiny_models, tmp_path):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    shard = sorted(p for p in os.listdir(bad) if p.endswith(".distcp"))[0]
    full = _truncate(bad / shard, 1000)
    # the expected size is the end of the last item stored in that shard: the whole file here
    msg = (rf"checkpoint shard '{re.escape(str(bad / shard))}' is truncated: expected at least {full} bytes, "
           r"found 1000 \(tensor '[\w./]+' is cut off\)")
    with pytest.raises(ValueError, match=msg):
        mcore_to_hf(str(bad), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()

    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    arch = read_meta(str(bad))[0]
    with single_process_world():
        model = build_model(arch, ParallelConfig(), init_weights=False)
        with pytest.raises(ValueError, match=msg):
            load_model_checkpoint(model, str(bad), arch)


def test_missing_dist_checkpoint_shard_or_metadata(tiny_models, tmp_path):
    _, ckpt = tiny_models[("llama", "causal_lm")]
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    shard = sorted(p for p in os.listdir(bad) if p.endswith(".distcp"))[-1]
    os.remove(bad / shard)
    with pytest.raises(ValueError, match=rf"checkpoint shard '{re.escape(str(bad / shard))}' is missing"):
        mcore_to_hf(str(bad), str(tmp_path / "out"))
    os.remove(bad / ".metadata")
    with pytest.raises(ValueError, match="no dist-checkpoint metadata"):
        mcore_to_hf(str(bad), str(tmp_path / "out"))


def test_truncated_safetensors_is_named_with_sizes(tmp_path):
    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2")
    path = os.path.join(hf_dir, "model.safetensors")
    full = _truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(ValueError, match=rf"'{re.escape(path)}' is truncated: expected at least {full} bytes, "
                                         rf"found {full - 100} \(tensor '[\w.]+' is cut off\)"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    _truncate(path, 20)  # inside the header
    with pytest.raises(ValueError, match=r"is truncated or not a safetensors file: its header needs \d+ bytes, "
                                         r"the file has 20"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    assert not (tmp_path / "mc").exists()


def _rewrite_header(path, edit):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def test_safetensors_header_inconsistent_with_its_shape(tmp_path):
    """A header whose shape disagrees with its byte range would read a wrong tensor: refused."""
    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2")
    path = os.path.join(hf_dir, "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"  # (96, 64) float32: 24576 bytes

    def shrink(header):
        header[name]["shape"] = [48, 64]

    _rewrite_header(path, shrink)
    with pytest.raises(ValueError, match=rf"tensor '{name}' of shape \(48, 64\) F32 needs 12288 bytes but its "
                                         r"data offsets span 24576"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))

    def garbage(header):
        header[name] = {"dtype": "F32"}

    _rewrite_header(path, garbage)
    with pytest.raises(ValueError, match=rf"tensor '{name}' has a malformed header entry"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))
