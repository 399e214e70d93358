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

from cooper_mcore.checkpoint.model import load_model_checkpoint, read_meta
from cooper_mcore.convert.hf import hf_to_mcore, mcore_to_hf
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


# --------------------------------------------------------------------------- full disk
# megatron-core's writer reports a full disk as torch's zip-writer error, wrapped twice (seen on a
# real full disk, and reproduced here under `ulimit -f`):
UNEXPECTED_POS = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _checkpoint_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        try:
            raise RuntimeError(UNEXPECTED_POS)
        except RuntimeError as inner:
            raise RuntimeError(f"Worker failure: {inner}") from inner
    except RuntimeError as worker:
        return CheckpointException("write", {0: (worker, [])})


def _leftovers(parent, name):
    return sorted(p for p in os.listdir(parent) if p.startswith(name))


def test_full_disk_in_hf_to_mcore_names_the_output_and_leaves_nothing(tmp_path, monkeypatch):
    import torch

    from cooper_mcore.files import NoSpaceLeftError

    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2")
    out = tmp_path / "mc"

    def full_disk(*args, **kwargs):  # megatron-core writes common.pt with torch.save
        raise RuntimeError(UNEXPECTED_POS)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=rf"no space left on device while writing the converted checkpoint "
                                      rf"'{re.escape(str(out))}' \(.* free on its file system; the writer said: "
                                      r".*unexpected pos 704 vs 598\)") as info:
        hf_to_mcore(hf_dir, str(out))
    assert isinstance(info.value, NoSpaceLeftError) and info.value.errno == 28
    assert info.value.filename == str(out) and str(info.value) == info.value.args[0]
    assert _leftovers(tmp_path, "mc") == []  # neither the output nor its temporary folder

    from megatron.core import dist_checkpointing

    monkeypatch.undo()
    monkeypatch.setattr(dist_checkpointing, "save", lambda *a, **k: (_ for _ in ()).throw(_checkpoint_exception()))
    with pytest.raises(NoSpaceLeftError, match=r"the writer said: .*unexpected pos 704 vs 598\)"):
        hf_to_mcore(hf_dir, str(out))
    assert _leftovers(tmp_path, "mc") == []


def test_full_disk_in_mcore_to_hf_names_the_output_and_leaves_nothing(tiny_models, tmp_path, monkeypatch):
    import errno

    from cooper_mcore.checkpoint import safetensors_io
    from cooper_mcore.files import NoSpaceLeftError

    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    out = tmp_path / "hf"
    written = []

    def write_all(f, data):  # the first bytes fit, then the disk is full
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(data))

    monkeypatch.setattr(safetensors_io, "_write_all", write_all)
    with pytest.raises(NoSpaceLeftError, match=rf"no space left on device while writing the exported model "
                                               rf"'{re.escape(str(out))}' .*No space left on device\)"):
        mcore_to_hf(ckpt, str(out), weights_only=True)
    assert _leftovers(tmp_path, "hf") == []


def test_a_short_unbuffered_write_is_completed(tmp_path):
    """A raw write may take only part of its bytes (a disk filling up): the rest is written, not lost."""
    from cooper_mcore.checkpoint.safetensors_io import _write_all

    class Short:
        name = "x"

        def __init__(self):
            self.out = bytearray()

        def write(self, b):
            n = min(3, len(b))
            self.out += bytes(b[:n])
            return n

    f = Short()
    _write_all(f, b"0123456789")
    assert bytes(f.out) == b"0123456789"
    f.write = lambda b: 0
    with pytest.raises(OSError, match="no bytes written"):
        _write_all(f, b"abc")


def test_full_disk_in_an_atomic_model_save_removes_the_partial_folder(tiny_models, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from cooper_mcore.checkpoint.model import save_model_checkpoint_atomic
    from cooper_mcore.files import NoSpaceLeftError
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    arch, hf_config, dtype = read_meta(ckpt)
    dest = tmp_path / "final"

    def fail(sharded, ckpt_dir, *args, **kwargs):
        with open(os.path.join(ckpt_dir, "__0_0.distcp"), "wb") as f:
            f.write(b"partial")  # something half-written
        raise _checkpoint_exception()

    monkeypatch.setattr(dist_checkpointing, "save", fail)
    with single_process_world():
        model = build_model(arch, ParallelConfig(), init_weights=False)
        with pytest.raises(NoSpaceLeftError, match=rf"while writing the model checkpoint '{re.escape(str(dest))}'"):
            save_model_checkpoint_atomic(model, str(dest), arch, hf_config, dtype, extra_from=ckpt)
    assert _leftovers(tmp_path, "final") == []


def test_no_space_detection(tmp_path, monkeypatch):
    import errno
    import shutil as shutil_mod
    from collections import namedtuple

    from cooper_mcore.files import NoSpaceLeftError, explain_write_errors, is_no_space

    assert is_no_space(RuntimeError(UNEXPECTED_POS)) and is_no_space(_checkpoint_exception())
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert is_no_space(wrapped)
    assert not is_no_space(ValueError("tensor 'x': shape (2,) vs (3,)")) and not is_no_space(OSError(13, "denied"))

    out = str(tmp_path / "out")  # not made yet: the free space of its parent's file system counts
    with pytest.raises(RuntimeError, match="^some failure$"):  # other errors pass unchanged
        with explain_write_errors(out):
            raise RuntimeError("some failure")
    # an I/O error while the disk is all but full is a full disk, whatever its message
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_mod, "disk_usage", lambda p: usage(10**9, 10**9 - 100, 100))
    with pytest.raises(NoSpaceLeftError, match=rf"'{re.escape(out)}' \(100 bytes free on its file system; the "
                                               r"writer said: some failure\)"):
        with explain_write_errors(out):
            raise RuntimeError("some failure")
    with pytest.raises(ValueError, match="^shape$"):  # not an I/O error: unchanged even then
        with explain_write_errors(out):
            raise ValueError("shape")


# --------------------------------------------------------------------------- damaged metadata


def test_broken_config_json_is_named_with_line_and_column(tmp_path):
    hf_dir = save_tiny_hf_model(str(tmp_path / "hf"), "qwen2")
    path = os.path.join(hf_dir, "config.json")
    with open(path, "w") as f:
        f.write('{\n  "hidden_size": 64,\n  "vocab_size": 128,,\n}\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(path)} is not valid JSON: Expecting property name enclosed "
                                         r"in double quotes at line 3, column 21; fix or restore the file$"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    with open(path, "w") as f:
        json.dump({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64}, f)
    with pytest.raises(ValueError, match=rf"^{re.escape(path)}: config has no integer 'num_hidden_layers', "
                                         r"'intermediate_size', 'num_attention_heads', 'vocab_size'$"):
        hf_to_mcore(hf_dir, str(tmp_path / "mc"))
    assert _leftovers(tmp_path, "mc") == []


def test_broken_cooper_model_json_is_named(tiny_models, tmp_path):
    _, ckpt = tiny_models[("qwen2", "causal_lm")]
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    path = bad / "cooper_model.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # cut off
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} is not valid JSON: .* at line \d+, column \d+"):
        mcore_to_hf(str(bad), str(tmp_path / "out"))
    meta = json.loads(text)
    meta["dtype"] = "float8"
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: unknown dtype 'float8'"):
        read_meta(str(bad))
    del meta["arch"]
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} has no 'arch'"):
        read_meta(str(bad))
    assert _leftovers(tmp_path, "out") == []


def test_another_backend_or_garbage_common_pt_is_a_clear_error(tiny_models, tmp_path):
    from cooper_mcore.models.builder import build_model
    from cooper_mcore.parallel import ParallelConfig, single_process_world

    _, ckpt = tiny_models[("llama", "causal_lm")]
    other = tmp_path / "zarr"
    shutil.copytree(ckpt, other)
    (other / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                     "common_backend": "torch", "common_backend_version": 1}))
    garbage = tmp_path / "garbage"
    shutil.copytree(ckpt, garbage)
    (garbage / "common.pt").write_bytes(bytes(range(256)) * 3)
    backend = (rf"checkpoint '{re.escape(str(other))}' is not a torch_dist checkpoint: metadata.json says "
               r"backend 'zarr'")
    common = rf"checkpoint '{re.escape(str(garbage))}': common.pt is unreadable \(\w+: .*\)"
    for bad, msg in ((other, backend), (garbage, common)):
        with pytest.raises(ValueError, match=msg) as info:
            mcore_to_hf(str(bad), str(tmp_path / "out"))
        assert "weights_only" not in str(info.value)  # not torch's advice to load it unsafely
        assert _leftovers(tmp_path, "out") == []
        arch = read_meta(str(bad))[0]
        with single_process_world():
            model = build_model(arch, ParallelConfig(), init_weights=False)
            with pytest.raises(ValueError, match=msg):
                load_model_checkpoint(model, str(bad), arch)
    (other / "metadata.json").write_text('{"sharded_backend": ')
    with pytest.raises(ValueError, match=rf"{re.escape(str(other / 'metadata.json'))} is not valid JSON"):
        mcore_to_hf(str(other), str(tmp_path / "out"))
    os.remove(other / "metadata.json")
    with pytest.raises(ValueError, match="is not a megatron-core distributed checkpoint \\(no metadata.json\\)"):
        mcore_to_hf(str(other), str(tmp_path / "out"))
