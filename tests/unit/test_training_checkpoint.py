"""Checkpoint manifests: sizes and CRC-32 of every file, verification, and ``resume: auto``
falling back past partial or corrupt checkpoints; the fault-injection hook."""

import json
import logging
import os
import signal
import time

import pytest

from cooper_mcore.checkpoint.manifest import MANIFEST, complete_checkpoints, verify_checkpoint, write_manifest
from cooper_mcore.checkpoint.training import _prune, find_resume
from cooper_mcore.train.faults import FAULT_ENV, fault_point, format_fault, parse_fault


def _fake_checkpoint(root, step, payload=b"123456789"):
    """A folder shaped like a training checkpoint, with its manifest."""
    path = root / f"step_{step}"
    (path / "policy").mkdir(parents=True)
    (path / "rng").mkdir()
    (path / "policy" / "__0_0.distcp").write_bytes(payload * 1000)
    (path / "rng" / "rank0.pt").write_bytes(b"rng" + bytes([step]))
    (path / "trainer.json").write_text(json.dumps({"step": step}))
    write_manifest(str(path))
    return path


def test_manifest_lists_every_file_with_size_and_crc32(tmp_path):
    path = tmp_path / "step_1"
    (path / "a").mkdir(parents=True)
    (path / "a" / "x.bin").write_bytes(b"123456789")
    (path / "empty").write_bytes(b"")
    m = write_manifest(str(path))
    # 0xCBF43926 is the published CRC-32 check value of "123456789"; CRC-32 of nothing is 0
    assert m["files"] == {"a/x.bin": {"size": 9, "crc32": "cbf43926"}, "empty": {"size": 0, "crc32": "00000000"}}
    assert json.loads((path / MANIFEST).read_text())["files"] == m["files"]
    assert not (path / (MANIFEST + ".tmp")).exists()
    assert verify_checkpoint(str(path)) is None


def _truncate(path):
    f = path / "policy" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    return "policy/__0_0.distcp has 8900 bytes, the manifest says 9000"


def _flip(path):
    f = path / "policy" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[4321] ^= 0x10
    f.write_bytes(bytes(data))
    return "policy/__0_0.distcp has CRC-32"


def _delete_file(path):
    os.remove(path / "rng" / "rank0.pt")
    return "rng/rank0.pt is missing"


def _delete_manifest(path):
    os.remove(path / MANIFEST)
    return f"no {MANIFEST}"


def _garble_manifest(path):
    (path / MANIFEST).write_text('{"files": {"trainer.json": {"size": 3')
    return f"unreadable {MANIFEST}"


@pytest.mark.parametrize("damage", [_truncate, _flip, _delete_file, _delete_manifest, _garble_manifest])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 3)
    (tmp_path / "step_4.tmp").mkdir()  # a checkpoint whose writer was killed: ignored
    assert find_resume(str(tmp_path), "auto") == str(newest)
    reason = damage(newest)
    assert verify_checkpoint(str(newest)).startswith(reason)
    with caplog.at_level(logging.WARNING, logger="cooper_mcore.checkpoint.training"):
        assert find_resume(str(tmp_path), "auto") == str(tmp_path / "step_2")
    assert f"skipping checkpoint {newest}: {reason}" in caplog.text
    with pytest.raises(ValueError, match="is not a whole training checkpoint"):
        find_resume(str(newest), str(newest))  # an explicit path is verified too


def test_auto_without_checkpoints_starts_fresh_but_all_damaged_is_an_error(tmp_path):
    assert find_resume(str(tmp_path / "missing"), "auto") is None
    (tmp_path / "step_1.tmp").mkdir()
    assert find_resume(str(tmp_path), "auto") is None  # killed while writing the first checkpoint
    assert find_resume(str(tmp_path), "none") is None
    for step in (1, 2):
        _flip(_fake_checkpoint(tmp_path, step))
    with pytest.raises(ValueError, match=r"no whole checkpoint to resume from .*step_2 .*step_1 "):
        find_resume(str(tmp_path), "auto")


def test_prune_keeps_the_newest_with_a_manifest_and_drops_old_tmp_folders(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, step)
    (tmp_path / "step_2.tmp").mkdir()
    (tmp_path / "step_5.tmp").mkdir()  # newer than the current step: not ours to remove
    (tmp_path / "step_4").mkdir()  # no manifest: not counted as complete
    _prune(str(tmp_path), keep=2, current=4)
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_3", "step_4", "step_5.tmp"]
    assert complete_checkpoints(str(tmp_path)) == [2, 3]


def test_fault_spec_round_trip_and_errors():
    assert parse_fault("policy_update@3+0.05") == ("policy_update", 3, 0.05, signal.SIGKILL)
    assert parse_fault("rollout@2/TERM") == ("rollout", 2, 0.0, signal.SIGTERM)
    assert parse_fault(format_fault("ckpt_files", 2)) == ("ckpt_files", 2, 0.0, signal.SIGKILL)
    assert parse_fault(format_fault("rollout", 1, 0.125, signal.SIGTERM)) == ("rollout", 1, 0.125, signal.SIGTERM)
    assert parse_fault(format_fault("rollout", 3, sig=signal.SIGUSR1)) == ("rollout", 3, 0.0, signal.SIGUSR1)
    for bad in ("rollout", "rollout@x", "@2", "rollout@2+-1", "rollout@2/HUP"):
        with pytest.raises(ValueError, match=FAULT_ENV):
            parse_fault(bad)


def _child_status(spec, point, step, then_sleep):
    pid = os.fork()
    if pid == 0:
        os.environ[FAULT_ENV] = spec
        fault_point(point, step)
        time.sleep(then_sleep)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_fault_point_kills_only_at_its_point_and_step(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    fault_point("rollout", 1)  # no spec: nothing happens
    assert _child_status("rollout@2", "rollout", 1, 0) == 0  # another step
    assert _child_status("rollout@2", "rollout_x", 2, 0) == 0  # another point
    assert _child_status("rollout@2", "rollout", 2, 0) == -signal.SIGKILL
    assert _child_status("rollout@2/TERM", "rollout", 2, 0) == -signal.SIGTERM
    t = time.monotonic()
    assert _child_status("rollout@2+0.2", "rollout", 2, 30) == -signal.SIGKILL  # 0.2 s later
    assert 0.2 <= time.monotonic() - t < 10
